"""mpu on real gloo process groups: every layer and mapping against the single-process reference at TP 2 and 4,
shards against the TP=1 weight, groups and getters, RNG streams, checkpointing, broadcast_data, DeepSpeed ``mpu=``.

One spawn per world size; each worker checks many things (spawning costs ~5 s at 2 ranks, ~10 s at 4).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron import mpu
from megatron.mpu.context import TPSettings
from megatron.mpu.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightInit,
)
from megatron.testing import mpu_oracle, run_distributed
from tools import mpu_selfcheck


def _assert_matches_reference(group: dist.ProcessGroup, world: int) -> int:
    """Every comparison of the self-check: bit-identical where the same operations run on the same numbers,
    else (a sum over ranks, a matrix product of another shape) <= RTOL."""
    comps = mpu_oracle.all_comparisons(group)
    by_key = {(c.check, c.quantity): c for c in comps}
    for c in comps:
        if c.exact:
            assert torch.equal(c.actual, c.expected), (c.check, c.quantity, c.error())
        else:
            # the same terms summed in another order: a few fp32 roundings, far below 1e-6 of the largest value
            assert c.error() <= mpu_oracle.RTOL, (c.check, c.quantity, c.error())
    # the pairs that must be exact are exact (a sanity check on the shared table itself)
    for key in [
        ("ColumnParallelLinear", "init == master"),
        ("RowParallelLinear(input_is_parallel=True)", "init == master"),
        ("RowParallelLinear(input_is_parallel=True)", "bias grad"),
        ("VocabParallelEmbedding(padded)", "output"),
        ("VocabParallelEmbedding(padded)", "weight grad"),
        ("gather_from_tensor_model_parallel_region", "forward"),
        ("reduce_scatter_to_sequence_parallel_region", "backward"),
    ]:
        assert by_key[key].exact, key
    # and the reductions really were across ranks: the reduced pairs are tolerance pairs at this TP size
    assert not by_key[("RowParallelLinear(input_is_parallel=True)", "output")].exact
    assert not by_key[("ColumnParallelLinear(sequence_parallel=True)", "input grad")].exact
    # and a rank's slice of a matrix product is a tolerance pair (CPU BLAS blocking depends on the shape)
    assert not by_key[("RowParallelLinear(input_is_parallel=True)", "weight grad")].exact
    return len(comps)


def _check_shards_are_slices_of_the_tp1_weight(
    group: dist.ProcessGroup, solo: dist.ProcessGroup
) -> None:
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    # Column, stride 2: the 24 rows form 2p chunks of 24/(2p); rank r keeps chunks r and r + p.
    full = ColumnParallelLinear(
        16, 24, stride=2, init=WeightInit(seed=77), tp=TPSettings(group=solo)
    ).weight.detach()
    part = ColumnParallelLinear(
        16, 24, stride=2, init=WeightInit(seed=77), tp=TPSettings(group=group)
    ).weight.detach()
    c = 24 // (2 * p)
    assert torch.equal(
        part,
        torch.cat([full[rank * c : (rank + 1) * c], full[(rank + p) * c : (rank + p + 1) * c]]),
    )
    # Row: columns [r*h/p, (r+1)*h/p)
    full = RowParallelLinear(
        24, 16, init=WeightInit(seed=78), tp=TPSettings(group=solo)
    ).weight.detach()
    part = RowParallelLinear(
        24, 16, init=WeightInit(seed=78), tp=TPSettings(group=group)
    ).weight.detach()
    assert torch.equal(part, full[:, rank * 24 // p : (rank + 1) * 24 // p])
    # Embedding with padding rows: rows [r*v/p, (r+1)*v/p); rows >= 29 are zero
    full = VocabParallelEmbedding(
        32, 8, true_vocab_size=29, init=WeightInit(seed=79), tp=TPSettings(group=solo)
    ).weight.detach()
    part = VocabParallelEmbedding(
        32, 8, true_vocab_size=29, init=WeightInit(seed=79), tp=TPSettings(group=group)
    ).weight.detach()
    assert torch.equal(part, full[rank * 32 // p : (rank + 1) * 32 // p])
    assert torch.equal(full[29:], torch.zeros(3, 8)) and bool((full[:29] != 0).any(dim=1).all())


def _check_validation_in_groups(group: dist.ProcessGroup) -> None:
    p = dist.get_world_size(group)
    with pytest.raises(
        ValueError,
        match=rf"output_size \(6\) must be a positive multiple of the tensor-model-parallel size \({p}\) x stride \(2\)",
    ):
        ColumnParallelLinear(16, 6, stride=2, init=WeightInit(seed=1), tp=TPSettings(group=group))
    with pytest.raises(
        ValueError,
        match=rf"input_size \({p + 1}\) must be a positive multiple of the tensor-model-parallel size \({p}\);",
    ):
        RowParallelLinear(p + 1, 8, init=WeightInit(seed=1), tp=TPSettings(group=group))
    emb = VocabParallelEmbedding(
        32, 8, true_vocab_size=29, init=WeightInit(seed=1), tp=TPSettings(group=group)
    )
    with pytest.raises(
        ValueError, match=r"token id 29 at index \[0, 1\] is outside the vocabulary \[0, 29\)"
    ):
        emb(
            torch.tensor([[3, 29]])
        )  # every TP rank raises (same ids), so none hangs in the all-reduce
    with pytest.raises(
        ValueError,
        match=rf"dimension -1 of a tensor of shape \(2, {p + 1}\) is not divisible by the tensor-model-parallel size {p}",
    ):
        mpu.scatter_to_tensor_model_parallel_region(torch.zeros(2, p + 1), group)
    with pytest.raises(ValueError, match="needs a tensor as first argument"):
        mpu.checkpoint(lambda a: a, True, None)
    with pytest.raises(
        ValueError,
        match=rf"split along the sequence dimension: dimension 0 of a tensor of shape \({p + 1}, 2\)",
    ):
        mpu.scatter_to_sequence_parallel_region(torch.zeros(p + 1, 2), group)
    with pytest.raises(
        ValueError,
        match=rf"reduce-scatter along the sequence dimension: dimension 0 .* size {p}; pad the sequence",
    ):
        mpu.reduce_scatter_to_sequence_parallel_region(torch.zeros(p + 1, 2), group)


def _check_sequence_parallel_column_keeps_only_the_local_input(group: dist.ProcessGroup) -> None:
    p = dist.get_world_size(group)
    layer = ColumnParallelLinear(
        16, 24, init=WeightInit(seed=3), tp=TPSettings(sequence_parallel=True, group=group)
    )
    x = torch.randn(8 // p, 2, 16, requires_grad=True)
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = layer(x)  # [s/p, b, h] -> [s, b, o/p]
    assert out.shape == (8, 2, 24 // p)
    assert (8 // p, 2, 16) in saved and (8, 2, 16) not in saved, (
        saved
    )  # the gathered input is not kept


def _block(x: torch.Tensor, col: ColumnParallelLinear, row: RowParallelLinear) -> torch.Tensor:
    with mpu.get_cuda_rng_tracker().fork():
        h = F.dropout(col(x)[0], p=0.5)  # [s, b, o/p]: sharded, forked stream (differs per TP rank)
    return F.dropout(row(h)[0], p=0.5)  # [s, b, h]: replicated, default stream (same on TP ranks)


def _check_rng_and_checkpoint(group: dist.ProcessGroup) -> None:
    rank = dist.get_rank(group)
    mpu.model_parallel_cuda_manual_seed(123)
    with mpu.get_cuda_rng_tracker().fork():
        forked = torch.rand(6)
    replicated = torch.rand(6)
    assert torch.equal(
        forked, torch.rand(6, generator=torch.Generator().manual_seed(123 + 2718 + rank))
    )
    assert torch.equal(replicated, torch.rand(6, generator=torch.Generator().manual_seed(123)))
    everyone = mpu.all_gather_object((forked, replicated), group)
    assert all(torch.equal(r, replicated) for _, r in everyone)
    assert not torch.equal(everyone[0][0], everyone[1][0])

    col = ColumnParallelLinear(8, 16, init=WeightInit(seed=1), tp=TPSettings(group=group))
    row = RowParallelLinear(
        16, 8, input_is_parallel=True, init=WeightInit(seed=2), tp=TPSettings(group=group)
    )
    x0 = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(3))
    runs = []
    for mode in ("plain", "checkpoint", "distributed checkpoint"):
        mpu.model_parallel_cuda_manual_seed(5)
        for prm in (*col.parameters(), *row.parameters()):
            prm.grad = None
        x = x0.clone().requires_grad_()
        if mode == "plain":
            y = _block(x, col, row)
        else:
            y = mpu.checkpoint(_block, mode == "distributed checkpoint", x, col, row)
        (y * torch.arange(y.numel()).view_as(y)).sum().backward()
        runs.append(
            (y.detach(), x.grad, col.weight.grad.clone(), row.weight.grad.clone(), torch.rand(2))
        )
    for plain, ckpt, dckpt in zip(*runs):
        assert torch.equal(plain, ckpt) and torch.equal(plain, dckpt)
    assert (runs[0][0] == 0).any()
    mpu.get_cuda_rng_tracker().reset()


def _check_broadcast_data(group: dist.ProcessGroup) -> None:
    rank = dist.get_rank(group)
    src = {
        "text": torch.arange(12).view(3, 4),
        "mask": torch.tensor([1, 0, 1]),
        "scalar": torch.tensor(7),
    }
    out = mpu.broadcast_data(
        ["text", "mask", "scalar"], src if rank == 0 else None, torch.int64, group
    )
    for key, value in src.items():
        assert torch.equal(out[key], value) and out[key].dtype == torch.int64
    bad = {"text": torch.zeros(2, dtype=torch.int32)}
    if rank == 0:
        with pytest.raises(
            ValueError, match=r"data\['text'\] has dtype torch.int32, expected torch.int64"
        ):
            mpu.broadcast_data(["text"], bad, torch.int64, group)
    else:
        with pytest.raises(RuntimeError, match="TP source rank rejected its data"):
            mpu.broadcast_data(["text"], None, torch.int64, group)


def _check_observe_collectives(group: dist.ProcessGroup, solo: dist.ProcessGroup) -> None:
    """Every collective inside the block is reported once, before it runs, with its op, whole-exchange bytes and
    group, backward's too; a one-rank group and calls after the block report nothing."""
    seen: list[tuple[str, int, dist.ProcessGroup | None]] = []
    x = torch.ones(4, 2, 8)  # [s, b, h] fp32: 256 bytes
    xg = x.clone().requires_grad_()
    with mpu.observe_collectives(lambda op, nbytes, g: seen.append((op, nbytes, g))):
        mpu.reduce_from_tensor_model_parallel_region(x, group)
        mpu.gather_from_tensor_model_parallel_region(x, group)  # [4, 2, 8] -> [4, 2, 16]
        mpu.reduce_scatter_to_sequence_parallel_region(x, group)  # [4, 2, 8] -> [2, 2, 8]
        mpu.gather_from_sequence_parallel_region(xg, group=group).sum().backward()  # [8, 2, 8]
        mpu.all_reduce_sum_(x.clone(), solo)
    mpu.all_reduce_sum_(x.clone(), group)
    assert seen == [
        ("all_reduce", 256, group),
        ("all_gather", 512, group),  # the gathered output
        ("reduce_scatter_tensor", 256, group),  # the input
        ("all_gather_into_tensor", 512, group),
        ("reduce_scatter_tensor", 512, group),  # backward of the gather: its [8, 2, 8] gradient
    ]


