"""DeepSpeed-Ulysses attention: the core attention of a layer run through DeepSpeed's ``DistributedAttention``.

Legend: ``s`` sequence, ``b`` micro-batch, ``N`` Ulysses size (``--ds-sequence-parallel-size``), ``np`` query heads
and ``gp`` key/value groups of this TP rank, ``hn`` head dim.

Outside attention every rank of a Ulysses group holds ``s/N`` consecutive tokens (rank ``r``: positions
``r*s/N .. (r+1)*s/N - 1``) of the same samples; everything but attention is per token, so it runs on the slice as
is. Attention needs every token, so one all-to-all per tensor trades the sequence split for a head split::

    q [s/N, b, np, hn]  --all-to-all-->  [s, b, np/N, hn]     rank r keeps query heads r*np/N .. (r+1)*np/N - 1
    k, v [s/N, b, gp, hn] -------------> [s, b, gp/N, hn]     and the K/V groups they use (GQA: head i uses
                                                               group i // (np/gp); the split keeps that)
    core attention (causal over the whole gathered sequence, SDPA or the reference path)
    ctx [s, b, np/N, hn]  --all-to-all-->  [s/N, b, np, hn] -> [s/N, b, np*hn]  (the row-parallel dense follows)

The all-to-all gathers the sequence chunks in rank order, so the gathered ``s`` is the global order and the
causal mask (or a given ``[b, 1, s, s]`` mask, never sliced) applies unchanged. RoPE is applied to q and k before
the exchange with the rank's global positions (the data iterator slices the position ids with the tokens). The
exchanges' backward is the reverse all-to-all (DeepSpeed's ``_SeqAllToAll``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron.model.token_layout import PackedDocuments
from megatron.mpu.parallel_state import ProcessGroup

CoreAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | PackedDocuments | None], torch.Tensor
]
"""``core(q [s, b, np', hn], k, v [s, b, gp', hn], mask) -> ctx [s, b, np'*hn]`` (``ParallelAttention._core``)."""

_SEQ_FIRST = 1  # DistributedAttention's batch_dim_idx for [s, b, heads, hn] tensors


class _LocalAttention(nn.Module):
    """DistributedAttention's ``local_attention``: the layer's core attention on the gathered sequence, its
    context returned per head (``[s, b, np/N*hn] -> [s, b, np/N, hn]``) as the reverse all-to-all needs it."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        core: CoreAttention,
        attention_mask: torch.Tensor | PackedDocuments | None,
    ) -> torch.Tensor:
        s, b, heads, hn = q.shape
        ctx = core(q, k, v, attention_mask)  # [s, b, np/N*hn]
        return ctx.view(s, b, heads, hn)  # [s, b, np/N*hn] -> [s, b, np/N, hn]


class UlyssesAttention(nn.Module):
    """The all-to-all wrapper of a layer's core attention over a Ulysses ``group`` (no parameters).

    Args:
        group: the Ulysses sequence-parallel group (``parallel_state.get_sequence_parallel_group()``); a group of
            one rank is allowed (``--force-ds-sequence-parallel``: the exchanges are then copies).

    Raises:
        RuntimeError: DeepSpeed's communication layer is not initialized (``deepspeed.init_distributed``), which
            ``DistributedAttention`` runs its all-to-alls through.
    """

    def __init__(self, group: ProcessGroup) -> None:
        super().__init__()
        import deepspeed.comm
        from deepspeed.sequence.layer import DistributedAttention

        if not deepspeed.comm.is_initialized():
            raise RuntimeError(
                "DeepSpeed-Ulysses attention runs its all-to-alls through deepspeed.comm; call "
                "deepspeed.init_distributed() before building the model (megatron.training.initialize does)"
            )
        self.distributed_attention = DistributedAttention(
            _LocalAttention(), group, scatter_idx=2, gather_idx=0
        )

    def forward(
        self,
        core: CoreAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | PackedDocuments | None,
    ) -> torch.Tensor:
        """``core`` attention of this rank's slice over the whole sequence.

        Args:
            core: the layer's core attention (see :data:`CoreAttention`).
            q: ``[s/N, b, np, hn]``; k, v: ``[s/N, b, gp, hn]`` (after RoPE).
            attention_mask: None = causal over the gathered sequence; else bool ``[b or 1, 1, s, s]``.

        Returns:
            context ``[s/N, b, np*hn]``.
        """
        ctx = self.distributed_attention(
            q, k, v, _SEQ_FIRST, None, core=core, attention_mask=attention_mask
        )  # [s/N, b, np, hn] (all-to-all, core, all-to-all)
        return ctx.reshape(ctx.shape[0], ctx.shape[1], -1)  # [s/N, b, np, hn] -> [s/N, b, np*hn]
