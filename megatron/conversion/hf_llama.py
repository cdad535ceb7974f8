"""Hugging Face LLaMA (``LlamaForCausalLM``, GQA included) <-> Megatron full (TP=1) state dict.

``q_proj``/``k_proj``/``v_proj`` become the per-K/V-group fused QKV (see :mod:`megatron.layout.qkv`);
``gate_proj``/``up_proj`` become ``dense_h_to_4h = [gate; up]``; ``o_proj`` -> ``self_attention.dense``,
``down_proj`` -> ``dense_4h_to_h``. HF's q/k rows are already in the rotate-half ("half-split") RoPE convention our
model uses, so no permutation is applied (the golden logits test proves it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megatron.config.model import ModelConfig
from megatron.config.moe import MoEConfig
from megatron.config.rules import padded_vocab_size
from megatron.conversion.hf_common import (
    MegatronKeys,
    StrictKeys,
    config_to_dict,
    fold_layernorm_1p,
    require_size,
)
from megatron.layout.names import FINAL_NORM, OUTPUT_LAYER, WORD_EMBEDDINGS, layer_prefix
from megatron.layout.qkv import fuse_qkv, split_qkv
from megatron.layout.vocab import repad_vocab


def rope_theta(cfg: Mapping[str, Any], model: str = "LLaMA") -> float:
    """RoPE base from transformers 4 (``rope_theta``/``rope_scaling``) or 5 (``rope_parameters``) configs.

    Raises:
        ValueError: a scaled RoPE (``rope_type`` other than ``default``), naming ``model``.
    """
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = (
        params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    )
    if rope_type != "default":
        raise ValueError(
            f"{model} config uses rope_type '{rope_type}' (scaled RoPE); Trident implements plain RoPE only."
        )
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return float(theta)


def import_attention_and_norms(
    keys: StrictKeys, i: int, *, num_heads: int, num_groups: int, head_dim: int
) -> dict[str, torch.Tensor]:
    """Layer ``i``'s two RMSNorm weights and attention (q/k/v fused per K/V group, o_proj -> dense), Megatron names,
    from an HF LLaMA-family state dict (LLaMA, Mixtral: ``model.layers.{i}.self_attn.*``)."""
    src, dst = f"layers.{i}.", layer_prefix(i) + "."
    out = {
        f"{dst}{norm}.weight": keys.take(f"{src}{norm}.weight").clone()
        for norm in ("input_layernorm", "post_attention_layernorm")
    }
    out[f"{dst}self_attention.query_key_value.weight"] = fuse_qkv(
        keys.take(f"{src}self_attn.q_proj.weight"),
        keys.take(f"{src}self_attn.k_proj.weight"),
        keys.take(f"{src}self_attn.v_proj.weight"),
        num_heads=num_heads,
        num_groups=num_groups,
        head_dim=head_dim,
    )
    out[f"{dst}self_attention.dense.weight"] = keys.take(f"{src}self_attn.o_proj.weight").clone()
    return out


def export_attention_and_norms(
    take: MegatronKeys, i: int, *, num_heads: int, num_groups: int, head_dim: int
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`import_attention_and_norms`: HF names (``model.layers.{i}.*``) of layer ``i``."""
    src, dst = layer_prefix(i) + ".", f"model.layers.{i}."
    q, k, v = split_qkv(
        take(f"{src}self_attention.query_key_value.weight"),
        num_heads=num_heads,
        num_groups=num_groups,
        head_dim=head_dim,
    )
    out = {
        f"{dst}self_attn.q_proj.weight": q,
        f"{dst}self_attn.k_proj.weight": k,
        f"{dst}self_attn.v_proj.weight": v,
        f"{dst}self_attn.o_proj.weight": take(f"{src}self_attention.dense.weight").clone(),
    }
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"{dst}{norm}.weight"] = take(f"{src}{norm}.weight").clone()
    return out


def _check_llama_config(cfg: Mapping[str, Any]) -> None:
    model_type = cfg.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"config.json model_type is '{model_type}'; this converter reads 'llama'.")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(
            f"LLaMA hidden_act '{act}' is not supported; Trident's --swiglu uses SiLU."
        )
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key, False):
            raise ValueError(
                f"LLaMA config {key}=True is not supported (Trident's LLaMA preset has no linear biases)."
            )


