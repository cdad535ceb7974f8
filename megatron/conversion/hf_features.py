"""The parts of a LLaMA-family ``config.json`` beyond plain LLaMA's: RoPE scaling, the sliding window and the families
whose attention differs (QKV bias, QK-norm), mapped to ``ModelConfig`` fields and back.

==========  =================================  ==============================================================
family      attention                          config.json keys read here
==========  =================================  ==============================================================
llama       no bias                            rope_scaling / rope_parameters (default, llama3, linear)
qwen2       bias on q, k, v (never on o)       + use_sliding_window, sliding_window, max_window_layers
qwen3       per-head RMSNorm on q and k        + head_dim, attention_bias (must be false), the window keys
mistral     no bias                            + head_dim, sliding_window (int or null)
==========  =================================  ==============================================================

RoPE, in both transformers spellings (4: ``rope_theta`` + ``rope_scaling``; 5: ``rope_parameters`` holding
``rope_theta``; a ``rope_scaling`` given to transformers 5 wins over ``rope_parameters``, and so here):

- ``default``: ``--rotary-position-embeddings-theta``;
- ``llama3``: ``--use-rope-scaling`` with its factor, low/high frequency factors and original context
  (``original_max_position_embeddings``; transformers falls back to ``max_position_embeddings``, so do we);
- ``linear``: ``--rotary-seq-len-interpolation-factor`` (positions divided by ``factor`` = frequencies divided by
  it, which is what HF computes).

Anything else (``yarn``, ``dynamic``, ``longrope``, per-layer-type RoPE, ``partial_rotary_factor`` < 1) is refused
by name. HF's ``sliding_window`` W lets a token see itself and the W - 1 before it: ``--window-size (W-1, 0)``
(:func:`megatron.config.window_from_hf`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron.config.model import ModelConfig, window_from_hf, window_to_hf

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
"""The dense LLaMA-family ``model_type`` values Trident imports and exports (Mixtral: ``hf_mixtral``)."""

REFUSED_MODEL_TYPES = {
    "qwen2_moe": "Qwen2-MoE (shared experts and a shared-expert gate; DeepSpeed-MoE has neither)",
    "qwen3_moe": "Qwen3-MoE (top-8 routing with renormalization switched per model; no DeepSpeed-MoE form)",
    "mistral3": "Mistral 3 (a vision-language model)",
    "ministral": "Ministral (alternating sliding-window and full-attention layers)",
    "llama4": "Llama 4 (MoE with chunked attention and no RoPE on some layers)",
    "mllama": "Llama 3.2 Vision (cross-attention layers)",
    "qwen2_vl": "Qwen2-VL (multimodal RoPE)",
    "qwen2_5_vl": "Qwen2.5-VL (multimodal RoPE)",
}
"""Relatives of the supported families that are refused by name (what they have that Trident cannot express)."""

_ROPE_TYPES = ("default", "llama3", "linear")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


@dataclass(frozen=True)
class FamilyRules:
    """What one family's ``config.json`` and weights carry beyond LLaMA's."""

    name: str
    """The family in messages (``LLaMA``, ``Qwen2``, ``Qwen3``, ``Mistral``)."""
    architecture: str
    """``architectures[0]`` of an export."""
    qkv_bias: bool = False
    """q/k/v projections always have a bias (Qwen2)."""
    qk_norm: bool = False
    """q_norm / k_norm per-head RMSNorm weights (Qwen3)."""
    window: str | None = None
    """How the sliding window is spelled: ``mistral`` (``sliding_window`` alone), ``qwen``
    (``use_sliding_window`` + ``max_window_layers``), None (no window)."""
    default_max_positions: int = 2048
    """``max_position_embeddings`` when ``config.json`` has none (transformers' default for the family)."""


RULES = {
    "llama": FamilyRules("LLaMA", "LlamaForCausalLM"),
    "qwen2": FamilyRules(
        "Qwen2", "Qwen2ForCausalLM", qkv_bias=True, window="qwen", default_max_positions=32768
    ),
    "qwen3": FamilyRules(
        "Qwen3", "Qwen3ForCausalLM", qk_norm=True, window="qwen", default_max_positions=32768
    ),
    "mistral": FamilyRules(
        "Mistral", "MistralForCausalLM", window="mistral", default_max_positions=4096 * 32
    ),
}


def rope_parameters(cfg: Mapping[str, Any], model: str) -> dict[str, Any]:
    """The one RoPE dict of a config in either spelling, ``rope_theta`` filled in (transformers' precedence:
    ``rope_scaling``, then ``rope_parameters``; the theta from the dict, then the top-level key, then 10000).

    Raises:
        ValueError: per-layer-type RoPE (a dict of dicts).
    """
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(
            f"{model} config.json has RoPE parameters per layer type ({sorted(params)}); Trident applies one "
            "RoPE to every layer."
        )
    params.setdefault("rope_theta", cfg.get("rope_theta") or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _rope_number(params: Mapping[str, Any], key: str, model: str) -> float:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(
            f"{model} config.json rope_type '{params['rope_type']}' needs a positive number '{key}' "
            f"(got {value!r}); fix rope_scaling / rope_parameters."
        )
    return float(value)


def rope_fields(cfg: Mapping[str, Any], model: str = "LLaMA") -> dict[str, Any]:
    """``ModelConfig`` keyword arguments of a config's RoPE (see the module docstring).

    Raises:
        ValueError: a RoPE type or option Trident does not implement, or a scaling parameter missing.
    """
    params = rope_parameters(cfg, model)
    kind = params["rope_type"]
    if kind not in _ROPE_TYPES:
        raise ValueError(
            f"{model} config.json uses rope_type '{kind}'; Trident implements RoPE of type default, llama3 "
            "(--use-rope-scaling) and linear (--rotary-seq-len-interpolation-factor) only."
        )
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(
            f"{model} config.json has partial_rotary_factor {partial}; HF {model} then rotates a different "
            "channel set than --rotary-percent, so only 1.0 converts."
        )
    out: dict[str, Any] = {
        "rotary_position_embeddings_theta": _rope_number(params, "rope_theta", model)
    }
    if kind == "linear":
        out["rotary_seq_len_interpolation_factor"] = _rope_number(params, "factor", model)
    elif kind == "llama3":
        factor, low, high = (_rope_number(params, k, model) for k in _LLAMA3_KEYS)
        if high <= low:
            raise ValueError(
                f"{model} config.json rope_type 'llama3' needs high_freq_factor ({high}) > low_freq_factor "
                f"({low}); fix rope_scaling / rope_parameters."
            )
        original = {
            "original_max_position_embeddings": params.get("original_max_position_embeddings")
            or cfg.get("max_position_embeddings"),
            "rope_type": kind,
        }
        out.update(
            use_rope_scaling=True,
            rope_scaling_factor=factor,
            rope_scaling_low_freq_factor=low,
            rope_scaling_high_freq_factor=high,
            rope_scaling_original_max_position_embeddings=int(
                _rope_number(original, "original_max_position_embeddings", model)
            ),
        )
    return out


def rope_to_hf(m: ModelConfig) -> dict[str, Any]:
    """``config.json`` keys of ``m``'s RoPE, read alike by transformers 4 (``rope_theta`` + ``rope_scaling``) and 5
    (``rope_parameters``; its ``rope_scaling`` is the same dict)."""
    theta = m.rotary_position_embeddings_theta
    scaling: dict[str, Any] | None = None
    if m.use_rope_scaling:
        scaling = {
            "rope_type": "llama3",
            "factor": m.rope_scaling_factor,
            "low_freq_factor": m.rope_scaling_low_freq_factor,
            "high_freq_factor": m.rope_scaling_high_freq_factor,
            "original_max_position_embeddings": m.rope_scaling_original_max_position_embeddings,
        }
    elif m.rotary_seq_len_interpolation_factor is not None:
        scaling = {"rope_type": "linear", "factor": m.rotary_seq_len_interpolation_factor}
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_parameters": params}


def _qwen_window(cfg: Mapping[str, Any], model: str) -> int | None:
    """The window of every layer of a Qwen2/Qwen3 config; refuses a window on some layers only."""
    window = cfg.get("sliding_window")
    layers = int(cfg.get("num_hidden_layers") or 0)
    types = cfg.get("layer_types")
    if not cfg.get("use_sliding_window") or window is None:
        types_given = set(types or ["full_attention"])
        if types_given != {"full_attention"}:
            raise ValueError(
                f"{model} config.json has layer_types {sorted(types_given)} without use_sliding_window and "
                "sliding_window; Trident needs one attention kind for every layer."
            )
        return None
    source = "layer_types"
    if types is None:
        # transformers: layers i >= max_window_layers slide
        first = int(cfg.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        source = f"max_window_layers {first}"
    if len(set(types)) > 1:
        slide = [i for i, t in enumerate(types) if t == "sliding_attention"]
        raise ValueError(
            f"{model} config.json slides the window on layers {slide} only (use_sliding_window with "
            f"{source}); Trident's --window-size applies to every layer, so this model cannot be converted "
            "(a model trained with the window on all layers or none says so in layer_types / "
            "max_window_layers)."
        )
    return int(window) if types and types[0] == "sliding_attention" else None


def window_fields(cfg: Mapping[str, Any], rules: FamilyRules) -> dict[str, Any]:
    """``{"window_size": (W - 1, 0)}`` for a family config with a sliding window on every layer, else ``{}``.

    Raises:
        ValueError: a window on some layers only, or a window that is not a whole number >= 1.
    """
    if rules.window is None:
        return {}
    window = (
        cfg.get("sliding_window") if rules.window == "mistral" else _qwen_window(cfg, rules.name)
    )
    if window is None:
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"{rules.name} config.json has sliding_window {window!r}; it must be a whole number >= 1 or null."
        )
    return {"window_size": window_from_hf(window)}


def window_config(m: ModelConfig, rules: FamilyRules) -> dict[str, Any]:
    """``config.json`` keys of ``m``'s window for the family of ``rules`` (nothing for LLaMA)."""
    window = None if m.window_size is None else window_to_hf(m.window_size)
    if rules.window == "mistral":
        return {"sliding_window": window}
    if rules.window == "qwen":
        slide = "full_attention" if window is None else "sliding_attention"
        return {
            "use_sliding_window": window is not None,
            "sliding_window": window,
            "max_window_layers": 0 if window is not None else m.num_layers,
            "layer_types": [slide] * m.num_layers,
        }
    return {}


def attention_fields(cfg: Mapping[str, Any], rules: FamilyRules) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments of the family's attention (QKV bias, QK-norm) after checking the biases
    its config.json asks for are the ones Trident has.

    Raises:
        ValueError: ``attention_bias`` / ``mlp_bias`` true (bias on the output projection or the MLP).
    """
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key, False):
            raise ValueError(
                f"{rules.name} config.json has {key}: true; Trident's {rules.name} has no bias on the "
                "attention output projection or the MLP (only --add-qkv-bias on q, k, v, as Qwen2's), so it "
                "cannot convert this model."
            )
    return {"add_qkv_bias": rules.qkv_bias, "qk_layernorm": rules.qk_norm}


def export_family(m: ModelConfig, recorded: str | None) -> str:
    """The HF family a dense LLaMA-style ``m`` is exported as: the one its features need (QK-norm: qwen3, QKV bias:
    qwen2, a window or a hidden size that is no multiple of the heads: mistral), else the family the import
    recorded (``recorded``, the meta's ``hf_model_type``), else llama.

    Raises:
        ValueError: features no family has together (QK-norm with QKV bias, a window looking ahead).
    """
    if m.qk_layernorm and m.add_qkv_bias:
        raise ValueError(
            "this model has --qk-layernorm and --add-qkv-bias; no HF family has both (Qwen3 has the norm and "
            "bias on every attention projection or none), so it cannot be exported."
        )
    if m.window_size is not None and m.window_size[1] != 0:
        raise ValueError(
            f"this model's --window-size {m.window_size} looks {m.window_size[1]} tokens ahead; HF's "
            "sliding_window is causal, so it cannot be exported."
        )
    if m.qk_layernorm:
        return "qwen3"
    if m.add_qkv_bias:
        return "qwen2"
    # HF LlamaConfig refuses hidden_size % heads != 0 even with head_dim given; Mistral takes any head_dim
    if m.window_size is not None or recorded == "mistral" or m.hidden_size % m.num_attention_heads:
        return "mistral"
    return "llama"
