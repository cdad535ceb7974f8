"""Memory-light attention under a :class:`~megatron.model.token_layout.TokenLayout` pair: tiles, online softmax.

Legend: ``s`` query tokens, ``s_k`` key tokens, ``b`` micro-batch, ``np`` query heads and ``gp`` key/value groups
of this rank, ``r = np/gp`` query heads per group, ``hn`` head dim, ``tq``/``tk`` a query/key tile's tokens.

The scores are never materialized beyond one ``[b, gp, tq*r, tk]`` tile. The query and key tokens are cut into
tiles of at most ``tile_size`` tokens that never straddle a break in the positions (the two chunks a CP rank holds
are tiled separately), so each tile covers a contiguous range of positions and, per sample, a range of documents::

                 key tiles ->
    query tiles  [full][part][    ][    ]      full: every pair visible, no mask built
        |        [full][full][part][    ]      part: the tile's bool mask from the layouts (TokenLayout.visible)
        v        [    ][full][full][part]      blank: nothing visible (a later position range, beyond the window,
                                                      or no common document in any sample): skipped

:func:`plan_tiles` classifies every tile pair once from the tiles' position and document ranges. The query heads
of one K/V group are folded into the rows of a tile (``[b, gp, tq*r, hn]``), so GQA never repeats K/V.

Forward (:func:`block_forward`), per query tile, over its visible key tiles, in fp32 with the running row max
``m`` and sum ``l``::

    S = q k^T / sqrt(hn) (masked: -inf)     m' = max(m, rowmax S)     P = exp(S - m')
    l = l * exp(m - m') + rowsum P          acc = acc * exp(m - m') + P v          m = m'
    out = acc / l,  lse = m + log l         (a row that sees nothing: out 0, lse -inf, never NaN)

Backward (:func:`block_backward`), flash-attention style: each tile's probabilities are recomputed from q, k and
the saved ``lse`` (``P = exp(S - lse)``); ``dO`` is the output's gradient, ``D = rowsum(dO * out)``
(:func:`softmax_delta`)::

    dv += P^T dO     dP = dO v^T     dS = P * (dP - D)     dq += dS k / sqrt(hn)     dk += dS^T q / sqrt(hn)

The tile functions work on one K/V block: the ring (``model/context_parallel.py``) calls them per block with the
final ``lse`` and ``D`` in backward and joins the blocks' forward results with :func:`merge_blocks`. For one block
(no context parallelism, packed documents) :func:`block_attention` is the autograd function: it saves only q, k,
v, the output and ``lse``. Everything is computed in fp32; the results come back in the input dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from megatron.model.token_layout import TokenLayout

DEFAULT_TILE_SIZE = 512
"""Tokens per query and key tile: a ``[b, gp, 512*r, 512]`` fp32 score tile (8 MiB at ``b = 1, np = 8``)."""

# what a query tile sees of a key tile: nothing, some pairs (a mask is built), every pair
_NONE, _PART, _FULL = 0, 1, 2


@dataclass(frozen=True)
class _Tiles:
    """Where a layout's tiles are and what they cover (positions, and documents per sample)."""

    bounds: list[tuple[int, int]]
    """``(start, end)`` local token indices of each tile."""
    first: list[int]
    """Lowest position in each tile."""
    last: list[int]
    """Highest position in each tile."""
    doc_lo: list[list[int]] | None
    """``[tile][b]`` lowest document id per sample, None without documents."""
    doc_hi: list[list[int]] | None
    """``[tile][b]`` highest document id per sample."""


def _tile_bounds(positions: torch.Tensor, tile_size: int) -> list[tuple[int, int]]:
    """Tiles of at most ``tile_size`` tokens inside the runs of consecutive positions."""
    s = positions.numel()
    if s == 0:
        return []
    breaks = (torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1).tolist()
    edges = [0, *breaks, s]
    return [
        (a, min(a + tile_size, end))
        for start, end in zip(edges[:-1], edges[1:], strict=True)
        for a in range(start, end, tile_size)
    ]


