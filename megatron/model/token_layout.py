"""Where a rank's tokens sit in their samples: the attention mask as per-token facts, never an ``[s, s]`` tensor.

Legend: ``s`` this rank's tokens (``S`` the whole sequence), ``b`` micro-batch, ``np`` query heads and ``gp`` key/value
groups of this rank, ``hn`` head dim, ``N`` context-parallel size (``--context-parallel-size``), ``left`` the
sliding window (``--window-size``).

A :class:`TokenLayout` gives, for each local token, its global position ``i`` in the sample (``0 .. S-1``) and,
for packed documents (``--reset-attention-mask``), the index of the document holding it. A query at ``i`` in
document ``d`` sees a key at ``j`` exactly when::

    j <= i   and   doc(j) == d   and   i - j <= left          (no documents: one per sample; no window: left = inf)

Context parallelism keeps ``S/N`` tokens per rank in the causal load-balanced order: the sequence is cut into ``2N``
chunks of ``S/(2N)``, and CP rank ``r`` holds chunks ``r`` and ``2N-1-r`` (so every rank has the same share of the
causal work). Worked example, ``S = 8``, ``N = 2`` (chunks of 2)::

    chunks      [0 1] [2 3] [4 5] [6 7]
    CP rank 0   [0 1]             [6 7]      positions 0 1 6 7
    CP rank 1         [2 3] [4 5]            positions 2 3 4 5

:func:`reference_layout_attention` is the dense oracle (fp32 scores, materialized ``[b, np, s, s_k]``); the
memory-light paths (``model/block_attention.py``, ring exchange in ``model/context_parallel.py``) must equal it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLayout:
    """Global positions (and documents) of a rank's tokens; see the module docstring for the visibility rule."""

    positions: torch.Tensor
    """``[s]`` int64: each local token's index in its sample's whole sequence (the same for every sample)."""
    documents: torch.Tensor | None = None
    """``[b, s]`` int64: the document each token belongs to (packed documents), None: one document per sample."""

    @staticmethod
    def contiguous(
        s: int, device: torch.device, documents: torch.Tensor | None = None
    ) -> TokenLayout:
        """The layout of a whole unsplit sequence of ``s`` tokens (positions ``0 .. s-1``)."""
        return TokenLayout(torch.arange(s, device=device), documents)

    def take(self, index: torch.Tensor) -> TokenLayout:
        """The layout of the tokens at local ``index`` (``[s']`` int64) only."""
        docs = None if self.documents is None else self.documents.index_select(1, index)
        return TokenLayout(self.positions.index_select(0, index), docs)

    def visible(self, keys: TokenLayout, window_left: int | None = None) -> torch.Tensor:
        """Bool ``[b or 1, s, s_k]``: True where this layout's query token sees that key token."""
        i = self.positions.view(1, -1, 1)  # [1, s, 1]
        j = keys.positions.view(1, 1, -1)  # [1, 1, s_k]
        seen = j <= i
        if window_left is not None:
            seen = seen & (i - j <= window_left)
        if self.documents is not None and keys.documents is not None:
            seen = seen & (
                self.documents.unsqueeze(2) == keys.documents.unsqueeze(1)
            )  # [b, s, s_k]
        return seen


@dataclass(frozen=True)
class PackedDocuments:
    """The attention mask of packed documents (``--reset-attention-mask``) as document ids, passed where a dense
    ``[b, 1, s, s]`` mask used to be (``attention_mask`` of the model, its layers and attention)."""

    ids: torch.Tensor
    """``[b, S]`` int64 document index of every token of the WHOLE sequence (:func:`document_ids`), on every rank
    (never split by context or sequence parallelism: each rank takes its own tokens' ids by position)."""


def rank_layout(
    seq_length: int,
    cp_size: int,
    cp_rank: int,
    documents: PackedDocuments | None,
    device: torch.device,
) -> TokenLayout:
    """The layout of the ``S/N`` tokens CP rank ``cp_rank`` holds (all ``S`` at ``N = 1``)."""
    positions = load_balanced_positions(seq_length, cp_size, cp_rank).to(device)
    docs = None if documents is None else documents.ids.index_select(1, positions)
    return TokenLayout(positions, docs)


def load_balanced_positions(seq_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``[S/N]`` int64: the global positions CP rank ``cp_rank`` of ``cp_size`` holds (chunks ``r`` and
    ``2N-1-r`` of ``2N``). ``S`` must be divisible by ``2N`` (checked by the config); at ``N = 1``: ``0 .. S-1``."""
    if cp_size == 1:
        return torch.arange(seq_length)
    chunk = seq_length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    last = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, torch.arange(last, last + chunk)])


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``[b, S]`` int64 document index of each token of packed samples: a document ends with (and includes) its
    end-of-document token ``eod``, as Megatron's ``--reset-attention-mask`` cuts them."""
    ends = (tokens == eod).long()  # [b, S]
    return torch.cumsum(ends, dim=1) - ends  # the EOD token stays in the document it closes


def reference_layout_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_layout: TokenLayout,
    kv_layout: TokenLayout,
    *,
    window_left: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention under the layout rule (the oracle; fp32 softmax).

    Args:
        q: ``[s, b, np, hn]``; k, v: ``[s_k, b, gp, hn]`` with ``gp`` dividing ``np`` (query head ``i`` uses group
            ``i // (np/gp)``).
        q_layout, kv_layout: where the query and key tokens sit.
    Returns:
        ``(ctx [s, b, np*hn] in q's dtype, lse [b, np, s] fp32)``: ``lse`` the log-sum-exp of each query's scaled
        scores (``-inf`` for a query that sees no key, whose context is 0).
    """
    s, b, heads, hn = q.shape
    repeats = heads // k.shape[2]
    qh = q.permute(1, 2, 0, 3).float()  # [s, b, np, hn] -> [b, np, s, hn]
    kh = (
        k.repeat_interleave(repeats, dim=2).permute(1, 2, 3, 0).float()
    )  # [s_k, b, gp, hn] -> [b, np, hn, s_k]
    vh = (
        v.repeat_interleave(repeats, dim=2).permute(1, 2, 0, 3).float()
    )  # [s_k, b, gp, hn] -> [b, np, s_k, hn]
    scores = torch.matmul(qh, kh) / math.sqrt(hn)  # [b, np, s, s_k]
    seen = q_layout.visible(kv_layout, window_left).unsqueeze(1)  # [b or 1, 1, s, s_k]
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [b, np, s]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # a query seeing nothing: zeros
    ctx = torch.matmul(probs, vh)  # [b, np, s, s_k] x [b, np, s_k, hn] -> [b, np, s, hn]
    return ctx.permute(2, 0, 1, 3).reshape(s, b, heads * hn).to(q.dtype), lse
