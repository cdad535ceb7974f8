"""The global per-token loss of --sft: the mean over the loss tokens of the WHOLE global batch.

A mean per micro-batch (pretraining's ``loss_func``) weighs a micro-batch with 3 target tokens as much as one with
3,000; SFT batches differ that much. The rule (issue #33): the loss of a global batch of micro-batches ``i`` (over
every DP rank) with per-token losses ``l`` and loss masks ``m`` is::

    L = sum_i sum_t l[i, t] * m[i, t]  /  T,        T = sum_i sum_t m[i, t]   (the global batch's loss tokens)

Mechanism: before the step, every rank takes its ``gas`` micro-batches of the global batch, counts its mask tokens
and sums the counts over the sequence-data-parallel group (DP x CP x Ulysses: each of those ranks holds other
tokens; TP and PP ranks hold copies), one all-reduce per step. The loss mask becomes the weight
``w = m * gas * dp / T`` and ``loss_func(..., reduction="sum")`` gives ``sum_t l * w`` (summed over the CP x
Ulysses group as before). DeepSpeed divides every micro-batch's backward by ``gas`` and averages the gradients
over ``dp`` (``loss_func``'s CP scale unchanged), so the gradient is exactly that of ``L``; the reported loss,
``mean over micro-batches and DP``, is ``L`` itself. The same holds for the pipeline engine (the weights travel
where the loss mask travels, in the pipe tuple; its loss is averaged the same way) and for evaluation.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron.mpu.mappings import all_reduce_sum_
from megatron.mpu.parallel_state import ParallelState, ProcessGroup

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class GlobalTokenWeights:
    """Turns the loss masks of a global batch into the weights of the global per-token mean (module docstring)."""

    group: ProcessGroup
    """The sequence-data-parallel group (DP x CP x Ulysses of this stage and TP rank): the counts are summed over
    it."""
    data_parallel_size: int
    """``dp``: DeepSpeed averages the gradients (and the reported loss) over it."""

    @classmethod
    def of(cls, state: ParallelState) -> GlobalTokenWeights:
        """The weights of the run's ``state``."""
        return cls(
            group=state.get_sequence_data_parallel_group(),
            data_parallel_size=state.get_data_parallel_world_size(),
        )

    def take(self, micro_batches: Iterator[Batch], gas: int) -> tuple[list[Batch], int]:
        """This rank's ``gas`` micro-batches of the next global batch, their ``loss_mask`` replaced by the weights
        ``mask * gas * dp / T``, and ``T`` (the global batch's loss tokens; 0 gives all-zero weights).

        Every rank of the group must call it for the same global batch (one all-reduce).
        """
        batches = [next(micro_batches) for _ in range(gas)]
        device = batches[0]["loss_mask"].device
        local = sum(
            (b["loss_mask"].sum(dtype=torch.float64) for b in batches),
            torch.zeros((), dtype=torch.float64, device=device),
        )
        total = int(all_reduce_sum_(local.reshape(1), group=self.group).item())
        dp = self.data_parallel_size
        return weigh(batches, total=total, gas=gas, data_parallel_size=dp), total


def weigh(batches: list[Batch], *, total: int, gas: int, data_parallel_size: int) -> list[Batch]:
    """``batches`` with ``loss_mask`` ``m`` replaced by ``m * gas * dp / total`` (fp32; all zero when ``total`` is
    0): summed per micro-batch, divided by ``gas`` and averaged over ``dp`` ranks, the global per-token mean."""
    scale = gas * data_parallel_size / max(total, 1)
    return [{**b, "loss_mask": b["loss_mask"].float() * scale} for b in batches]