def _tiles(layout: TokenLayout, tile_size: int) -> _Tiles:
    bounds = _tile_bounds(layout.positions, tile_size)
    device = layout.positions.device
    starts = torch.tensor([a for a, _ in bounds], dtype=torch.long, device=device)
    ends = torch.tensor([e - 1 for _, e in bounds], dtype=torch.long, device=device)
    # a tile lies in a run of consecutive positions: its first token is the lowest, its last the highest
    first = layout.positions.index_select(0, starts).tolist()
    last = layout.positions.index_select(0, ends).tolist()
    doc_lo = doc_hi = None
    if layout.documents is not None and bounds:
        docs = layout.documents
        doc_lo = torch.stack([docs[:, a:e].amin(dim=1) for a, e in bounds]).tolist()  # [tiles, b]
        doc_hi = torch.stack([docs[:, a:e].amax(dim=1) for a, e in bounds]).tolist()
    return _Tiles(bounds, first, last, doc_lo, doc_hi)


def _documents_apart(q: _Tiles, i: int, k: _Tiles, j: int) -> tuple[bool, bool]:
    """``(apart, one)``: no sample has a document in both tiles; every sample has one document in both."""
    if q.doc_lo is None or q.doc_hi is None or k.doc_lo is None or k.doc_hi is None:
        return False, True
    ranges = zip(q.doc_lo[i], q.doc_hi[i], k.doc_lo[j], k.doc_hi[j], strict=True)
    apart, one = True, True
    for q_lo, q_hi, k_lo, k_hi in ranges:
        apart = apart and (q_hi < k_lo or k_hi < q_lo)
        one = one and q_lo == q_hi == k_lo == k_hi
    return apart, one


def _classify(q: _Tiles, i: int, k: _Tiles, j: int, window_left: int | None) -> int:
    """What query tile ``i`` sees of key tile ``j``: ``_NONE``, ``_PART`` or ``_FULL``."""
    if k.first[j] > q.last[i]:  # every key after every query
        return _NONE
    if window_left is not None and q.first[i] - k.last[j] > window_left:
        return _NONE  # every key beyond the window
    apart, one = _documents_apart(q, i, k, j)
    if apart:
        return _NONE
    full = k.last[j] <= q.first[i] and one
    if window_left is not None:
        full = full and q.last[i] - k.first[j] <= window_left
    return _FULL if full else _PART


@dataclass(frozen=True)
class TilePlan:
    """The tiles of a query layout and a key layout and, per query tile, the key tiles it sees."""

    q_layout: TokenLayout
    kv_layout: TokenLayout
    window_left: int | None
    q_tiles: list[tuple[int, int]]
    """``(start, end)`` local query indices of each query tile."""
    kv_tiles: list[tuple[int, int]]
    """``(start, end)`` local key indices of each key tile."""
    pairs: list[list[tuple[int, bool]]]
    """Per query tile: ``(key tile, every pair visible)`` for each key tile with something visible."""

    @property
    def empty(self) -> bool:
        """No query sees any key: the block contributes nothing (its compute can be skipped)."""
        return not any(self.pairs)

    def visible(self, i: int, j: int) -> torch.Tensor:
        """Bool ``[b or 1, tq, tk]``: which queries of tile ``i`` see which keys of tile ``j``."""
        (a, e), (c, d) = self.q_tiles[i], self.kv_tiles[j]
        return _slice(self.q_layout, a, e).visible(_slice(self.kv_layout, c, d), self.window_left)


def _slice(layout: TokenLayout, start: int, end: int) -> TokenLayout:
    docs = None if layout.documents is None else layout.documents[:, start:end]
    return TokenLayout(layout.positions[start:end], docs)


def plan_tiles(
    q_layout: TokenLayout,
    kv_layout: TokenLayout,
    *,
    window_left: int | None = None,
    tile_size: int = DEFAULT_TILE_SIZE,
) -> TilePlan:
    """Cut both layouts into tiles of at most ``tile_size`` tokens and find what each query tile sees."""
    if tile_size < 1:
        raise ValueError(f"tile_size must be a positive number of tokens, got {tile_size}")
    q, k = _tiles(q_layout, tile_size), _tiles(kv_layout, tile_size)
    pairs = []
    for i in range(len(q.bounds)):
        kinds = [(j, _classify(q, i, k, j, window_left)) for j in range(len(k.bounds))]
        pairs.append([(j, kind == _FULL) for j, kind in kinds if kind != _NONE])
    return TilePlan(q_layout, kv_layout, window_left, q.bounds, k.bounds, pairs)


# --- tiles of the operands (each converted to fp32 when used: no whole-sequence copy) ------------------------


