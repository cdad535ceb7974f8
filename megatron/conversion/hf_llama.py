"""Hugging Face LLaMA, Qwen2, Qwen3 and Mistral (``*ForCausalLM``, GQA included) <-> Megatron full (TP=1) state
dict. The families differ only in their attention and config keys (:mod:`megatron.conversion.hf_features`).

``q_proj``/``k_proj``/``v_proj`` (weights, and Qwen2's biases) become the per-K/V-group fused QKV (see
:mod:`megatron.layout.qkv`); Qwen3's ``q_norm``/``k_norm`` become ``self_attention.q_layernorm``/``k_layernorm``;
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
from megatron.conversion.hf_features import (
    RULES,
    FamilyRules,
    attention_fields,
    export_family,
    rope_fields,
    rope_to_hf,
    window_config,
    window_fields,
)
from megatron.layout.names import FINAL_NORM, OUTPUT_LAYER, WORD_EMBEDDINGS, layer_prefix
from megatron.layout.qkv import fuse_qkv, split_qkv
from megatron.layout.vocab import repad_vocab


@dataclass(frozen=True)
class HeadLayout:
    """The attention heads of a LLaMA-family layer and what its projections carry besides weights."""

    num_heads: int
    """Query heads ``n``."""
    num_groups: int
    """K/V heads ``G`` (GQA groups)."""
    head_dim: int
    """Channels per head ``hn``."""
    qkv_bias: bool = False
    """q/k/v have biases (Qwen2; ``--add-qkv-bias``)."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k (Qwen3 ``q_norm``/``k_norm``; ``--qk-layernorm``), weights ``[hn]``."""

    @classmethod
    def of(cls, m: ModelConfig) -> HeadLayout:
        """The heads of a ``ModelConfig``."""
        return cls(
            m.num_attention_heads, m.num_query_groups, m.head_dim, m.add_qkv_bias, m.qk_layernorm
        )

    def fuse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """HF q/k/v rows (weights or biases) -> Megatron's fused per-group QKV rows."""
        return fuse_qkv(
            q, k, v, num_heads=self.num_heads, num_groups=self.num_groups, head_dim=self.head_dim
        )

    def split(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`fuse`."""
        return split_qkv(
            fused, num_heads=self.num_heads, num_groups=self.num_groups, head_dim=self.head_dim
        )


QK_NORMS = (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm"))
"""HF (Qwen3) and Megatron names of the per-head query and key norms."""


def import_attention_and_norms(
    keys: StrictKeys, i: int, heads: HeadLayout
) -> dict[str, torch.Tensor]:
    """Layer ``i``'s two RMSNorm weights and attention (q/k/v fused per K/V group, biases likewise, o_proj -> dense,
    Qwen3's q_norm/k_norm), Megatron names, from an HF LLaMA-family state dict (``model.layers.{i}.self_attn.*``)."""
    src, dst = f"layers.{i}.", layer_prefix(i) + "."
    out = {
        f"{dst}{norm}.weight": keys.take(f"{src}{norm}.weight").clone()
        for norm in ("input_layernorm", "post_attention_layernorm")
    }
    attn, ours = f"{src}self_attn.", f"{dst}self_attention."
    parts = ("weight", "bias") if heads.qkv_bias else ("weight",)
    for part in parts:
        q, k, v = (keys.take(f"{attn}{x}_proj.{part}") for x in "qkv")
        out[f"{ours}query_key_value.{part}"] = heads.fuse(q, k, v)
    out[f"{ours}dense.weight"] = keys.take(f"{attn}o_proj.weight").clone()
    if heads.qk_norm:
        for hf, megatron in QK_NORMS:
            out[f"{ours}{megatron}.weight"] = keys.take(f"{attn}{hf}.weight").clone()  # [hn]
    return out


def export_attention_and_norms(
    take: MegatronKeys, i: int, heads: HeadLayout
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`import_attention_and_norms`: HF names (``model.layers.{i}.*``) of layer ``i``."""
    src, dst = layer_prefix(i) + ".self_attention.", f"model.layers.{i}."
    out: dict[str, torch.Tensor] = {}
    parts = ("weight", "bias") if heads.qkv_bias else ("weight",)
    for part in parts:
        q, k, v = heads.split(take(f"{src}query_key_value.{part}"))
        out.update({f"{dst}self_attn.{x}_proj.{part}": t for x, t in zip("qkv", (q, k, v))})
    out[f"{dst}self_attn.o_proj.weight"] = take(f"{src}dense.weight").clone()
    if heads.qk_norm:
        for hf, megatron in QK_NORMS:
            out[f"{dst}self_attn.{hf}.weight"] = take(f"{src}{megatron}.weight").clone()
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"{dst}{norm}.weight"] = take(f"{layer_prefix(i)}.{norm}.weight").clone()
    return out


def _check_family_config(cfg: Mapping[str, Any], model_type: str) -> FamilyRules:
    given = cfg.get("model_type", model_type)
    if given != model_type:
        raise ValueError(
            f"config.json model_type is '{given}'; this converter reads '{model_type}'."
        )
    rules = RULES[model_type]
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(
            f"{rules.name} hidden_act '{act}' is not supported; Trident's --swiglu uses SiLU."
        )
    return rules


def dense_mlp_from_hf(keys: StrictKeys, i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s SwiGLU MLP (``gate_proj``/``up_proj``/``down_proj``), Megatron names."""
    src, dst = f"layers.{i}.mlp.", layer_prefix(i) + ".mlp."
    gate_up = torch.cat([keys.take(f"{src}gate_proj.weight"), keys.take(f"{src}up_proj.weight")])
    return {
        f"{dst}dense_h_to_4h.weight": gate_up,  # [ffn, h] + [ffn, h] -> [2*ffn, h] = [gate; up]
        f"{dst}dense_4h_to_h.weight": keys.take(f"{src}down_proj.weight").clone(),
    }


def llama_hf_to_megatron(
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config: Any,
    *,
    padded_vocab: int | None = None,
    make_vocab_size_divisible_by: int = 128,
    model_type: str = "llama",
) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Convert an HF LLaMA, Qwen2, Qwen3 or Mistral state dict into Megatron's full (TP=1) fp32 state dict.

    Args:
        hf_state_dict: ``*ForCausalLM`` (``model.*`` + ``lm_head.weight``) or bare ``*Model`` state dict.
        hf_config: its ``config.json`` dict or transformers config.
        padded_vocab: rows of the Megatron embedding/output layer; default Megatron's padding at TP=1.
        make_vocab_size_divisible_by: used for the default padding and recorded in the returned config.
        model_type: the family (one of :data:`hf_features.FAMILIES`); ``config.json`` must say the same.

    Returns:
        ``(state_dict, model_config)`` with rmsnorm, swiglu, RoPE (scaled as the config says), no linear biases
        but Qwen2's on q/k/v, GQA groups from ``num_key_value_heads``, ``head_dim``, Qwen3's QK-norm, the sliding
        window; ``vocab_size`` in the config is the true vocabulary.

    Raises:
        ValueError: what the family has and Trident cannot express (named), or keys missing / left unmapped.
    """
    cfg = config_to_dict(hf_config)
    rules = _check_family_config(cfg, model_type)
    family = LlamaFamily(
        model=rules.name,
        mlp=dense_mlp_from_hf,
        default_max_positions=rules.default_max_positions,
        default_eps=1e-6,
        rules=rules,
    )
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
    """What differs between the members of the LLaMA family (LLaMA, Qwen2, Qwen3, Mistral, Mixtral) on import."""

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
    rules: FamilyRules | None = None
    """The attention and window keys of a dense family (``hf_features.RULES``); None: plain LLaMA attention, no
    window (Mixtral checks its own)."""


def _family_fields(cfg: Mapping[str, Any], family: LlamaFamily) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments of the family's attention, window, RoPE and MoE."""
    fields = rope_fields(cfg, family.model)
    if family.rules is not None:
        fields.update(attention_fields(cfg, family.rules))
        fields.update(window_fields(cfg, family.rules))
    if family.moe is not None:
        fields["moe"] = family.moe
    return fields


def _head_layout(cfg: Mapping[str, Any], model: str, fields: Mapping[str, Any]) -> HeadLayout:
    n = require_size(cfg, "num_attention_heads", model)
    h = require_size(cfg, "hidden_size", model)
    head_dim = require_size(cfg, "head_dim", model, default=h // n or 1)
    return HeadLayout(
        num_heads=n,
        num_groups=require_size(cfg, "num_key_value_heads", model, default=n),
        head_dim=head_dim,
        qkv_bias=bool(fields.get("add_qkv_bias")),
        qk_norm=bool(fields.get("qk_layernorm")),
    )


def _embeddings_and_head(
    keys: StrictKeys, model: str, *, vocab: int, pad: int, tied: bool
) -> dict[str, torch.Tensor]:
    out = {WORD_EMBEDDINGS: repad_vocab(keys.take("embed_tokens.weight"), vocab, pad)}
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
    return out


def import_llama_family(
    hf_state_dict: Mapping[str, torch.Tensor],
    cfg: Mapping[str, Any],
    family: LlamaFamily,
    *,
    padded_vocab: int | None,
    make_vocab_size_divisible_by: int,
) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """What the LLaMA-family imports share: embeddings, attention and norms of every layer, the final norm and
    head (tied or not), and the ``ModelConfig`` (rmsnorm, swiglu, RoPE, GQA, the family's attention extras and
    window; ``family.moe`` for Mixtral). ``family.mlp`` converts each layer's MLP; every HF tensor must be used
    (``check_all_used``). The config is checked before any tensor is read."""
    model = family.model
    fields = _family_fields(cfg, family)
    heads = _head_layout(cfg, model, fields)
    h = require_size(cfg, "hidden_size", model)
    layers = require_size(cfg, "num_hidden_layers", model)
    vocab = require_size(cfg, "vocab_size", model)
    tied = bool(cfg.get("tie_word_embeddings", False))
    pad = padded_vocab or padded_vocab_size(vocab, make_vocab_size_divisible_by)

    keys = StrictKeys(
        hf_state_dict, prefix="model.", ignore_suffixes=(".rotary_emb.inv_freq",), model=model
    )
    out = _embeddings_and_head(keys, model, vocab=vocab, pad=pad, tied=tied)
    for i in range(layers):
        out.update(import_attention_and_norms(keys, i, heads))
        out.update(family.mlp(keys, i))
    keys.check_all_used()

    max_pos = require_size(
        cfg, "max_position_embeddings", model, default=family.default_max_positions
    )
    model_config = ModelConfig(
        num_layers=layers,
        hidden_size=h,
        num_attention_heads=heads.num_heads,
        num_key_value_heads=heads.num_groups,
        kv_channels=heads.head_dim if heads.head_dim * heads.num_heads != h else None,
        ffn_hidden_size=require_size(cfg, "intermediate_size", model),
        seq_length=max_pos,
        max_position_embeddings=max_pos,
        normalization="rmsnorm",
        layernorm_epsilon=float(cfg.get("rms_norm_eps", family.default_eps)),
        swiglu=True,
        use_rotary_position_embeddings=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=not tied,
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        vocab_size=vocab,
        **fields,
    )
    return out, model_config


def _check_exportable(m: ModelConfig, model: str = "LLaMA") -> None:
    problems = []
    if m.normalization != "rmsnorm":
        problems.append("--normalization must be rmsnorm")
    if not m.swiglu:
        problems.append("--swiglu must be on")
    if not m.use_rotary_position_embeddings:
        problems.append("--use-rotary-position-embeddings must be on")
    if m.rotary_percent != 1.0:
        problems.append(
            f"--rotary-percent must be 1 (HF {model} rotates every channel; got {m.rotary_percent})"
        )
    if m.add_bias_linear:
        problems.append("--disable-bias-linear must be on")
    if problems:
        raise ValueError(
            f"this model cannot be exported as HF {model}: "
            + "; ".join(problems)
            + ". Export GPT-2-style models with megatron_to_gpt2_hf."
        )


def dense_mlp_to_hf(ffn: int) -> MlpExport:
    """Inverse of :func:`dense_mlp_from_hf` for an MLP of width ``ffn``."""

    def mlp(take: MegatronKeys, i: int) -> dict[str, torch.Tensor]:
        src, dst = layer_prefix(i) + ".", f"model.layers.{i}.mlp."
        gate, up = split_gate_up(take, f"{src}mlp.dense_h_to_4h.weight", ffn)
        return {
            f"{dst}gate_proj.weight": gate,
            f"{dst}up_proj.weight": up,
            f"{dst}down_proj.weight": take(f"{src}mlp.dense_4h_to_h.weight").clone(),
        }

    return mlp


def megatron_to_llama_hf(
    full_state_dict: Mapping[str, torch.Tensor],
    model_config: ModelConfig,
    true_vocab_size: int,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    recorded_family: str | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Convert Megatron's full (TP=1) state dict into an HF LLaMA, Qwen2, Qwen3 or Mistral state dict and config
    (the family :func:`hf_features.export_family` picks from the model's features and ``recorded_family``).

    Args:
        full_state_dict: Megatron names, merged over TP and PP.
        model_config: the LLaMA-shaped architecture (rmsnorm, swiglu, RoPE, no linear biases but QKV's).
        true_vocab_size: the tokenizer's vocabulary; padding rows beyond it are dropped.
        bos_token_id, eos_token_id: the tokenizer's special ids for ``config.json`` (e.g. 50256 for GPT-2's
            ``<|endoftext|>``); None writes null instead of transformers' model-specific defaults.
        recorded_family: the ``model_type`` the checkpoint was imported from (its meta's ``hf_model_type``).

    Returns:
        ``(hf_state_dict, config_dict)``: ``model.*`` (+ ``lm_head.weight`` when untied) fp32 contiguous tensors
        and a ``config.json`` dict readable by transformers 4 and 5.
    """
    model_type = export_family(model_config, recorded_family)
    rules = RULES[model_type]
    _check_exportable(model_config, rules.name)
    out, config = export_llama_family(
        full_state_dict,
        model_config,
        true_vocab_size,
        dense_mlp_to_hf(model_config.ffn_size),
        bos_token_id,
        eos_token_id,
    )
    config.update(architectures=[rules.architecture], model_type=model_type)
    config.update(window_config(model_config, rules))
    if model_type in ("llama", "qwen3"):
        config["attention_bias"] = False
    if model_type == "llama":
        config["mlp_bias"] = False
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
    """What the LLaMA-family exports share: embeddings, attention and norms of every layer (QKV biases and QK-norms
    when the model has them), the final norm, the untied head, and the common ``config.json`` keys, RoPE included
    (the caller adds ``architectures``, ``model_type`` and its own). ``mlp`` converts each layer's MLP; every Megatron tensor must be used (``check_all_used``)."""
    full_state_dict, m = fold_layernorm_1p(full_state_dict, model_config)
    take = MegatronKeys(full_state_dict)
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": repad_vocab(
            take(WORD_EMBEDDINGS), true_vocab_size, true_vocab_size
        )
    }
    heads = HeadLayout.of(m)
    for i in range(m.num_layers):
        out.update(export_attention_and_norms(take, i, heads))
        out.update(mlp(take, i))
    out["model.norm.weight"] = take(f"{FINAL_NORM}.weight").clone()
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = repad_vocab(take(OUTPUT_LAYER), true_vocab_size, true_vocab_size)
    take.check_all_used()
    config: dict[str, Any] = {
        "vocab_size": true_vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_positions,
        "rms_norm_eps": m.layernorm_epsilon,
        **rope_to_hf(m),
        "attention_dropout": m.attention_dropout,
        "initializer_range": m.init_method_std,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
    return out, config
