"""Hugging Face GPT-2 (``GPT2LMHeadModel``) <-> Megatron full (TP=1) state dict.

HF GPT-2 stores its linears as ``Conv1D`` (weight ``[in, out]``, ``y = x @ W + b``), so every weight is transposed
into Megatron's ``[out, in]``. ``c_attn`` rows (after the transpose) are ``[q (all heads); k; v]`` and become the
per-head interleave ``[q_h; k_h; v_h]`` (see :mod:`megatron.layout.qkv`). The embedding is padded with zero
rows to the padded vocabulary on import and stripped on export.

Activation: HF's ``activation_function`` ``"gelu"`` is the exact erf GeLU and ``"gelu_new"`` (GPT-2's default) the
tanh approximation. Our model computes the tanh approximation (:data:`MEGATRON_GELU`), so standard GPT-2
checkpoints convert exactly; importing one with ``"gelu"`` logs a warning (logits then differ by ~1e-3), and export
writes ``"gelu_new"``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from megatron.config.model import ModelConfig
from megatron.config.rules import padded_vocab_size
from megatron.conversion.hf_common import (
    MegatronKeys,
    StrictKeys,
    config_to_dict,
    fold_layernorm_1p,
    require_size,
)
from megatron.layout.names import (
    FINAL_NORM,
    OUTPUT_LAYER,
    POSITION_EMBEDDINGS,
    WORD_EMBEDDINGS,
    layer_prefix,
)
from megatron.layout.qkv import fuse_qkv, split_qkv
from megatron.layout.vocab import repad_vocab

logger = logging.getLogger(__name__)

MEGATRON_GELU = "gelu_new"
"""HF ``activation_function`` of megatron/model's GeLU: the tanh approximation (``megatron/model/mlp.py``)."""

_GELU_ALIASES = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new"}


def _check_gpt2_config(cfg: Mapping[str, Any]) -> None:
    model_type = cfg.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise ValueError(f"config.json model_type is '{model_type}'; this converter reads 'gpt2'.")
    act = cfg.get("activation_function", "gelu_new")
    if act not in _GELU_ALIASES:
        raise ValueError(
            f"GPT-2 activation_function '{act}' is not supported; Trident's GPT-2 uses GeLU "
            f"('{MEGATRON_GELU}' in HF terms)."
        )
    if _GELU_ALIASES[act] != MEGATRON_GELU:
        logger.warning(
            "GPT-2 activation_function is '%s' but Trident computes '%s'; the converted model's logits "
            "will differ slightly (~1e-3) from the HF model.",
            act,
            MEGATRON_GELU,
        )
    unsupported = {
        "scale_attn_weights": (cfg.get("scale_attn_weights", True), True),
        "scale_attn_by_inverse_layer_idx": (
            cfg.get("scale_attn_by_inverse_layer_idx", False),
            False,
        ),
        "add_cross_attention": (cfg.get("add_cross_attention", False), False),
    }
    for key, (value, wanted) in unsupported.items():
        if bool(value) != wanted:
            raise ValueError(
                f"GPT-2 config {key}={value} is not supported by Trident's attention (needs {wanted})."
            )