def _query_tile(x: torch.Tensor, a: int, e: int, gp: int) -> torch.Tensor:
    """Query rows ``a .. e-1`` of ``x [s, b, np, hn]`` as ``[b, gp, tq*r, hn]`` fp32: the ``r`` query heads of a
    K/V group folded into the tile's rows (row ``t*r + i``: token ``t``, head ``i`` of the group)."""
    tile = x[a:e].unflatten(2, (gp, -1))  # [tq, b, np, hn] -> [tq, b, gp, r, hn]
    tq, b, _, r, hn = tile.shape
    return tile.permute(1, 2, 0, 3, 4).reshape(b, gp, tq * r, hn).float()  # -> [b, gp, tq*r, hn]


def _put_query_tile(out: torch.Tensor, a: int, e: int, tile: torch.Tensor) -> None:
    """Write ``tile [b, gp, tq*r, hn]`` into rows ``a .. e-1`` of ``out [s, b, np, hn]``."""
    b, gp, _, hn = tile.shape
    grouped = tile.view(b, gp, e - a, -1, hn)  # [b, gp, tq*r, hn] -> [b, gp, tq, r, hn]
    out[a:e] = grouped.permute(2, 0, 1, 3, 4).reshape(e - a, b, -1, hn)  # -> [tq, b, np, hn]


def _key_tile(x: torch.Tensor, c: int, d: int) -> torch.Tensor:
    """Key rows ``c .. d-1`` of ``x [s_k, b, gp, hn]`` as ``[b, gp, tk, hn]`` fp32."""
    return x[c:d].permute(1, 2, 0, 3).float()


def _row_stat_tile(x: torch.Tensor, a: int, e: int, gp: int) -> torch.Tensor:
    """A per-query statistic ``x [b, np, s]`` for rows ``a .. e-1`` as ``[b, gp, tq*r, 1]`` (the tile's rows)."""
    b = x.shape[0]
    tile = x[:, :, a:e].unflatten(1, (gp, -1)).transpose(2, 3)  # [b, np, tq] -> [b, gp, tq, r]
    return tile.reshape(b, gp, -1, 1)


def _put_row_stat_tile(x: torch.Tensor, a: int, e: int, tile: torch.Tensor) -> None:
    """Write ``tile [b, gp, tq*r, 1]`` into ``x [b, np, s]`` at rows ``a .. e-1``."""
    b, gp = tile.shape[:2]
    x[:, :, a:e] = tile.view(b, gp, e - a, -1).transpose(2, 3).reshape(b, -1, e - a)


def _scores(
    q: torch.Tensor, k: torch.Tensor, plan: TilePlan, i: int, j: int, full: bool, scale: float
) -> torch.Tensor:
    """Scaled scores of query tile ``i`` (``q [b, gp, tq*r, hn]``) and key tile ``j`` (``k [b, gp, tk, hn]``):
    ``[b, gp, tq*r, tk]``, ``-inf`` where a query does not see a key."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b, gp, tq*r, hn] x [b, gp, hn, tk]
    if full:
        return scores
    b, gp, rows, tk = scores.shape
    tq = plan.q_tiles[i][1] - plan.q_tiles[i][0]
    seen = plan.visible(i, j)  # [b or 1, tq, tk]
    hidden = ~seen.view(seen.shape[0], 1, tq, 1, tk)  # -> [b or 1, 1, tq, 1, tk]
    masked = scores.view(b, gp, tq, rows // tq, tk).masked_fill(hidden, float("-inf"))
    return masked.view(b, gp, rows, tk)  # [b, gp, tq, r, tk] -> [b, gp, tq*r, tk]


# --- forward -----------------------------------------------------------------------------------------------


def _forward_row(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TilePlan, i: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax of query tile ``i`` (``q [b, gp, tq*r, hn]`` fp32) over its visible key tiles of ``k``,
    ``v`` (``[s_k, b, gp, hn]``): ``(out [b, gp, tq*r, hn], lse [b, gp, tq*r, 1])``."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    m = torch.full((*q.shape[:3], 1), float("-inf"), device=q.device)  # [b, gp, tq*r, 1]
    total = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    for j, full in plan.pairs[i]:
        c, d = plan.kv_tiles[j]
        scores = _scores(q, _key_tile(k, c, d), plan, i, j, full, scale)  # [b, gp, tq*r, tk]
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        # a row that has seen no key yet keeps m = -inf: subtract 0 instead, so exp(-inf) = 0, never NaN
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
        probs = torch.exp(scores - m_safe)
        alpha = torch.exp(m - m_safe)
        total = total * alpha + probs.sum(dim=-1, keepdim=True)
        # [b, gp, tq*r, tk] x [b, gp, tk, hn] -> [b, gp, tq*r, hn]
        acc = acc * alpha + torch.matmul(probs, _key_tile(v, c, d))
        m = m_new
    lse = m + torch.log(total)  # -inf + log 0 = -inf for a row that saw nothing
    return acc / total.masked_fill(total == 0.0, 1.0), lse


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TilePlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [s, b, np, hn]`` over one block ``k, v [s_k, b, gp, hn]`` under ``plan``.

    Returns:
        ``(out [s, b, np, hn] fp32, lse [b, np, s] fp32)``: the block's softmax-normalized context and each
        query's log-sum-exp of its visible scaled scores (``out`` 0 and ``lse`` -inf where it sees none), as
        :func:`~megatron.model.token_layout.reference_layout_attention` gives them.
    """
    s, b, heads, _ = q.shape
    gp = k.shape[2]
    out = torch.zeros(q.shape, device=q.device)
    lse = torch.full((b, heads, s), float("-inf"), device=q.device)
    for i, (a, e) in enumerate(plan.q_tiles):
        if plan.pairs[i]:
            tile_out, tile_lse = _forward_row(_query_tile(q, a, e, gp), k, v, plan, i)
            _put_query_tile(out, a, e, tile_out)
            _put_row_stat_tile(lse, a, e, tile_lse)
    return out, lse


