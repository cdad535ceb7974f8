"""Rank-grid math (pure, one process), validation messages, and the DeepSpeed ``mpu`` interface."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron import mpu
from megatron.mpu import parallel_state


def test_rank_grid_world16_tp2_pp4_equals_the_documented_groups() -> None:
    grid = mpu.rank_grid(16, 2, 4)
    assert grid.data_parallel_size == 2
    assert grid.tensor_model_parallel == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
        [8, 9],
        [10, 11],
        [12, 13],
        [14, 15],
    ]
    assert grid.data_parallel == [
        [0, 2],
        [1, 3],
        [4, 6],
        [5, 7],
        [8, 10],
        [9, 11],
        [12, 14],
        [13, 15],
    ]
    assert grid.pipeline_model_parallel == [
        [0, 4, 8, 12],
        [1, 5, 9, 13],
        [2, 6, 10, 14],
        [3, 7, 11, 15],
    ]
    assert grid.model_parallel == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert grid.embedding == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert grid.position_embedding == [[0], [1], [2], [3]]
    assert grid.sequence_parallel == [[r] for r in range(16)]
    # the module docstring shows the same lists (keep it in sync)
    doc = parallel_state.__doc__
    for line in ("[0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]",
                 "[0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]",
                 "[0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]",
                 "[0,1,4,5,8,9,12,13] [2,3,6,7,10,11,14,15]",
                 "[0,12] [1,13] [2,14] [3,15]"):  # fmt: skip
        assert line in doc


def test_rank_formula_matches_deepspeed_topology() -> None:
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    for world, tp, pp in ((16, 2, 4), (8, 2, 2), (8, 4, 1), (6, 1, 3), (12, 3, 2)):
        grid = mpu.rank_grid(world, tp, pp)
        dp = grid.data_parallel_size
        topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
        for rank in range(world):
            coord = topo.get_coord(rank)
            assert rank == coord.pipe * dp * tp + coord.data * tp + coord.model
            assert grid.group_of("tensor_model_parallel", rank).index(rank) == coord.model
            assert grid.group_of("data_parallel", rank).index(rank) == coord.data
            assert grid.group_of("pipeline_model_parallel", rank).index(rank) == coord.pipe
        assert sorted(map(sorted, topo.get_axis_comm_lists("model"))) == sorted(
            grid.tensor_model_parallel
        )
        assert sorted(map(sorted, topo.get_axis_comm_lists("data"))) == sorted(grid.data_parallel)
        assert sorted(map(sorted, topo.get_axis_comm_lists("pipe"))) == sorted(
            grid.pipeline_model_parallel
        )


def test_rank_grid_pp1_embedding_groups_are_single_ranks() -> None:
    grid = mpu.rank_grid(4, 2, 1)
    assert grid.pipeline_model_parallel == [[0], [1], [2], [3]]
    assert grid.embedding == [[0], [1], [2], [3]]
    assert grid.data_parallel == [[0, 2], [1, 3]]
    assert grid.model_parallel == [[0, 1], [2, 3]]


def test_impossible_degrees_are_rejected_with_every_value() -> None:
    with pytest.raises(
        ValueError,
        match=r"world size 16, --tensor-model-parallel-size 3, --pipeline-model-parallel-size 2\): the world "
        r"size must be divisible by tensor x pipeline = 6 .* divisors of 16: 1, 2, 4, 8, 16",
    ):
        mpu.rank_grid(16, 3, 2)
    with pytest.raises(
        ValueError,
        match=r"world size 4, .*: the world size must be divisible by tensor x pipeline = 8",
    ):
        mpu.validate_degrees(4, 4, 2)
    with pytest.raises(ValueError, match="the tensor size must be a positive integer"):
        mpu.validate_degrees(4, 0, 1)
    with pytest.raises(ValueError, match="the pipeline size must be a positive integer"):
        mpu.validate_degrees(4, 1, -2)
    with pytest.raises(ValueError, match="the tensor size must be a positive integer"):
        mpu.validate_degrees(4, True, 1)  # type: ignore[arg-type]


def test_uninitialized_state_errors() -> None:
    assert not mpu.model_parallel_is_initialized()
    for getter in (
        mpu.get_tensor_model_parallel_rank,
        mpu.get_data_parallel_group,
        mpu.is_pipeline_first_stage,
    ):
        with pytest.raises(
            RuntimeError, match="model parallel is not initialized; call initialize_model_parallel"
        ):
            getter()
    with pytest.raises(
        RuntimeError, match="needs torch.distributed; call torch.distributed.init_process_group"
    ):
        mpu.initialize_model_parallel(1, 1)
    assert mpu.resolve_group(None) is None  # a world of 1 without torch.distributed


def _deepspeed_mpu_calls() -> set[str]:
    import deepspeed

    names: set[str] = set()
    for path in Path(deepspeed.__file__).parent.rglob("*.py"):
        names.update(
            re.findall(
                r"mpu\.(get_\w+|is_\w+)\(", path.read_text(encoding="utf-8", errors="ignore")
            )
        )
    return names


def test_every_mpu_method_deepspeed_calls_exists_on_module_and_state() -> None:
    called = _deepspeed_mpu_calls()
    assert {
        "get_data_parallel_group",
        "get_model_parallel_rank",
        "get_tensor_model_parallel_group",
    } <= called
    missing_module = sorted(n for n in called if not hasattr(mpu, n))
    missing_state = sorted(n for n in called if not hasattr(mpu.ParallelState, n))
    assert not missing_module, missing_module
    assert not missing_state, missing_state
    # DeepSpeed treats an mpu with initialize_sequence_parallel as its own Ulysses mpu: we must not have it
    assert not hasattr(mpu, "initialize_sequence_parallel")
    assert not hasattr(mpu.ParallelState, "initialize_sequence_parallel")