def llama_hf_to_megatron(
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config: Any,
    *,
    padded_vocab: int | None = None,
    make_vocab_size_divisible_by: int = 128,
) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Convert an HF LLaMA state dict into Megatron's full (TP=1) fp32 state dict.

    Args:
        hf_state_dict: ``LlamaForCausalLM`` (``model.*`` + ``lm_head.weight``) or ``LlamaModel`` state dict.
        hf_config: its ``config.json`` dict or ``LlamaConfig``.
        padded_vocab: rows of the Megatron embedding/output layer; default Megatron's padding at TP=1.
        make_vocab_size_divisible_by: used for the default padding and recorded in the returned config.

    Returns:
        ``(state_dict, model_config)`` with rmsnorm, swiglu, RoPE, no biases, GQA groups from
        ``num_key_value_heads``; ``vocab_size`` in the config is the true vocabulary.
    """
    cfg = config_to_dict(hf_config)
    _check_llama_config(cfg)

    def mlp(keys: StrictKeys, i: int) -> dict[str, torch.Tensor]:
        src, dst = f"layers.{i}.mlp.", layer_prefix(i) + ".mlp."
        gate_up = torch.cat(
            [keys.take(f"{src}gate_proj.weight"), keys.take(f"{src}up_proj.weight")]
        )
        return {
            f"{dst}dense_h_to_4h.weight": gate_up,  # [ffn, h] + [ffn, h] -> [2*ffn, h] = [gate; up]
            f"{dst}dense_4h_to_h.weight": keys.take(f"{src}down_proj.weight").clone(),
        }

    family = LlamaFamily(model="LLaMA", mlp=mlp, default_max_positions=2048, default_eps=1e-6)
    return import_llama_family(
        hf_state_dict,
        cfg,
        family,
        padded_vocab=padded_vocab,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
    )


MlpImport = Callable[[StrictKeys, int], dict[str, torch.Tensor]]
"""``(HF keys, layer i) -> Megatron tensors`` of layer ``i``'s MLP (dense, or Mixtral's experts and router)."""


@dataclass(frozen=True)
class LlamaFamily:
    """What differs between the members of the LLaMA family (LLaMA, Mixtral) on import."""

    model: str
    """The family's name in errors (``LLaMA``, ``Mixtral``)."""
    mlp: MlpImport
    """Converts each layer's MLP (dense, or the experts and router)."""
    default_max_positions: int
    """``max_position_embeddings`` when ``config.json`` has none (the family's default)."""
    default_eps: float
    """``rms_norm_eps`` when ``config.json`` has none (the family's default)."""
    moe: MoEConfig | None = None
    """The ``ModelConfig.moe`` of the imported model (Mixtral); None: dense."""


