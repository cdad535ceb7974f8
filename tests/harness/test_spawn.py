"""The spawn helper itself: results come back per rank, a failing rank's traceback reaches the parent, hangs time out."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron.testing import DistributedTestError, run_distributed


def _allreduce_rank() -> tuple[int, float, str, str]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item(), os.environ["OMP_NUM_THREADS"], dist.get_backend()


def _fail_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()


def _hang_on_rank_0() -> None:
    if dist.get_rank() == 0:
        time.sleep(120)


def test_results_errors_and_timeouts() -> None:
    results = run_distributed(_allreduce_rank, 2, timeout=60)
    assert results == [(0, 3.0, "1", "gloo"), (1, 3.0, "1", "gloo")]
    with pytest.raises(
        DistributedTestError, match=r"(?s)rank 1 of 2 failed.*ValueError: boom from rank one"
    ):
        run_distributed(_fail_on_rank_1, 2, timeout=60)
    # Rank 0 hangs; on a loaded machine rank 1 may still be starting when the deadline passes.
    with pytest.raises(
        DistributedTestError, match=r"timed out after 8 s; ranks still running: \[0(, 1)?\]"
    ):
        run_distributed(_hang_on_rank_0, 2, timeout=8)


def _takes_big_argument(blob: bytes) -> int:
    return len(blob)


def test_large_arguments_and_unpicklable_functions_fail_cleanly() -> None:
    # Arguments far beyond a pipe buffer reach every rank; a function the children cannot import is reported
    # as a rank failure within the timeout instead of blocking the parent.
    assert run_distributed(_takes_big_argument, 2, b"x" * (4 << 20), timeout=60) == [
        4 << 20,
        4 << 20,
    ]
    import types

    module = types.ModuleType("trident_module_only_in_the_parent")
    exec("def f():\n    return 1\n", module.__dict__)
    module.f.__module__ = module.__name__
    import sys

    sys.modules[module.__name__] = module
    try:
        with pytest.raises(
            DistributedTestError, match="No module named 'trident_module_only_in_the_parent'"
        ):
            run_distributed(module.f, 2, b"y" * (1 << 20), timeout=60)
    finally:
        del sys.modules[module.__name__]