def gpt2_hf_to_megatron(
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config: Any,
    *,
    padded_vocab: int | None = None,
    make_vocab_size_divisible_by: int = 128,
) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Convert an HF GPT-2 state dict into Megatron's full (TP=1) fp32 state dict.

    Args:
        hf_state_dict: ``GPT2LMHeadModel`` (``transformer.*``, optional ``lm_head.weight``) or ``GPT2Model``
            state dict; any dtype.
        hf_config: its ``config.json`` dict or ``GPT2Config``.
        padded_vocab: rows of the Megatron embedding (>= vocab_size); default Megatron's padding at TP=1.
        make_vocab_size_divisible_by: used for the default padding and recorded in the returned config.

    Returns:
        ``(state_dict, model_config)``: Megatron names (see :mod:`megatron.layout.qkv`), and the
        ``ModelConfig`` with the flags that rebuild this architecture (``vocab_size`` = the true vocabulary).
    """
    cfg = config_to_dict(hf_config)
    _check_gpt2_config(cfg)
    h = require_size(cfg, "n_embd", "GPT-2")
    n = require_size(cfg, "n_head", "GPT-2")
    layers = require_size(cfg, "n_layer", "GPT-2")
    vocab = require_size(cfg, "vocab_size", "GPT-2")
    if h % n:
        raise ValueError(f"GPT-2 n_embd ({h}) is not divisible by n_head ({n}).")
    hn = h // n
    tied = bool(cfg.get("tie_word_embeddings", True))
    pad = padded_vocab or padded_vocab_size(vocab, make_vocab_size_divisible_by)

    keys = StrictKeys(
        hf_state_dict,
        prefix="transformer.",
        ignore_suffixes=(".attn.bias", ".attn.masked_bias"),
        model="GPT-2",
    )
    out: dict[str, torch.Tensor] = {
        WORD_EMBEDDINGS: repad_vocab(keys.take("wte.weight"), vocab, pad),
        POSITION_EMBEDDINGS: keys.take("wpe.weight").clone(),
    }
    for i in range(layers):
        src, dst = f"h.{i}.", layer_prefix(i) + "."
        for hf_ln, mg_ln in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            for p in ("weight", "bias"):
                out[f"{dst}{mg_ln}.{p}"] = keys.take(f"{src}{hf_ln}.{p}").clone()
        qkv_w = keys.take(f"{src}attn.c_attn.weight").t()  # [h, 3h] -> [3h, h] = [q; k; v]
        qkv_b = keys.take(f"{src}attn.c_attn.bias")  # [3h]
        heads = {"num_heads": n, "num_groups": n, "head_dim": hn}
        out[f"{dst}self_attention.query_key_value.weight"] = fuse_qkv(*qkv_w.split(h), **heads)
        out[f"{dst}self_attention.query_key_value.bias"] = fuse_qkv(*qkv_b.split(h), **heads)
        for hf_lin, mg_lin in (
            ("attn.c_proj", "self_attention.dense"),
            ("mlp.c_fc", "mlp.dense_h_to_4h"),
            ("mlp.c_proj", "mlp.dense_4h_to_h"),
        ):
            # Conv1D [in, out] -> Linear [out, in]
            out[f"{dst}{mg_lin}.weight"] = keys.take(f"{src}{hf_lin}.weight").t().contiguous()
            out[f"{dst}{mg_lin}.bias"] = keys.take(f"{src}{hf_lin}.bias").clone()
    out[f"{FINAL_NORM}.weight"] = keys.take("ln_f.weight").clone()
    out[f"{FINAL_NORM}.bias"] = keys.take("ln_f.bias").clone()
    if keys.has("lm_head.weight"):
        lm_head = keys.take("lm_head.weight")
        if tied and not torch.equal(lm_head, keys.take("wte.weight")):
            raise ValueError(
                "GPT-2 config says tie_word_embeddings=True but lm_head.weight differs from wte.weight."
            )
        if not tied:
            out[OUTPUT_LAYER] = repad_vocab(lm_head, vocab, pad)
    elif not tied:
        raise ValueError(
            "GPT-2 config says tie_word_embeddings=False but lm_head.weight is missing."
        )
    keys.check_all_used()

    n_inner = require_size(cfg, "n_inner", "GPT-2", default=4 * h)
    n_pos = require_size(cfg, "n_positions", "GPT-2")
    model_config = ModelConfig(
        num_layers=layers,
        hidden_size=h,
        num_attention_heads=n,
        ffn_hidden_size=n_inner,
        seq_length=n_pos,
        max_position_embeddings=n_pos,
        normalization="layernorm",
        layernorm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
        swiglu=False,
        use_rotary_position_embeddings=False,
        add_bias_linear=True,
        untie_embeddings_and_output_weights=not tied,
        attention_dropout=float(cfg.get("attn_pdrop", 0.1)),
        hidden_dropout=float(cfg.get("resid_pdrop", 0.1)),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        vocab_size=vocab,
    )
    return out, model_config


def _check_exportable(m: ModelConfig) -> None:
    problems = []
    if m.normalization != "layernorm":
        problems.append("--normalization must be layernorm")
    if m.swiglu:
        problems.append("--swiglu must be off")
    if m.use_rotary_position_embeddings:
        problems.append(
            "--use-rotary-position-embeddings must be off (GPT-2 has learned positions)"
        )
    if not m.add_position_embedding:
        problems.append("--no-position-embedding must be off (GPT-2 has learned positions)")
    if not m.add_bias_linear:
        problems.append("--disable-bias-linear must be off")
    if m.num_query_groups != m.num_attention_heads:
        problems.append("--num-key-value-heads must equal --num-attention-heads")
    if m.head_dim * m.num_attention_heads != m.hidden_size:
        problems.append("--kv-channels must be hidden_size / num_attention_heads")
    if problems:
        raise ValueError(
            "this model cannot be exported as HF GPT-2: "
            + "; ".join(problems)
            + ". Export LLaMA-style models with megatron_to_llama_hf."
        )


def megatron_to_gpt2_hf(
    full_state_dict: Mapping[str, torch.Tensor],
    model_config: ModelConfig,
    true_vocab_size: int,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Convert Megatron's full (TP=1) state dict into an HF ``GPT2LMHeadModel`` state dict and config.

    Args:
        full_state_dict: Megatron names, merged over TP and PP (padded vocabulary rows allowed).
        model_config: the architecture it was trained with (GPT-2 shape: layernorm, GeLU, learned positions).
        true_vocab_size: the tokenizer's vocabulary; padding rows beyond it are dropped.
        bos_token_id, eos_token_id: the tokenizer's special ids for ``config.json`` (e.g. 50256 for GPT-2's
            ``<|endoftext|>``); None writes null instead of transformers' model-specific defaults.

    Returns:
        ``(hf_state_dict, config_dict)``: ``transformer.*`` fp32 contiguous tensors (``lm_head.weight`` only when
        untied; HF re-ties it on load) and a ``config.json`` dict for ``GPT2LMHeadModel``.
    """
    _check_exportable(model_config)
    full_state_dict, model_config = fold_layernorm_1p(full_state_dict, model_config)
    m = model_config
    h, n, hn = m.hidden_size, m.num_attention_heads, m.head_dim
    take = MegatronKeys(full_state_dict)

    out: dict[str, torch.Tensor] = {
        "transformer.wte.weight": repad_vocab(
            take(WORD_EMBEDDINGS), true_vocab_size, true_vocab_size
        ),
        "transformer.wpe.weight": take(POSITION_EMBEDDINGS).clone(),
    }
    for i in range(m.num_layers):
        src, dst = layer_prefix(i) + ".", f"transformer.h.{i}."
        for hf_ln, mg_ln in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            for p in ("weight", "bias"):
                out[f"{dst}{hf_ln}.{p}"] = take(f"{src}{mg_ln}.{p}").clone()
        heads = {"num_heads": n, "num_groups": n, "head_dim": hn}
        q, k, v = split_qkv(take(f"{src}self_attention.query_key_value.weight"), **heads)
        out[f"{dst}attn.c_attn.weight"] = (
            torch.cat([q, k, v]).t().contiguous()
        )  # [3h, h] -> [h, 3h]
        qb, kb, vb = split_qkv(take(f"{src}self_attention.query_key_value.bias"), **heads)
        out[f"{dst}attn.c_attn.bias"] = torch.cat([qb, kb, vb])
        for hf_lin, mg_lin in (
            ("attn.c_proj", "self_attention.dense"),
            ("mlp.c_fc", "mlp.dense_h_to_4h"),
            ("mlp.c_proj", "mlp.dense_4h_to_h"),
        ):
            out[f"{dst}{hf_lin}.weight"] = take(f"{src}{mg_lin}.weight").t().contiguous()
            out[f"{dst}{hf_lin}.bias"] = take(f"{src}{mg_lin}.bias").clone()
    out["transformer.ln_f.weight"] = take(f"{FINAL_NORM}.weight").clone()
    out["transformer.ln_f.bias"] = take(f"{FINAL_NORM}.bias").clone()
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = repad_vocab(take(OUTPUT_LAYER), true_vocab_size, true_vocab_size)
    take.check_all_used()

    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": true_vocab_size,
        "n_positions": m.max_positions,
        "n_embd": h,
        "n_layer": m.num_layers,
        "n_head": n,
        "n_inner": m.ffn_size,
        "activation_function": MEGATRON_GELU,
        "resid_pdrop": m.hidden_dropout,
        "embd_pdrop": m.hidden_dropout,
        "attn_pdrop": m.attention_dropout,
        "layer_norm_epsilon": m.layernorm_epsilon,
        "initializer_range": m.init_method_std,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "scale_attn_weights": True,
    }
    return out, config