def import_llama_family(
    hf_state_dict: Mapping[str, torch.Tensor],
    cfg: Mapping[str, Any],
    family: LlamaFamily,
    *,
    padded_vocab: int | None,
    make_vocab_size_divisible_by: int,
) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """What LLaMA and Mixtral imports share: embeddings, attention and norms of every layer, the final norm and
    head (tied or not), and the ``ModelConfig`` (rmsnorm, swiglu, RoPE, no biases, GQA; ``family.moe`` for
    Mixtral). ``family.mlp`` converts each layer's MLP; every HF tensor must be used (``check_all_used``)."""
    model = family.model
    h = require_size(cfg, "hidden_size", model)
    n = require_size(cfg, "num_attention_heads", model)
    g = int(cfg.get("num_key_value_heads") or n)
    hn = int(cfg.get("head_dim") or h // n)
    layers = require_size(cfg, "num_hidden_layers", model)
    ffn = require_size(cfg, "intermediate_size", model)
    vocab = require_size(cfg, "vocab_size", model)
    tied = bool(cfg.get("tie_word_embeddings", False))
    pad = padded_vocab or padded_vocab_size(vocab, make_vocab_size_divisible_by)

    keys = StrictKeys(
        hf_state_dict, prefix="model.", ignore_suffixes=(".rotary_emb.inv_freq",), model=model
    )
    out: dict[str, torch.Tensor] = {
        WORD_EMBEDDINGS: repad_vocab(keys.take("embed_tokens.weight"), vocab, pad)
    }
    for i in range(layers):
        out.update(import_attention_and_norms(keys, i, num_heads=n, num_groups=g, head_dim=hn))
        out.update(family.mlp(keys, i))
    out[f"{FINAL_NORM}.weight"] = keys.take("norm.weight").clone()
    if keys.has("lm_head.weight"):
        lm_head = keys.take("lm_head.weight")
        if not tied:
            out[OUTPUT_LAYER] = repad_vocab(lm_head, vocab, pad)
        elif not torch.equal(lm_head, keys.take("embed_tokens.weight")):
            raise ValueError(
                f"{model} config says tie_word_embeddings=True but lm_head.weight differs from embed_tokens."
            )
    elif not tied:
        raise ValueError(
            f"{model} config says tie_word_embeddings=False but lm_head.weight is missing."
        )
    keys.check_all_used()

    max_pos = require_size(
        cfg, "max_position_embeddings", model, default=family.default_max_positions
    )
    model_config = ModelConfig(
        num_layers=layers,
        hidden_size=h,
        num_attention_heads=n,
        num_key_value_heads=g,
        kv_channels=hn if hn * n != h else None,
        ffn_hidden_size=ffn,
        seq_length=max_pos,
        max_position_embeddings=max_pos,
        normalization="rmsnorm",
        layernorm_epsilon=float(cfg.get("rms_norm_eps", family.default_eps)),
        swiglu=True,
        use_rotary_position_embeddings=True,
        rotary_position_embeddings_theta=rope_theta(cfg, model),
        add_bias_linear=False,
        untie_embeddings_and_output_weights=not tied,
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        vocab_size=vocab,
        **({} if family.moe is None else {"moe": family.moe}),
    )
    return out, model_config


def _check_exportable(m: ModelConfig) -> None:
    problems = []
    if m.normalization != "rmsnorm":
        problems.append("--normalization must be rmsnorm")
    if not m.swiglu:
        problems.append("--swiglu must be on")
    if not m.use_rotary_position_embeddings:
        problems.append("--use-rotary-position-embeddings must be on")
    if m.rotary_percent != 1.0:
        problems.append(
            f"--rotary-percent must be 1 (HF LLaMA rotates every channel; got {m.rotary_percent})"
        )
    if m.add_bias_linear:
        problems.append("--disable-bias-linear must be on")
    if problems:
        raise ValueError(
            "this model cannot be exported as HF LLaMA: "
            + "; ".join(problems)
            + ". Export GPT-2-style models with megatron_to_gpt2_hf."
        )


def megatron_to_llama_hf(
    full_state_dict: Mapping[str, torch.Tensor],
    model_config: ModelConfig,
    true_vocab_size: int,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Convert Megatron's full (TP=1) state dict into an HF ``LlamaForCausalLM`` state dict and config.

    Args:
        full_state_dict: Megatron names, merged over TP and PP.
        model_config: the LLaMA-shaped architecture (rmsnorm, swiglu, RoPE, no biases).
        true_vocab_size: the tokenizer's vocabulary; padding rows beyond it are dropped.
        bos_token_id, eos_token_id: the tokenizer's special ids for ``config.json`` (e.g. 50256 for GPT-2's
            ``<|endoftext|>``); None writes null instead of transformers' model-specific defaults.

    Returns:
        ``(hf_state_dict, config_dict)``: ``model.*`` (+ ``lm_head.weight`` when untied) fp32 contiguous tensors
        and a ``config.json`` dict readable by transformers 4 and 5.
    """
    _check_exportable(model_config)

    def mlp(take: MegatronKeys, i: int) -> dict[str, torch.Tensor]:
        src, dst = layer_prefix(i) + ".", f"model.layers.{i}.mlp."
        gate, up = split_gate_up(take, f"{src}mlp.dense_h_to_4h.weight", model_config.ffn_size)
        return {
            f"{dst}gate_proj.weight": gate,
            f"{dst}up_proj.weight": up,
            f"{dst}down_proj.weight": take(f"{src}mlp.dense_4h_to_h.weight").clone(),
        }

    out, config = export_llama_family(
        full_state_dict, model_config, true_vocab_size, mlp, bos_token_id, eos_token_id
    )
    config.update(
        architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, mlp_bias=False
    )
    return out, config


MlpExport = Callable[[MegatronKeys, int], dict[str, torch.Tensor]]
"""``(take, layer i) -> HF tensors`` of layer ``i``'s MLP (dense, or Mixtral's experts and router)."""


def split_gate_up(take: MegatronKeys, key: str, ffn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The SwiGLU ``dense_h_to_4h`` weight ``key`` (``[2f, h] = [gate; up]``) as HF's ``(gate, up)``, each ``[f, h]``.

    Raises:
        ValueError: the weight does not have ``2 * ffn`` rows.
    """
    gate_up = take(key)
    if gate_up.shape[0] != 2 * ffn:
        raise ValueError(
            f"{key} has {gate_up.shape[0]} rows; --swiglu with --ffn-hidden-size {ffn} needs {2 * ffn}."
        )
    return gate_up[:ffn].clone(), gate_up[ffn:].clone()


def export_llama_family(
    full_state_dict: Mapping[str, torch.Tensor],
    model_config: ModelConfig,
    true_vocab_size: int,
    mlp: MlpExport,
    bos_token_id: int | None,
    eos_token_id: int | None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What LLaMA and Mixtral exports share: embeddings, attention and norms of every layer, the final norm, the
    untied head, and the common ``config.json`` keys (the caller adds ``architectures``, ``model_type`` and its
    own). ``mlp`` converts each layer's MLP; every Megatron tensor must be used (``check_all_used``)."""
    full_state_dict, m = fold_layernorm_1p(full_state_dict, model_config)
    n, g, hn = m.num_attention_heads, m.num_query_groups, m.head_dim
    take = MegatronKeys(full_state_dict)
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": repad_vocab(
            take(WORD_EMBEDDINGS), true_vocab_size, true_vocab_size
        )
    }
    for i in range(m.num_layers):
        out.update(export_attention_and_norms(take, i, num_heads=n, num_groups=g, head_dim=hn))
        out.update(mlp(take, i))
    out["model.norm.weight"] = take(f"{FINAL_NORM}.weight").clone()
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = repad_vocab(take(OUTPUT_LAYER), true_vocab_size, true_vocab_size)
    take.check_all_used()
    theta = m.rotary_position_embeddings_theta
    config: dict[str, Any] = {
        "vocab_size": true_vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": n,
        "num_key_value_heads": g,
        "head_dim": hn,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_positions,
        "rms_norm_eps": m.layernorm_epsilon,
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_dropout": m.attention_dropout,
        "initializer_range": m.init_method_std,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
    return out, config
