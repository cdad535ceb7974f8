"""Pretraining samplers: Megatron's order, resume from consumed_samples, DP slicing, DP-size invariance, loader."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from megatron.data.mock_dataset import MockGPTDataset
from megatron.data.samplers import (
    BatchLayout,
    EpochOrder,
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
    micro_batch_positions,
)


def megatron_single_reference(total, consumed, mbs, rank, dp, drop_last=True):
    """Megatron's MegatronPretrainingSampler.__iter__, literally."""
    batch = []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == mbs * dp:
            yield batch[rank * mbs : (rank + 1) * mbs]
            batch = []
    if len(batch) > 0 and not drop_last:
        yield batch[rank * mbs : (rank + 1) * mbs]


def megatron_sharded_reference(total, consumed, mbs, rank, dp):
    """Megatron's MegatronPretrainingRandomSampler.__iter__ with data_sharding=True, literally."""
    active = total - total % (mbs * dp)
    epoch = consumed // active
    current = consumed % active
    bucket_size = (total // (mbs * dp)) * mbs
    bucket_offset = current // dp
    g = torch.Generator()
    g.manual_seed(epoch)
    random_idx = torch.randperm(bucket_size, generator=g).tolist()
    idx_range = [rank * bucket_size + x for x in random_idx[bucket_offset:]]
    batch = []
    for idx in idx_range:
        batch.append(idx)
        if len(batch) == mbs:
            yield batch
            batch = []


def global_batches(make_sampler, dp, mbs, gbs, steps):
    """Per step: the ordered list of (micro, rank, indices) for all ranks."""
    iters = [iter(make_sampler(r)) for r in range(dp)]
    micro = gbs // (mbs * dp)
    out = []
    for _ in range(steps):
        step = []
        for m in range(micro):
            for r in range(dp):
                step.append((m, r, next(iters[r])))
        out.append(step)
    return out


@pytest.mark.parametrize(
    ("total", "consumed", "mbs", "dp"),
    [(100, 0, 2, 4), (101, 8, 3, 2), (50, 49, 1, 1), (64, 16, 4, 4)],
)
def test_single_sampler_is_megatrons(total, consumed, mbs, dp) -> None:
    for rank in range(dp):
        for drop_last in (True, False):
            ours = list(MegatronPretrainingSampler(total, consumed, mbs, rank, dp, drop_last))
            assert ours == list(
                megatron_single_reference(total, consumed, mbs, rank, dp, drop_last)
            )


def test_dp_slicing_partitions_each_micro_step() -> None:
    dp, mbs = 4, 3
    per_rank = [list(MegatronPretrainingSampler(120, 0, mbs, r, dp)) for r in range(dp)]
    for step in range(len(per_rank[0])):
        block = [i for r in range(dp) for i in per_rank[r][step]]
        assert block == list(range(step * mbs * dp, (step + 1) * mbs * dp))


LAYOUTS = [
    (1, 2),
    (2, 2),
    (4, 2),
    (2, 1),
    (8, 1),
    (1, 8),
]  # (dp, micro_batch_size) with global batch 8


@pytest.mark.parametrize("kind", ["single", "cyclic"])
def test_global_batch_is_independent_of_dp_size(kind) -> None:
    gbs, total, steps = 8, 203, 40  # 40 steps of 8 = 320 samples: the cyclic sampler wraps an epoch
    seen = {}
    for dp, mbs in LAYOUTS:

        def make(rank, dp=dp, mbs=mbs):
            if kind == "single":
                return MegatronPretrainingSampler(total, 0, mbs, rank, dp)
            return _Cycle(
                lambda c: MegatronPretrainingRandomSampler(
                    None, total, c, mbs, rank, dp, order=EpochOrder(global_batch_size=gbs, seed=3)
                )
            )

        batches = global_batches(make, dp, mbs, gbs, steps if kind == "cyclic" else 25)
        ordered = []
        for step, content in enumerate(batches):
            flat = []
            for m, r, idx in content:
                # The documented mapping: positions c + m*mbs*dp + r*mbs + j.
                positions = micro_batch_positions(
                    step * gbs, m, r, micro_batch_size=mbs, data_parallel_size=dp
                )
                if kind == "single":
                    assert idx == list(positions)
                flat.extend(idx)
            ordered.append(flat)
        seen[(dp, mbs)] = ordered
    reference = seen[LAYOUTS[0]]
    for layout, ordered in seen.items():
        assert ordered == reference, (
            layout
        )  # same samples in the same position order for every layout


class _Cycle:
    """What the trainer does with the cyclic sampler: re-iterate from the updated consumed count forever."""

    def __init__(self, factory):
        self.sampler = factory(0)

    def __iter__(self):
        while True:
            yield from iter(self.sampler)


def test_cyclic_epochs_are_permutations_and_reshuffle() -> None:
    total, gbs = 100, 8
    sampler = MegatronPretrainingRandomSampler(
        None, total, 0, 4, 0, 1, order=EpochOrder(global_batch_size=gbs, seed=0)
    )
    first = [i for b in sampler for i in b]
    assert sampler.epoch_length == 96 and len(first) == 96 and len(set(first)) == 96
    assert sampler.consumed_samples == 96
    second = [i for b in sampler for i in b]  # the next iter() is epoch 1
    assert len(set(second)) == 96 and second != first
    # Seed 0 reproduces Megatron's generator seed (the epoch number).
    g = torch.Generator()
    g.manual_seed(1)
    assert second == torch.randperm(total, generator=g)[:96].tolist()
    other = MegatronPretrainingRandomSampler(
        None, total, 0, 4, 0, 1, order=EpochOrder(global_batch_size=gbs, seed=1)
    )
    assert [i for b in other for i in b] != first


@pytest.mark.parametrize("kind", ["single", "cyclic", "cyclic_sharded"])
def test_resume_from_consumed_samples_continues_identically(kind) -> None:
    total, mbs, dp, gbs = 150, 2, 2, 8

    def make(consumed, rank):
        if kind == "single":
            return MegatronPretrainingSampler(total, consumed, mbs, rank, dp)
        return _Cycle(
            lambda c: MegatronPretrainingRandomSampler(
                None,
                total,
                consumed,
                mbs,
                rank,
                dp,
                kind == "cyclic_sharded",
                order=EpochOrder(global_batch_size=gbs, seed=7),
            )
        )

    for rank in range(dp):
        full = list(itertools.islice(iter(make(0, rank)), 60))
        for k in (
            1,
            5,
            17,
        ):  # resume after k global batches (some past an epoch boundary for cyclic)
            consumed = k * gbs
            micro_per_rank = gbs // (mbs * dp)
            resumed = list(itertools.islice(iter(make(consumed, rank)), 60 - k * micro_per_rank))
            assert resumed == full[k * micro_per_rank :], (rank, k)


def test_sharded_cyclic_sampler_is_megatrons() -> None:
    for total, consumed, mbs, dp in [(100, 0, 2, 2), (103, 12, 3, 2), (64, 32, 2, 4)]:
        for rank in range(dp):
            ours = list(
                MegatronPretrainingRandomSampler(None, total, consumed, mbs, rank, dp, True)
            )
            assert ours == list(megatron_sharded_reference(total, consumed, mbs, rank, dp))


def test_data_loader_yields_this_ranks_micro_batches() -> None:
    ds = MockGPTDataset(64, 16, 50, seed=1)
    for workers in (0, 2):
        loader = build_pretraining_data_loader(
            ds,
            8,
            layout=BatchLayout(2, 8, data_parallel_rank=1, data_parallel_size=2),
            num_workers=workers,
        )
        batches = list(loader)
        assert len(batches) == (64 - 8) // 4
        first = batches[0]["text"]
        assert first.dtype == torch.int64 and first.shape == (2, 17)
        expected = np.stack(
            [ds[i]["text"] for i in (8 + 2, 8 + 3)]
        )  # block [8, 12), rank 1 -> 10, 11
        assert np.array_equal(first.numpy(), expected)
    cyclic = build_pretraining_data_loader(
        ds, 0, layout=BatchLayout(2, 8, 0, 2), dataloader_type="cyclic", seed=2
    )
    # The cyclic loader runs across epoch ends: an epoch is 64 samples, i.e. 16 micro-batches of 2 on rank 0;
    # each epoch gives rank 0 32 distinct samples, in a different order each time.
    indices = list(itertools.islice(iter(cyclic.batch_sampler), 48))
    epochs = [sum(indices[k : k + 16], []) for k in (0, 16, 32)]
    assert all(len(set(e)) == 32 for e in epochs) and epochs[0] != epochs[1] != epochs[2]
    # (The sampler is stateful, as Megatron's: its consumed count advanced, so read batches from a fresh loader.)
    fresh = build_pretraining_data_loader(
        ds, 0, layout=BatchLayout(2, 8, 0, 2), dataloader_type="cyclic", seed=2
    )
    drawn = list(itertools.islice(iter(fresh), 48))
    for k in (0, 17, 47):
        expected = np.stack([ds[i]["text"] for i in indices[k]])
        assert np.array_equal(drawn[k]["text"].numpy(), expected)
    assert build_pretraining_data_loader(None, 0, layout=BatchLayout(1, 1, 0, 1)) is None


def test_bad_sampler_arguments() -> None:
    ds = MockGPTDataset(10, 4, 20, seed=0)
    layout = BatchLayout(
        micro_batch_size=2, global_batch_size=8, data_parallel_rank=0, data_parallel_size=2
    )
    with pytest.raises(ValueError, match=r"--global-batch-size \(6\) must be a multiple"):
        build_pretraining_data_loader(
            ds, 0, layout=dataclasses.replace(layout, global_batch_size=6)
        )
    with pytest.raises(ValueError, match=r"consumed_samples \(10\) must be in \[0, 10\)"):
        build_pretraining_data_loader(ds, 10, layout=layout)
    with pytest.raises(ValueError, match="--dataloader-type 'random' is not supported"):
        build_pretraining_data_loader(ds, 0, layout=layout, dataloader_type="random")
    with pytest.raises(
        ValueError, match=r"data_parallel_rank \(2\) must be in \[0, data_parallel_size=2\)"
    ):
        MegatronPretrainingSampler(10, 0, 1, 2, 2)
    with pytest.raises(ValueError, match="no samples to consume"):
        MegatronPretrainingSampler(0, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="smaller than one global batch"):
        MegatronPretrainingRandomSampler(ds, 10, 0, 2, 0, 2, order=EpochOrder(global_batch_size=16))
    sampler = MegatronPretrainingRandomSampler(
        ds, 10, 2, 2, 0, 2, order=EpochOrder(global_batch_size=8)
    )
    with pytest.raises(
        ValueError, match=r"consumed_samples \(2\) is not a whole number of micro-steps"
    ):
        next(iter(sampler))