def _tp2_worker() -> int:
    state = mpu.initialize_model_parallel(2, 1)
    group = mpu.get_tensor_model_parallel_group()
    rank = dist.get_rank()
    assert state.get_tensor_model_parallel_group() is group
    assert (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()) == (
        rank,
        2,
    )
    assert (mpu.get_data_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size()) == (
        1,
        1,
    )
    assert mpu.get_tensor_model_parallel_src_rank() == 0
    solo = [dist.new_group([r]) for r in range(2)][rank]
    n = _assert_matches_reference(group, 2)
    _check_shards_are_slices_of_the_tp1_weight(group, solo)
    _check_validation_in_groups(group)
    _check_sequence_parallel_column_keeps_only_the_local_input(group)
    _check_rng_and_checkpoint(group)
    _check_broadcast_data(group)
    _check_observe_collectives(group, solo)
    # a replicated parameter is counted on TP rank 0 only; a TP one everywhere
    plain, sharded = torch.zeros(1), ColumnParallelLinear(4, 4, init=WeightInit(seed=1)).weight
    assert mpu.param_is_not_tensor_parallel_duplicate(plain) == (rank == 0)
    assert mpu.param_is_not_tensor_parallel_duplicate(sharded)
    mpu.destroy_model_parallel()
    return n


