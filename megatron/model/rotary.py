"""Rotary position embeddings (RoPE), half-split convention of GPT-NeoX / Hugging Face LLaMA.

Legend: ``s`` sequence, ``b`` micro-batch, ``np`` local heads, ``hn`` head dim, ``d`` rotated dims
(``int(hn * --rotary-percent)``, = hn by default).

    inv_freq[i] = theta ** (-2i / d)                 i = 0 .. d/2-1
    angle[b, s, :] = cat(pos[b, s] * inv_freq, pos[b, s] * inv_freq)        (fp32)
    rope(x) = x * cos(angle) + rotate_half(x) * sin(angle),   rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])

Partial rotary (``--rotary-percent`` < 1, Megatron's and GPT-NeoX's): only the first ``d`` channels of every head are
rotated (with frequencies of a ``d``-dim rotary), the last ``hn - d`` pass through unchanged::

    x [.., hn] = [ x[.., :d] | x[.., d:] ]  ->  [ rope(x[.., :d]) | x[.., d:] ]

Scaled frequencies (long-context models); scaling only changes ``inv_freq``, so the tables and the fused kernel
that reads them are the same code either way::

    linear (--rotary-seq-len-interpolation-factor F; HF rope_type "linear"):   inv_freq / F
        = positions divided by F (HF divides inv_freq, the same angles; we do too, so the bits agree)
    llama3 (--use-rope-scaling; HF rope_type "llama3"), with factor f, low/high frequency factors l < u and the
    original context C: per frequency, wavelength w = 2 pi / inv_freq,
        w < C/u            kept                          (high frequencies: local order)
        w > C/l            inv_freq / f                  (low frequencies: stretched f-fold)
        otherwise          (1 - t) inv_freq / f + t inv_freq,   t = (C/w - l) / (u - l)   (a smooth blend)

The tables are computed from ``position_ids`` inside the model (never sent between pipeline stages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from megatron import fused_kernels
from megatron.config import ModelConfig


def rotary_dim(head_dim: int, rotary_percent: float) -> int:
    """Channels rotated per head: ``int(head_dim * rotary_percent)`` (Megatron's rounding; validate() keeps it
    even and >= 2)."""
    return head_dim if rotary_percent >= 1.0 else int(head_dim * rotary_percent)


def rotary_inv_freq(dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """``[d/2]`` fp32 inverse frequencies ``theta ** (-2i/d)`` (same arithmetic as HF LLaMA)."""
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    return 1.0 / (theta**exponent)


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary inverse frequencies are rescaled (module docstring)."""

    kind: Literal["linear", "llama3"]
    factor: float
    """linear: the position divisor F; llama3: the low-frequency divisor f."""
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_scaling(config: ModelConfig) -> RopeScaling | None:
    """The scaling ``config`` asks for (``--use-rope-scaling`` or ``--rotary-seq-len-interpolation-factor``;
    validate() refuses both at once), or None."""
    if config.use_rope_scaling:
        return RopeScaling(
            "llama3",
            config.rope_scaling_factor,
            config.rope_scaling_low_freq_factor,
            config.rope_scaling_high_freq_factor,
            config.rope_scaling_original_max_position_embeddings,
        )
    if config.rotary_seq_len_interpolation_factor is not None:
        return RopeScaling("linear", config.rotary_seq_len_interpolation_factor)
    return None


def _llama3(inv_freq: torch.Tensor, sc: RopeScaling) -> torch.Tensor:
    """Llama 3's frequency-dependent scaling of ``[d/2]`` fp32 ``inv_freq`` (module docstring; fp32 throughout,
    the operations in transformers' order so the tables agree to the bit)."""
    context, low, high = (
        sc.original_max_position_embeddings,
        sc.low_freq_factor,
        sc.high_freq_factor,
    )
    wavelength = 2 * math.pi / inv_freq  # [d/2]
    stretched = torch.where(wavelength > context / low, inv_freq / sc.factor, inv_freq)
    t = (context / wavelength - low) / (high - low)  # 0 at w = C/l .. 1 at w = C/u
    blended = (1 - t) * stretched / sc.factor + t * stretched
    middle = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(middle, blended, stretched)


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling | None) -> torch.Tensor:
    """``inv_freq`` ``[d/2]`` rescaled by ``scaling`` (unchanged for None)."""
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    return _llama3(inv_freq, scaling)


def rotary_cos_sin(
    position_ids: torch.Tensor,
    dim: int,
    theta: float,
    dtype: torch.dtype,
    *,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for ``position_ids``.

    Args:
        position_ids: ``[b, s]`` integer positions.
        dim: rotated dims per head (even).
        theta: RoPE base (``--rotary-position-embeddings-theta``).
        dtype: dtype of the returned tables (the activations' dtype); computed in fp32 first.
        scaling: rescaled frequencies (:func:`rope_scaling`), or None.

    Returns:
        ``(cos, sin)``, each ``[s, b, 1, d]`` (broadcast over heads).
    """
    inv_freq = rotary_inv_freq(dim, theta, device=position_ids.device)
    inv_freq = scaled_inv_freq(inv_freq, scaling)  # [d/2]
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq  # [b, s] -> [b, s, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [b, s, d/2] -> [b, s, d]
    emb = emb.transpose(0, 1)[:, :, None, :]  # [b, s, d] -> [s, b, 1, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def model_rotary(
    config: ModelConfig, position_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The cos/sin tables a model with ``config`` applies at ``position_ids`` ``[b, s]`` (each ``[s, b, 1, d]``),
    or None without rotary embeddings."""
    if not config.use_rotary_position_embeddings:
        return None
    dim = rotary_dim(config.head_dim, config.rotary_percent)
    theta = config.rotary_position_embeddings_theta
    return rotary_cos_sin(position_ids, dim, theta, dtype, scaling=rope_scaling(config))


def apply_rotary_pos_emb(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, fused: bool = True
) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, np, hn]`` by the tables ``[s, b, 1, d]`` (half-split convention).

    With ``d < hn`` (partial rotary) only ``x[..., :d]`` is rotated; ``x[..., d:]`` is returned unchanged. One
    fused kernel where built and ``fused`` (``--no-rope-fusion`` turns it off), else the reference
    (``fused_kernels.reference.rope``).
    """
    return fused_kernels.rope(x, cos, sin, fused=fused)
