"""Megatron's pretraining samplers and data loader, driven by ``consumed_samples`` (resume = same next batch).

How the trainer maps a step to samples (the contract every DP layout shares)
----------------------------------------------------------------------------
Let ``G = --global-batch-size``, ``b = --micro-batch-size``, ``dp`` the data-parallel size and ``M = G // (b*dp)``
micro-batches per step. The global batch that starts at ``consumed_samples = c`` (``c = step * G`` with a fixed
batch size) is the ``G`` consecutive sample *positions* ``[c, c + G)``; micro-batch ``m`` (``0 <= m < M``) of DP
rank ``r`` gets positions::

    c + m * (b * dp) + r * b + j,   j = 0 .. b - 1          (see :func:`micro_batch_positions`)

so micro-step ``m`` covers the block ``[c + m*b*dp, c + (m+1)*b*dp)`` and rank ``r`` its ``r``-th slice of ``b``.
Whatever ``dp`` is, the union over ranks and micro-batches is ``[c, c + G)``: DP=1 with 4 micro-batches of 2 and
DP=2 with 2 micro-batches of 2 (or DP=4 with 1) see the same 8 samples, only grouped differently, and the summed
gradient is the same. A position becomes a dataset index:

* ``single`` (:class:`MegatronPretrainingSampler`, Megatron's default): index = position.
* ``cyclic`` (:class:`MegatronPretrainingRandomSampler`): ``index = perm_e[position % L]`` with epoch
  ``e = position // L``, epoch length ``L = total - total % G`` and ``perm_e`` the first ``L`` entries of
  ``torch.randperm(total)`` from a generator seeded with :func:`epoch_generator_seed` (``e`` itself when
  ``seed == 0``, as Megatron). ``data_sharding=True`` selects Megatron's per-rank buckets instead, which are NOT DP-invariant.

Resume: build the loader with the ``consumed_samples`` stored in the checkpoint; the first batch is the one the
interrupted run would have drawn next. There is no other loader state.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def _check_layout(
    total_samples: int,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
) -> None:
    if total_samples <= 0:
        raise ValueError(f"the dataset has no samples to consume (total_samples={total_samples}).")
    if not 0 <= consumed_samples < total_samples:
        raise ValueError(
            f"consumed_samples ({consumed_samples}) must be in [0, {total_samples}): the run has used up its "
            "dataset; build the datasets with more samples (--train-iters/--train-samples) or reset the counter."
        )
    if micro_batch_size < 1 or data_parallel_size < 1:
        raise ValueError(
            f"--micro-batch-size ({micro_batch_size}) and the data-parallel size ({data_parallel_size}) must be >= 1."
        )
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(
            f"data_parallel_rank ({data_parallel_rank}) must be in [0, data_parallel_size={data_parallel_size})."
        )


def micro_batch_positions(
    consumed_samples: int,
    micro_batch_index: int,
    data_parallel_rank: int,
    *,
    micro_batch_size: int,
    data_parallel_size: int,
) -> range:
    """Sample positions of micro-batch ``micro_batch_index`` on ``data_parallel_rank`` (see module docstring).

    ``consumed_samples`` is the count at the start of the global batch.
    """
    start = (
        consumed_samples
        + micro_batch_index * micro_batch_size * data_parallel_size
        + data_parallel_rank * micro_batch_size
    )
    return range(start, start + micro_batch_size)


class MegatronPretrainingSampler:
    """Megatron's ``single`` batch sampler: sequential positions from ``consumed_samples``, DP-sliced.

    Yields, per micro-step, this rank's ``micro_batch_size`` indices of the next ``micro_batch_size * dp`` block.

    Args:
        total_samples: ``len(dataset)``.
        consumed_samples: samples already consumed by all ranks (resume point).
        micro_batch_size: samples per rank per micro-step.
        data_parallel_rank: this rank's DP index.
        data_parallel_size: DP world size.
        drop_last: drop the final partial block (Megatron's default).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        _check_layout(
            total_samples,
            consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
        )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        block = self.micro_batch_times_data_parallel_size
        lo = self.data_parallel_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + block <= self.total_samples:
            yield list(range(start + lo, start + lo + self.micro_batch_size))
            start += block
        if start < self.total_samples and not self.drop_last:
            # Megatron yields this rank's slice of the partial block, which may be short or empty.
            yield list(range(start, self.total_samples))[lo : lo + self.micro_batch_size]


