"""Attention over a sequence split by context parallelism (``--context-parallel-size N``), and over packed documents.

Legend: ``S`` whole sequence, ``s = S/N`` this rank's tokens (load-balanced order, ``model/token_layout.py``),
``b`` micro-batch, ``np`` query heads and ``gp`` key/value groups of this rank, ``hn`` head dim.

:func:`context_attention` is the one entry point ``ParallelAttention`` calls when the run has a CP group or packed
documents. At ``N = 1`` it is :func:`~megatron.model.block_attention.block_attention` over the whole sequence
(tiles, online softmax, no ``[s, s]`` tensor). At ``N > 1`` it is a ring: the K/V blocks travel around the CP group
while each rank attends its own queries to the block it holds, and the blocks' results are merged::

    step t = 0 .. N-1 on rank r: holds the K/V block of rank j = (r - t) mod N
        start sending that block to rank r+1 and receiving the next from rank r-1     (only the gp KV heads)
        (out_j, lse_j) = attention of my queries over block j, under rank_layout(S, N, j)   (skipped if invisible)
        (out, lse) = merge((out, lse), (out_j, lse_j))          lse = log(e^lse + e^lse_j), outs weighted
        wait for the exchange

Backward: ``D = rowsum(grad_out * out)`` once; the K/V blocks travel the ring again, each with its fp32 ``dK``/``dV``
accumulator one step behind: at step ``t`` a rank computes block ``j``'s share (dq is local), adds the accumulator
that arrives from rank ``r-1`` (sent there after its own share, so the transfer overlaps this step's compute) and
sends the sum on to rank ``r+1``. After the last step the accumulator of every block has visited every rank and
arrives home: rank ``r`` then holds the whole ``dK``, ``dV`` of its own tokens. Packed documents need nothing sent:
every rank holds the whole sequence's document ids and takes any block's from its positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.model.block_attention import (
    DEFAULT_TILE_SIZE,
    TilePlan,
    block_attention,
    block_backward,
    block_forward,
    merge_blocks,
    plan_tiles,
    softmax_delta,
)
from megatron.model.token_layout import PackedDocuments, TokenLayout, rank_layout
from megatron.mpu.mappings import RingExchange, ring_exchange_async
from megatron.mpu.parallel_state import ProcessGroup

# gloo tags of the K/V and the dK/dV exchanges (two tensors each), which are in flight together
_KV_TAG, _GRAD_TAG = 0, 2


@dataclass(frozen=True)
class _Ring:
    """Where this rank sits in the ring and what its attention obeys."""

    group: ProcessGroup | None
    size: int
    rank: int
    seq_length: int
    documents: PackedDocuments | None
    window_left: int | None
    tile_size: int

    def layout(self, cp_rank: int, device: torch.device) -> TokenLayout:
        """The tokens CP rank ``cp_rank`` holds (its queries, or the keys of its block)."""
        return rank_layout(self.seq_length, self.size, cp_rank, self.documents, device)

    def plan(self, mine: TokenLayout, step: int) -> TilePlan:
        """The tiles of this rank's queries over the K/V block it holds at ``step``: the block of CP rank
        ``(r - step) mod N`` (its own at step 0)."""
        holder = (self.rank - step) % self.size
        keys = self.layout(holder, mine.positions.device)
        return plan_tiles(mine, keys, window_left=self.window_left, tile_size=self.tile_size)


def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [s, b, np, hn] fp32, lse [b, np, s] fp32)`` of this rank's queries over every block."""
    s, b, heads, hn = q.shape
    mine = ring.layout(ring.rank, q.device)
    out = torch.zeros((s, b, heads, hn), device=q.device)
    lse = torch.full((b, heads, s), float("-inf"), device=q.device)
    kv = [k, v]
    for step in range(ring.size):
        last = step == ring.size - 1
        exchange = None if last else ring_exchange_async(kv, ring.group, _KV_TAG)
        plan = ring.plan(mine, step)
        if not plan.empty:
            block_out, block_lse = block_forward(q, kv[0], kv[1], plan)
            out, lse = merge_blocks(out, lse, block_out, block_lse)
        if exchange is not None:
            kv = exchange.wait()  # [s, b, gp, hn] x2 from rank r-1
    return out, lse


