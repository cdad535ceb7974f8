"""Rotary position embeddings (RoPE), half-split convention of GPT-NeoX / Hugging Face LLaMA.

Legend: ``s`` sequence, ``b`` micro-batch, ``np`` local heads, ``hn`` head dim, ``d`` rotated dims
(``int(hn * --rotary-percent)``, = hn by default).

    inv_freq[i] = theta ** (-2i / d)                 i = 0 .. d/2-1
    angle[b, s, :] = cat(pos[b, s] * inv_freq, pos[b, s] * inv_freq)        (fp32)
    rope(x) = x * cos(angle) + rotate_half(x) * sin(angle),   rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])

Partial rotary (``--rotary-percent`` < 1, Megatron's and GPT-NeoX's): only the first ``d`` channels of every head are
rotated (with frequencies of a ``d``-dim rotary), the last ``hn - d`` pass through unchanged::

    x [.., hn] = [ x[.., :d] | x[.., d:] ]  ->  [ rope(x[.., :d]) | x[.., d:] ]

The tables are computed from ``position_ids`` inside the model (never sent between pipeline stages).
"""

from __future__ import annotations

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


def rotary_cos_sin(
    position_ids: torch.Tensor, dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for ``position_ids``.

    Args:
        position_ids: ``[b, s]`` integer positions.
        dim: rotated dims per head (even).
        theta: RoPE base (``--rotary-position-embeddings-theta``).
        dtype: dtype of the returned tables (the activations' dtype); computed in fp32 first.

    Returns:
        ``(cos, sin)``, each ``[s, b, 1, d]`` (broadcast over heads).
    """
    inv_freq = rotary_inv_freq(dim, theta, device=position_ids.device)
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
    return rotary_cos_sin(position_ids, dim, config.rotary_position_embeddings_theta, dtype)


def apply_rotary_pos_emb(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, fused: bool = True
) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, np, hn]`` by the tables ``[s, b, 1, d]`` (half-split convention).

    With ``d < hn`` (partial rotary) only ``x[..., :d]`` is rotated; ``x[..., d:]`` is returned unchanged. One
    fused kernel where built and ``fused`` (``--no-rope-fusion`` turns it off), else the reference
    (``fused_kernels.reference.rope``).
    """
    return fused_kernels.rope(x, cos, sin, fused=fused)