def test_tp2_layers_mappings_init_rng_checkpoint_broadcast() -> None:
    counts = run_distributed(_tp2_worker, 2, timeout=240)
    assert counts[0] == counts[1] > 60


def _check_world4_tp2_pp2_groups() -> None:
    rank = dist.get_rank()
    state = mpu.initialize_model_parallel(2, 2)
    with pytest.raises(RuntimeError, match="already initialized; call destroy_model_parallel"):
        mpu.initialize_model_parallel(2, 2)
    # rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank with dp = 1: stages {0, 1} and {2, 3}
    tp_rank, pp_rank = rank % 2, rank // 2
    expected = {
        "tensor_model_parallel": [[0, 1], [2, 3]][pp_rank],
        "data_parallel": [rank],
        "pipeline_model_parallel": [[0, 2], [1, 3]][tp_rank],
        "model_parallel": [0, 1, 2, 3],
        "embedding": [[0, 2], [1, 3]][tp_rank],
        "sequence_parallel": [rank],
    }
    for kind, ranks in expected.items():
        assert dist.get_process_group_ranks(state.groups[kind]) == ranks, kind
        total = mpu.all_reduce_sum_(torch.tensor([float(rank)]), state.groups[kind])
        assert float(total) == sum(ranks), (
            kind
        )  # the group is real: a collective sums exactly its members
    assert (mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()) == (
        tp_rank,
        pp_rank,
    )
    assert mpu.get_model_parallel_rank() == tp_rank and mpu.get_model_parallel_world_size() == 2
    assert (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()) == (0, 1)
    assert (
        mpu.get_data_parallel_group_ranks() == [rank] and mpu.get_data_parallel_src_rank() == rank
    )
    assert mpu.get_tensor_model_parallel_src_rank() == 2 * pp_rank
    assert mpu.get_pipeline_model_parallel_first_rank() == tp_rank
    assert mpu.get_pipeline_model_parallel_last_rank() == 2 + tp_rank
    assert (
        mpu.get_pipeline_model_parallel_next_rank()
        == mpu.get_pipeline_model_parallel_prev_rank()
        == (rank + 2) % 4
    )
    assert (mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()) == (
        pp_rank == 0,
        pp_rank == 1,
    )
    assert (
        mpu.is_rank_in_embedding_group() and mpu.get_embedding_group() is state.groups["embedding"]
    )
    if pp_rank == 1:
        with pytest.raises(RuntimeError, match=f"rank {rank} is in no position-embedding group"):
            mpu.get_position_embedding_group()
    assert (mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()) == (1, 0)
    assert mpu.get_sequence_data_parallel_group() is mpu.get_data_parallel_group()
    assert mpu.get_slice_parallel_group() is mpu.get_tensor_model_parallel_group()
    assert mpu.get_pipe_parallel_group() is mpu.get_pipeline_model_parallel_group()
    mpu.destroy_model_parallel()
    assert not mpu.model_parallel_is_initialized()