def _ring_backward(  # noqa: PLR0913 (the saved forward tensors, the incoming gradient and the ring)
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    ring: _Ring,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` fp32 of this rank's tokens (``[s, b, np, hn]``, ``[s, b, gp, hn]`` x2)."""
    mine = ring.layout(ring.rank, q.device)
    delta = softmax_delta(grad_out, out)  # [b, np, s]
    dq = torch.zeros(q.shape, device=q.device)
    kv = [k, v]
    grads = RingExchange([], [], [])  # dK, dV of the block in hand, from rank r-1 (none at step 0)
    for step in range(ring.size):
        last = step == ring.size - 1
        exchange = None if last else ring_exchange_async(kv, ring.group, _KV_TAG)
        plan = ring.plan(mine, step)
        if plan.empty:  # nothing of this block seen: a zero share (the accumulator still travels)
            share = [torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device)]
        else:
            _, block_dk, block_dv = block_backward(grad_out, q, kv[0], kv[1], lse, delta, plan, dq)
            share = [block_dk, block_dv]  # dq: this block's share added in place
        if step > 0:  # add the shares of the ranks this block visited before
            share = [ours.add_(theirs) for ours, theirs in zip(share, grads.wait(), strict=True)]
        grads = ring_exchange_async(share, ring.group, _GRAD_TAG)  # the last step sends them home
        if exchange is not None:
            kv = exchange.wait()
    dk, dv = grads.wait()  # [s, b, gp, hn] fp32 x2: every rank's share of my block's keys
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring
    ) -> torch.Tensor:
        s, b, heads, hn = q.shape
        out, lse = _ring_forward(q, k.contiguous(), v.contiguous(), ring)
        context = out.to(q.dtype).reshape(s, b, heads * hn)  # [s, b, np, hn] -> [s, b, np*hn]
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, context, lse)
        return context

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, context, lse = ctx.saved_tensors
        grad_out = grad.reshape(q.shape)  # [s, b, np*hn] -> [s, b, np, hn]
        out = context.view(q.shape)
        dq, dk, dv = _ring_backward(grad_out, q, k.contiguous(), v.contiguous(), out, lse, ctx.ring)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(  # noqa: PLR0913 (context_attention's arguments plus the tile size)
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    documents: PackedDocuments | None,
    group: ProcessGroup | None,
    window_left: int | None = None,
    tile_size: int = DEFAULT_TILE_SIZE,
) -> torch.Tensor:
    """:func:`context_attention` with the tile size of the block attention given (tests use small tiles)."""
    n, r = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    seq_length = q.shape[0] * n
    if n == 1:
        mine = rank_layout(seq_length, 1, 0, documents, q.device)
        return block_attention(q, k, v, mine, mine, window_left=window_left, tile_size=tile_size)
    ring = _Ring(group, n, r, seq_length, documents, window_left, tile_size)
    return _RingAttention.apply(q, k, v, ring)


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    documents: PackedDocuments | None,
    group: ProcessGroup | None,
    window_left: int | None = None,
) -> torch.Tensor:
    """Causal attention of this CP rank's tokens over the whole sequence (no dropout).

    Args:
        q: ``[s, b, np, hn]``; k, v: ``[s, b, gp, hn]`` — this rank's ``s = S/N`` tokens in the load-balanced order
            (all ``S`` in order when ``group`` is None or has one rank).
        documents: packed documents of the whole sequence, or None (one document per sample).
        group: the context-parallel group (None: no context parallelism).
        window_left: sliding window (``--window-size``), None for none.
    Returns:
        ctx ``[s, b, np*hn]`` in q's dtype; its backward runs the ring again (module docstring).
    """
    return ring_attention(q, k, v, documents=documents, group=group, window_left=window_left)
