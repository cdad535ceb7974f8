"""Attention over a sequence split by context parallelism (``--context-parallel-size N``), and over packed documents.

Legend: ``S`` whole sequence, ``s = S/N`` this rank's tokens (load-balanced order, ``model/token_layout.py``),
``b`` micro-batch, ``np`` query heads and ``gp`` key/value groups of this rank, ``hn`` head dim.

:func:`context_attention` is the one entry point ``ParallelAttention`` calls when the run has a CP group or packed
documents. FIRST CUT (to be replaced by the ring exchange with an online-softmax merge): the K/V of every CP rank
are all-gathered (differentiable: the backward reduce-scatters) and the dense oracle
``reference_layout_attention`` attends over them under the layout rule.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.model.token_layout import PackedDocuments, rank_layout, reference_layout_attention
from megatron.mpu.mappings import gather_from_sequence_parallel_region
from megatron.mpu.parallel_state import ProcessGroup


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
        ctx ``[s, b, np*hn]``.
    """
    n, r = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    seq_length = q.shape[0] * n
    mine = rank_layout(seq_length, n, r, documents, q.device)
    if n == 1:
        return reference_layout_attention(q, k, v, mine, mine, window_left=window_left)[0]
    k_all = gather_from_sequence_parallel_region(
        k, True, group
    )  # [s, b, gp, hn] -> [S, b, gp, hn], rank order
    v_all = gather_from_sequence_parallel_region(v, True, group)
    order = torch.cat([rank_layout(seq_length, n, j, None, q.device).positions for j in range(n)])
    kv_layout = rank_layout(seq_length, 1, 0, documents, q.device).take(order)
    return reference_layout_attention(q, k_all, v_all, mine, kv_layout, window_left=window_left)[0]
