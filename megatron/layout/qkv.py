"""Row layout of Megatron's fused QKV tensor, as pure tensor functions.

Legend: ``h`` hidden, ``n`` query heads, ``G`` K/V heads (GQA groups; ``G = n`` for MHA), ``hn`` per-head
channels, ``r = n / G`` query heads per group.

Fused QKV (``self_attention.query_key_value``), rows grouped by K/V head, the layout of Megatron-DeepSpeed before
the FPDT change (reference commit 6acc370a) and of ``tools/hf2megads_weight_converter.py``::

    group 0: q heads 0..r-1 (r*hn rows) | k_0 (hn rows) | v_0 (hn rows)
    group 1: q heads r..2r-1            | k_1           | v_1
    ...

so a TP shard (groups ``[rank*G/p, (rank+1)*G/p)``) is one contiguous row slice. HF stores ``q_proj`` with query
head ``j`` at rows ``[j*hn, (j+1)*hn)`` and uses K/V head ``j // r`` for it (``repeat_kv``), which is the grouping
above.

SwiGLU ``mlp.dense_h_to_4h``: the full tensor is ``[gate; up]`` (each ``ffn`` rows); TP shard ``k`` holds
``[gate_k; up_k]`` (partition stride 2).
"""

from __future__ import annotations

import torch


def _check_rows(name: str, t: torch.Tensor, rows: int) -> None:
    if t.shape[0] != rows:
        raise ValueError(f"{name} has {t.shape[0]} rows (shape {tuple(t.shape)}); expected {rows}.")


def fuse_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_heads: int,
    num_groups: int,
    head_dim: int,
) -> torch.Tensor:
    """Interleave separate Q, K, V projections into Megatron's per-group fused QKV rows.

    Args:
        q: ``[n*hn, ...]`` query rows (weight ``[n*hn, h]`` or bias ``[n*hn]``), head-major.
        k: ``[G*hn, ...]`` key rows.
        v: ``[G*hn, ...]`` value rows.
        num_heads: ``n``.
        num_groups: ``G``; must divide ``n``.
        head_dim: ``hn``.

    Returns:
        ``[(n + 2G)*hn, ...]`` rows ordered ``[q heads of g | k_g | v_g]`` for ``g = 0..G-1``.
    """
    if num_heads % num_groups:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be divisible by num_key_value_heads ({num_groups})."
        )
    r = num_heads // num_groups
    _check_rows("q", q, num_heads * head_dim)
    _check_rows("k", k, num_groups * head_dim)
    _check_rows("v", v, num_groups * head_dim)
    rest = q.shape[1:]
    qg = q.reshape(num_groups, r * head_dim, *rest)  # [n*hn, ...] -> [G, r*hn, ...]
    kg = k.reshape(num_groups, head_dim, *rest)  # [G*hn, ...] -> [G, hn, ...]
    vg = v.reshape(num_groups, head_dim, *rest)
    fused = torch.cat([qg, kg, vg], dim=1)  # [G, (r+2)*hn, ...]
    return fused.reshape(num_groups * (r + 2) * head_dim, *rest).clone()


def split_qkv(
    fused: torch.Tensor, *, num_heads: int, num_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: ``[(n + 2G)*hn, ...]`` -> ``(q [n*hn, ...], k [G*hn, ...], v [G*hn, ...])``."""
    if num_heads % num_groups:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be divisible by num_key_value_heads ({num_groups})."
        )
    r = num_heads // num_groups
    _check_rows("query_key_value", fused, (num_heads + 2 * num_groups) * head_dim)
    rest = fused.shape[1:]
    g = fused.reshape(num_groups, (r + 2) * head_dim, *rest)  # -> [G, (r+2)*hn, ...]
    q, k, v = torch.split(g, [r * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(num_heads * head_dim, *rest).clone(),
        k.reshape(num_groups * head_dim, *rest).clone(),
        v.reshape(num_groups * head_dim, *rest).clone(),
    )