def merge_blocks(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge of two blocks' results (``out [s, b, np, hn]`` fp32, ``lse [b, np, s]``): the
    attention over both blocks' keys. ``lse = log(e^lse + e^block_lse)``, each ``out`` weighted by its share.
    ``out`` is updated in place and ``block_out`` scaled in place (both consumed); returns ``(out, merged lse)``."""
    merged = torch.logaddexp(lse, block_lse)  # [b, np, s]
    safe = merged.masked_fill(merged == float("-inf"), 0.0)  # neither block seen: both weights 0
    w_old = torch.exp(lse - safe).permute(2, 0, 1).unsqueeze(-1)  # [b, np, s] -> [s, b, np, 1]
    w_new = torch.exp(block_lse - safe).permute(2, 0, 1).unsqueeze(-1)
    return out.mul_(w_old).add_(block_out.mul_(w_new)), merged


# --- backward ----------------------------------------------------------------------------------------------


def softmax_delta(grad_out: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``D = rowsum(grad_out * out)`` ``[b, np, s]`` fp32 of the final output ``out`` and its gradient (``[s, b, np,
    hn]``): the softmax backward's row term, the same for every block."""
    return (grad_out.float() * out.float()).sum(dim=-1).permute(1, 2, 0)  # [s, b, np] -> [b, np, s]


@dataclass(frozen=True)
class _Backward:
    """One block's backward operands (as given: tiles are taken from them) and its gradient buffers (fp32)."""

    q: torch.Tensor  # [s, b, np, hn]
    grad_out: torch.Tensor  # [s, b, np, hn]
    lse: torch.Tensor  # [b, np, s], 0 where -inf (such a row's scores are all -inf: P = 0)
    delta: torch.Tensor  # [b, np, s]
    k: torch.Tensor  # [s_k, b, gp, hn]
    v: torch.Tensor  # [s_k, b, gp, hn]
    dq: torch.Tensor  # [s, b, np, hn]
    dk: torch.Tensor  # [s_k, b, gp, hn], scaled at the end
    dv: torch.Tensor  # [s_k, b, gp, hn]


def _backward_row(g: _Backward, plan: TilePlan, i: int) -> None:
    """Query tile ``i``'s share of the gradients, added to ``g.dq``, ``g.dk`` (unscaled) and ``g.dv``."""
    a, e = plan.q_tiles[i]
    gp = g.k.shape[2]
    scale = 1.0 / math.sqrt(g.q.shape[-1])
    q = _query_tile(g.q, a, e, gp)  # [b, gp, tq*r, hn]
    grad_out = _query_tile(g.grad_out, a, e, gp)
    lse = _row_stat_tile(g.lse, a, e, gp)  # [b, gp, tq*r, 1]
    delta = _row_stat_tile(g.delta, a, e, gp)
    dq = torch.zeros_like(q)
    for j, full in plan.pairs[i]:
        c, d = plan.kv_tiles[j]
        k, v = _key_tile(g.k, c, d), _key_tile(g.v, c, d)  # [b, gp, tk, hn]
        probs = torch.exp(_scores(q, k, plan, i, j, full, scale) - lse)  # [b, gp, tq*r, tk]
        # [b, gp, tk, tq*r] x [b, gp, tq*r, hn] -> [b, gp, tk, hn] -> [tk, b, gp, hn]
        g.dv[c:d] += torch.matmul(probs.transpose(-1, -2), grad_out).permute(2, 0, 1, 3)
        dscores = probs * (torch.matmul(grad_out, v.transpose(-1, -2)) - delta)  # [b, gp, tq*r, tk]
        dq += torch.matmul(dscores, k)  # [b, gp, tq*r, tk] x [b, gp, tk, hn]
        g.dk[c:d] += torch.matmul(dscores.transpose(-1, -2), q).permute(2, 0, 1, 3)
    dq = dq.mul_(scale).unflatten(2, (e - a, -1))  # [b, gp, tq*r, hn] -> [b, gp, tq, r, hn]
    g.dq[a:e] += dq.permute(2, 0, 1, 3, 4).flatten(2, 3)  # -> [tq, b, np, hn]


def block_backward(  # noqa: PLR0913 (the saved forward tensors, the plan and an optional dq buffer)
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    plan: TilePlan,
    dq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the attention over one block, given the FINAL output's ``lse`` and ``delta``.

    Args:
        grad_out: ``[s, b, np, hn]`` gradient of the final context; q: ``[s, b, np, hn]``; k, v: ``[s_k, b, gp, hn]``.
        lse: ``[b, np, s]`` the final log-sum-exp (over every block); delta: ``[b, np, s]`` :func:`softmax_delta`.
        plan: the block's tiles (:func:`plan_tiles` of the query and key layouts).
        dq: an fp32 ``[s, b, np, hn]`` buffer to add this block's query gradient to (None: a new one).
    Returns:
        ``(dq [s, b, np, hn], dk [s_k, b, gp, hn], dv [s_k, b, gp, hn])`` fp32: ``dq`` with this block's share
        added (summed over the blocks, the query gradient); ``dk``, ``dv`` this block's keys' gradient from these
        queries.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    g = _Backward(
        q=q,
        grad_out=grad_out,
        lse=lse.masked_fill(lse == float("-inf"), 0.0),
        delta=delta,
        k=k,
        v=v,
        dq=torch.zeros(q.shape, device=q.device) if dq is None else dq,
        dk=torch.zeros(k.shape, device=k.device),
        dv=torch.zeros(v.shape, device=v.device),
    )
    for i in range(len(plan.q_tiles)):
        if plan.pairs[i]:
            _backward_row(g, plan, i)
    return g.dq, g.dk.mul_(scale), g.dv


# --- one block as an autograd function ---------------------------------------------------------------------


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TilePlan
    ) -> torch.Tensor:
        s, b, heads, hn = q.shape
        out, lse = block_forward(q, k, v, plan)
        context = out.to(q.dtype).reshape(s, b, heads * hn)  # [s, b, np, hn] -> [s, b, np*hn]
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, context, lse)
        return context

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, context, lse = ctx.saved_tensors
        grad_out = grad.reshape(q.shape)  # [s, b, np*hn] -> [s, b, np, hn]
        delta = softmax_delta(grad_out, context.view(q.shape))
        dq, dk, dv = block_backward(grad_out, q, k, v, lse, delta, ctx.plan)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_layout: TokenLayout,
    kv_layout: TokenLayout,
    *,
    window_left: int | None = None,
    tile_size: int = DEFAULT_TILE_SIZE,
) -> torch.Tensor:
    """Attention of ``q [s, b, np, hn]`` over ``k, v [s_k, b, gp, hn]`` under the layout rule, tile by tile.

    Same values as :func:`~megatron.model.token_layout.reference_layout_attention` (its context), without any
    ``[s, s_k]`` tensor beyond one tile; autograd saves q, k, v, the context and ``lse [b, np, s]`` only.

    Returns:
        ctx ``[s, b, np*hn]`` in q's dtype.
    """
    plan = plan_tiles(q_layout, kv_layout, window_left=window_left, tile_size=tile_size)
    return _BlockAttention.apply(q, k, v, plan)