def epoch_generator_seed(seed: int, epoch: int) -> int:
    """Generator seed of the cyclic sampler's epoch: ``epoch`` when ``seed == 0`` (Megatron's choice), else a
    32-bit hash of ``(seed, epoch)`` (torch's CPU generator keeps only 32 bits of a seed)."""
    if seed == 0:
        return epoch
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, epoch]).generate_state(1)[0])


@dataclass(frozen=True)
class EpochOrder:
    """How :class:`MegatronPretrainingRandomSampler` cuts and shuffles its epochs (Trident's additions to
    Megatron's signature; the defaults are Megatron's behaviour)."""

    global_batch_size: int | None = None
    """``G``: the epoch length is a multiple of it (default ``micro_batch_size * dp``)."""
    seed: int = 0
    """Data seed mixed into each epoch's permutation seed (:func:`epoch_generator_seed`)."""


class MegatronPretrainingRandomSampler:
    """Megatron's ``cyclic`` batch sampler: a fresh epoch-seeded permutation each pass over the data.

    Each ``iter()`` continues from ``consumed_samples`` to the end of the current epoch (the trainer re-iterates
    for the next epoch); ``consumed_samples`` advances by ``micro_batch_size * dp`` per yielded micro-batch.

    Args:
        dataset: the dataset (kept for Megatron's signature).
        total_samples: ``len(dataset)``.
        consumed_samples: samples already consumed by all ranks (resume point).
        micro_batch_size: samples per rank per micro-step.
        data_parallel_rank: this rank's DP index.
        data_parallel_size: DP world size.
        data_sharding: Megatron's per-rank contiguous buckets (not DP-invariant); default: the DP-invariant layout
            of the module docstring.
        order: the epoch length's multiple (``G``) and the data seed mixed into each epoch's seed.
    """

    def __init__(
        self,
        dataset: Any,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_sharding: bool = False,
        *,
        order: EpochOrder = EpochOrder(),
    ) -> None:
        _check_layout(
            total_samples,
            consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
        )
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.seed = order.seed
        block = order.global_batch_size or self.micro_batch_times_data_parallel_size
        if block % self.micro_batch_times_data_parallel_size:
            raise ValueError(
                f"--global-batch-size ({block}) must be a multiple of micro-batch size x data-parallel size "
                f"({self.micro_batch_times_data_parallel_size})."
            )
        if data_sharding:
            block = self.micro_batch_times_data_parallel_size  # Megatron's epoch length
        self.epoch_length = total_samples - total_samples % block
        if self.epoch_length == 0:
            raise ValueError(
                f"the dataset ({total_samples} samples) is smaller than one global batch ({block}); "
                "use more data or a smaller --global-batch-size."
            )

    def __len__(self) -> int:
        return self.total_samples

    def _generator(self, epoch: int) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(epoch_generator_seed(self.seed, epoch))
        return g

    def _this_epoch_indices(self, epoch: int, offset: int) -> list[int]:
        mbs, dp, r = self.micro_batch_size, self.data_parallel_size, self.data_parallel_rank
        if self.data_sharding:
            bucket_size = (self.total_samples // (mbs * dp)) * mbs
            perm = torch.randperm(bucket_size, generator=self._generator(epoch)).tolist()
            return [r * bucket_size + x for x in perm[offset // dp :]]
        perm = torch.randperm(self.total_samples, generator=self._generator(epoch))[
            : self.epoch_length
        ].tolist()
        block = mbs * dp
        out: list[int] = []
        for start in range(offset, self.epoch_length - block + 1, block):
            out.extend(perm[start + r * mbs : start + (r + 1) * mbs])
        return out

    def __iter__(self) -> Iterator[list[int]]:
        epoch, offset = divmod(self.consumed_samples, self.epoch_length)
        if offset % self.micro_batch_times_data_parallel_size:
            raise ValueError(
                f"consumed_samples ({self.consumed_samples}) is not a whole number of micro-steps "
                f"({self.micro_batch_times_data_parallel_size} samples each); it must come from a checkpoint of "
                "this run's batch layout."
            )
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        indices = self._this_epoch_indices(epoch, offset)
        for start in range(0, len(indices) - self.micro_batch_size + 1, self.micro_batch_size):
            self.consumed_samples += self.micro_batch_times_data_parallel_size
            yield indices[start : start + self.micro_batch_size]


class EndlessBatchSampler:
    """Re-iterates a per-epoch batch sampler forever (Megatron's ``cyclic_iter`` around the loader, built in)."""

    def __init__(self, sampler: MegatronPretrainingRandomSampler) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield from self.sampler


@dataclass(frozen=True)
class BatchLayout:
    """How each global batch is cut into this data-parallel rank's micro-batches (see the module docstring)."""

    micro_batch_size: int
    """``--micro-batch-size`` ``b``: samples per rank per micro-step."""
    global_batch_size: int
    """``--global-batch-size`` ``G``: samples per step over all data-parallel ranks."""
    data_parallel_rank: int
    """This rank's index ``r`` in its data-parallel group."""
    data_parallel_size: int
    """``dp``: ranks in the data-parallel group."""


def build_pretraining_data_loader(
    dataset: Any,
    consumed_samples: int,
    *,
    layout: BatchLayout,
    dataloader_type: str = "single",
    num_workers: int = 0,
    seed: int = 0,
    data_sharding: bool = False,
    pin_memory: bool = False,
) -> torch.utils.data.DataLoader | None:
    """A DataLoader yielding this DP rank's micro-batches from ``consumed_samples`` on (None for no dataset).

    Each batch is the default collation of the items: ``{"text": int64[micro_batch_size, seq_length + 1], ...}``.
    The trainer draws ``G // (b * dp)`` batches per step (the sizes of ``layout``). A ``single`` loader ends after
    the dataset's last full micro-step; a ``cyclic`` loader never ends (each epoch is a fresh permutation, see
    :class:`EndlessBatchSampler`).

    Args:
        dataset: map-style dataset or None.
        consumed_samples: ``consumed_train_samples`` from the checkpoint (0 when starting).
        layout: micro- and global batch size, this rank's DP index and the DP size.
        dataloader_type: ``--dataloader-type``: ``single`` or ``cyclic``.
        num_workers: ``--num-workers``.
        seed: data seed for ``cyclic``.
        data_sharding: Megatron's per-rank buckets for ``cyclic`` (not DP-invariant).
        pin_memory: pin the batches (Megatron's ``pin_memory=True``); for a CUDA run only (the caller passes
            ``run.device.type == "cuda"``): pinning creates a CUDA context, so a CPU run never asks for it.

    Raises:
        ValueError: bad batch layout, consumed_samples out of range, or an unknown loader type.
    """
    if dataset is None:
        return None
    mbs, dp = layout.micro_batch_size, layout.data_parallel_size
    if layout.global_batch_size % (mbs * dp):
        raise ValueError(
            f"--global-batch-size ({layout.global_batch_size}) must be a multiple of --micro-batch-size "
            f"({mbs}) x data-parallel size ({dp})."
        )
    if num_workers < 0:
        raise ValueError(f"--num-workers must be >= 0, got {num_workers}.")
    if dataloader_type == "single":
        batch_sampler: Any = MegatronPretrainingSampler(
            len(dataset), consumed_samples, mbs, layout.data_parallel_rank, dp
        )
    elif dataloader_type == "cyclic":
        batch_sampler = EndlessBatchSampler(
            MegatronPretrainingRandomSampler(
                dataset,
                len(dataset),
                consumed_samples,
                mbs,
                layout.data_parallel_rank,
                dp,
                data_sharding,
                order=EpochOrder(global_batch_size=layout.global_batch_size, seed=seed),
            )
        )
    else:
        raise ValueError(
            f"--dataloader-type {dataloader_type!r} is not supported; use 'single' or 'cyclic'."
        )
    # A private generator: starting an iterator draws a worker base seed, which must not come from (and advance)
    # the global torch RNG, or dropout after an evaluation would depend on how many loaders were started.
    generator = torch.Generator().manual_seed(seed + consumed_samples)
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        generator=generator,
    )