def _check_deepspeed_uses_our_groups() -> None:
    """DeepSpeed (ZeRO-1, clipping 1.0) with ``mpu=megatron.mpu`` at tp 2, dp 2.

    Grads must be averaged over our DP group only, and the clipping norm must be the norm of the FULL weight
    grad, which DeepSpeed can only get by summing the TP shards' squares over our model-parallel group.
    """
    import deepspeed

    rank = dist.get_rank()
    mpu.initialize_model_parallel(2, 1)  # TP [0,1] [2,3]; DP [0,2] [1,3]
    dp_rank = mpu.get_data_parallel_rank()
    layer = ColumnParallelLinear(8, 8, gather_output=True, bias=False, init=WeightInit(seed=5))
    w0 = mpu.gather_full_parameter(layer.weight)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 2,
           "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}  # fmt: skip
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    engine, *_ = deepspeed.initialize(model=layer, optimizer=opt, config=cfg, mpu=mpu)
    assert (engine.dp_world_size, engine.mp_world_size) == (2, 2), rank
    xs = [torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(40 + d)) for d in range(2)]
    engine.backward((engine(xs[dp_rank])[0] ** 2).sum())
    engine.step()
    grads = [2 * (x.view(3, 8) @ w0.t()).t() @ x.view(3, 8) for x in xs]  # d/dW sum((x W^T)^2)
    average = (grads[0] + grads[1]) / 2
    assert float(average.norm()) > 1.02  # so the clipping acts (scale < 0.98)
    # SGD lr 1 on the DP average clipped to norm 1 (DeepSpeed's clip coefficient is 1 / (norm + 1e-6))
    expected = w0 - average / (float(average.norm()) + 1e-6)
    got = mpu.gather_full_parameter(layer.weight)
    # the DP all-reduce and the norm add terms in their own order: a few roundings, far below 1e-6 relative
    error = float((got - expected).abs().max() / expected.abs().max())
    assert error <= 1e-6, (rank, error)
    mpu.destroy_model_parallel()


def _world4_worker() -> int:
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: (
        None
    )  # skip an unused 30-50 s JIT build
    deepspeed.init_distributed(dist_backend="gloo")
    _check_world4_tp2_pp2_groups()
    mpu.initialize_model_parallel(4, 1)
    group = mpu.get_tensor_model_parallel_group()
    n = _assert_matches_reference(group, 4)
    _check_validation_in_groups(group)
    _check_broadcast_data(group)
    mpu.destroy_model_parallel()
    _check_deepspeed_uses_our_groups()
    return n


def test_world4_groups_tp4_layers_and_deepspeed_mpu() -> None:
    counts = run_distributed(_world4_worker, 4, timeout=300, init_process_group=False)
    assert len(set(counts)) == 1 and counts[0] > 60


def test_selfcheck_cli_passes_at_world_2(caplog: pytest.LogCaptureFixture) -> None:
    assert mpu_selfcheck.main(["--world-size", "2", "--tp", "2", "--pp", "1"]) == 0
    assert (
        "ALL PASS" in caplog.text
        and "RowParallelLinear(input_is_parallel=True, sequence_parallel=True)" in caplog.text
    )
