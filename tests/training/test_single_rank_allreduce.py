"""ZeRO-0's gradient all-reduce is skipped where it reduces over one rank (``skip_single_rank_allreduce``): the
same losses and grad norms, bit for bit, as with DeepSpeed's all-reduce; kept at ZeRO-1, at DP = 2 and for MoE at
TP = 2 x DP = 1 (the expert gradients are reduced over the TP ranks' expert-data-parallel group there).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from megatron.testing import run_distributed


def _flags(zero_stage: int, global_batch: int) -> list[str]:
    return [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--mock-data", "--vocab-size", "200",
        "--micro-batch-size", "2", "--global-batch-size", str(global_batch), "--train-iters", "4",
        "--lr", "3e-3", "--clip-grad", "1.0", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--zero-stage", str(zero_stage), "--eval-iters", "0", "--log-level", "WARNING",
    ]  # fmt: skip


def _train(argv: list[str], *, skip: bool = True) -> dict[str, Any]:
    from megatron.config import parse_args
    from megatron.training import model_setup, pretrain

    pretrain_module = sys.modules["megatron.training.pretrain"]
    build_engine, skipper = pretrain_module.build_engine, model_setup.skip_single_rank_allreduce
    seen: dict[str, Any] = {}

    def recording_engine(*args: Any, **kwargs: Any) -> Any:
        bundle = build_engine(*args, **kwargs)
        seen["allreduce"] = bundle.engine.enable_backward_allreduce
        return bundle

    pretrain_module.build_engine = recording_engine
    if not skip:
        model_setup.skip_single_rank_allreduce = lambda engine: False
    try:
        result = pretrain(parse_args(argv))
    finally:
        pretrain_module.build_engine = build_engine
        model_setup.skip_single_rank_allreduce = skipper
    assert result.exit_code == 0
    return {**seen, "losses": result.losses, "norms": result.grad_norms}


def _one_rank() -> dict[str, Any]:
    return {
        "skipped": _train(_flags(0, 4)),
        "kept": _train(_flags(0, 4), skip=False),
        "zero1": _train(_flags(1, 4)),
    }


def _two_ranks() -> dict[str, Any]:
    tp2 = ["--tensor-model-parallel-size", "2", "--global-batch-size", "2"]
    moe = ["--num-experts", "2", "--expert-interval", "1", "--disable-moe-token-dropping"]
    return {
        "dp2": _train(_flags(0, 4)),
        "tp2": _train([*_flags(0, 2), *tp2]),
        "tp2_moe": _train([*_flags(0, 2), *tp2, *moe]),
    }


@pytest.mark.slow
def test_single_rank_allreduce_skipped_with_identical_numbers() -> None:
    runs = run_distributed(_one_rank, 1, init_process_group=False, timeout=300)[0]
    assert runs["skipped"]["allreduce"] is False
    assert runs["kept"]["allreduce"] is True
    assert runs["zero1"]["allreduce"] is True  # ZeRO's reduce also fills its partitions
    assert (
        runs["skipped"]["losses"] == runs["kept"]["losses"]
    )  # bitwise: the all-reduce over one was identity
    assert runs["skipped"]["norms"] == runs["kept"]["norms"]
    assert all(n is not None for n in runs["skipped"]["norms"])
    two = run_distributed(_two_ranks, 2, init_process_group=False, timeout=300)
    for rank in two:
        assert rank["dp2"]["allreduce"] is True
        assert rank["tp2"]["allreduce"] is False  # DP 1: skipped with TP too
        assert rank["tp2_moe"]["allreduce"] is True  # the expert gradients need it
        assert rank["dp2"]["losses"] == two[0]["dp2"]["losses"]
