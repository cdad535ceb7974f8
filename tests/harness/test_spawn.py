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
        time.sleep(60)


def test_results_errors_and_timeouts() -> None:
    results = run_distributed(_allreduce_rank, 2, timeout=60)
    assert results == [(0, 3.0, "1", "gloo"), (1, 3.0, "1", "gloo")]
    with pytest.raises(
        DistributedTestError, match=r"(?s)rank 1 of 2 failed.*ValueError: boom from rank one"
    ):
        run_distributed(_fail_on_rank_1, 2, timeout=60)
    with pytest.raises(
        DistributedTestError, match=r"timed out after 8 s; ranks still running: \[0\]"
    ):
        run_distributed(_hang_on_rank_0, 2, timeout=8)
