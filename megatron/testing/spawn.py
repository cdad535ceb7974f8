"""``run_distributed``: the test suite's name for :func:`megatron.launch.spawn.spawn_local_ranks`.

A failing rank is re-raised as :class:`DistributedTestError` (a ``LocalRanksError``) with its traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron.launch.rendezvous import find_free_port
from megatron.launch.spawn import LocalRanksError, spawn_local_ranks

__all__ = ["DistributedTestError", "find_free_port", "run_distributed"]


class DistributedTestError(LocalRanksError):
    """A rank raised, died or timed out inside :func:`run_distributed`."""


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks; see ``spawn_local_ranks`` for the keywords.

    Raises:
        DistributedTestError: with the first failing rank's traceback.
    """
    try:
        return spawn_local_ranks(fn, world_size, *args, **kwargs)
    except LocalRanksError as err:
        raise DistributedTestError(str(err)) from None
