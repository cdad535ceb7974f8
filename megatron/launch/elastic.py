"""Restarts in the job under ``torchrun --max-restarts N``: every round of workers gets a fresh store namespace.

Why a restarted round failed before: torchrun's elastic agent hosts one TCPStore for the whole job (the "agent
store": the workers get ``TORCHELASTIC_USE_AGENT_STORE=True`` and the same ``MASTER_ADDR:MASTER_PORT`` in every
round) and torch names the default group's keys ``default_pg/...`` in every round. A round that follows a failure
therefore finds the dead round's keys still there: gloo reads a dead rank's address from them, connects to a port
nobody listens on any more, and fails at start-up ("Gloo connectFullMesh failed ... timed out connecting"); NCCL
would read a stale unique id and hang. The agent's restart counter (``TORCHELASTIC_RESTART_COUNT``) cannot name the
round either: each node's agent counts its own restarts, and an agent that restarts because another node joined
the rendezvous does not count it.

So the ranks agree on a round id through the store itself, then use ``PrefixStore("trident/round/<id>/", store)``
for the default process group (and, through it, every group created later). The id must not be read from a dead
round, so each rank proves that it is alive with a fresh random token::

    rank r > 0                                       rank 0
    ----------                                       ------
    token_r = random                                 round = token_0 (random)
    set  hello/r = token_r                           loop until every rank r > 0 has joined:
    get  welcome/<token_r>   (blocks)  <-----------     read hello/r; on a value not served yet:
                                                          set welcome/<that value> = round
    add  joined/<round> += 1           ----------->     (a dead round's stale token gets a welcome nobody reads)

A key named by a fresh token cannot be stale, so ``welcome/<token_r>`` is this round's id; rank 0 waits for every
rank's ``joined`` count (bounded by --distributed-timeout-minutes) and only then creates its side of the group.
Costs a few store round trips per rank at start-up; the stale keys of dead rounds stay in the agent's store (a few
hundred bytes per rank and round).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger(__name__)

_PREFIX = "trident/"
POLL_S = 0.02
"""How often rank 0 looks for new tokens while the round forms."""


def uses_agent_store(environ: Mapping[str, str] = os.environ) -> bool:
    """True when the workers share the store of torchrun's elastic agent across restarts (torch's default)."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"


def restart_count(environ: Mapping[str, str] = os.environ) -> int:
    """``TORCHELASTIC_RESTART_COUNT`` (0 outside torchrun): how often this node's agent restarted its workers."""
    value = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def _serve_round(store: dist.Store, world_size: int, round_id: str, timeout: timedelta) -> None:
    """Rank 0: welcome every rank's fresh token with ``round_id`` until all ``world_size - 1`` have joined."""
    hello = [f"{_PREFIX}hello/{r}" for r in range(1, world_size)]
    joined = f"{_PREFIX}joined/{round_id}"
    served: dict[int, bytes] = {}
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add(joined, 0) < world_size - 1:
        for r, key in enumerate(hello, start=1):
            if served.get(r) is None and not store.check([key]):
                continue
            token = store.get(key)
            if served.get(r) != token:
                store.set(f"{_PREFIX}welcome/{token.decode()}", round_id)
                served[r] = token
        if time.monotonic() > deadline:
            missing = [r for r in range(1, world_size) if r not in served]
            raise RuntimeError(
                f"torchrun round: {store.add(joined, 0)} of {world_size - 1} ranks joined within "
                f"{timeout.total_seconds():.0f} s (no sign at all of ranks {missing[:16]}); "
                "raise --distributed-timeout-minutes or check the nodes that did not start."
            )
        time.sleep(POLL_S)


def agree_on_round(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """The id every live rank of this round gets (see the module docstring); ``store`` is the agent's store."""
    token = uuid.uuid4().hex
    if rank == 0:
        _serve_round(store, world_size, token, timeout)
        return token
    store.set(f"{_PREFIX}hello/{rank}", token)
    round_id = store.get(f"{_PREFIX}welcome/{token}").decode()  # blocks up to the store's timeout
    store.add(f"{_PREFIX}joined/{round_id}", 1)
    return round_id


FAILURES_KEY = f"{_PREFIX}failures"
"""Lines a dying round leaves in the agent's store for the next round's restart line (why its ranks stopped)."""


def record_failure(text: str, environ: Mapping[str, str] = os.environ) -> None:
    """Under torchrun's agent store: leave one line saying why this rank stops (a survivor's ``lost contact``
    line, the watchdog's) for the next round's restart line. Best effort, at most a few seconds: the agent may be
    gone, and nothing here may keep a failing rank from exiting."""
    if not uses_agent_store(environ):
        return
    try:
        store = dist.TCPStore(
            environ["MASTER_ADDR"],
            int(environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=3),
        )
        store.append(FAILURES_KEY, " ".join(text.split()) + "\n")
    except (RuntimeError, KeyError, ValueError, OSError):
        pass


def _take_failures(store: dist.Store) -> tuple[str, ...]:
    """Rank 0 of a new round: the lines the failed round recorded (then removed)."""
    if not store.check([FAILURES_KEY]):
        return ()
    lines = store.get(FAILURES_KEY).decode(errors="replace").splitlines()
    store.delete_key(FAILURES_KEY)
    return tuple(x for x in lines if x)


def _telling(line: str) -> int:
    """Sort key: a line naming a rank that died first, then the watchdog's, then the rest."""
    if " died with " in line or " exited with code " in line:
        return 0
    return 1 if "watchdog" in line else 2


def failure_summary(lines: tuple[str, ...]) -> str | None:
    """The most telling of a failed round's lines, with how many more there were."""
    if not lines:
        return None
    more = f" (+{len(lines) - 1} more line(s) from other ranks)" if len(lines) > 1 else ""
    return sorted(lines, key=_telling)[0] + more


@dataclass(frozen=True)
class RoundStore:
    """This round's store (the agent's, under the round's prefix), its id, and what the failed round recorded."""

    store: dist.Store
    round_id: str
    failures: tuple[str, ...]
    """Rank 0 only: :data:`FAILURES_KEY`'s lines (empty elsewhere and in the first round)."""


def round_store(timeout: timedelta) -> RoundStore:
    """A store for this round's default group: the agent's store (MASTER_ADDR:MASTER_PORT) under the round's
    prefix, the round id, and (rank 0) the failed round's lines. Call under :func:`uses_agent_store` only, before
    any process group exists."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout,
    )
    start = time.perf_counter()
    round_id = agree_on_round(store, rank, world_size, timeout)
    logger.debug(
        "rank %d: torchrun round %s (restart %d) agreed in %.2f s",
        rank,
        round_id[:8],
        restart_count(),
        time.perf_counter() - start,
    )
    failures = _take_failures(store) if rank == 0 else ()
    return RoundStore(dist.PrefixStore(f"{_PREFIX}round/{round_id}/", store), round_id, failures)


def max_restarts(environ: Mapping[str, str] = os.environ) -> int:
    """``TORCHELASTIC_MAX_RESTARTS`` (0 outside torchrun): torchrun's restart budget."""
    value = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    return int(value) if value.isdigit() else 0


def restart_report(
    resumed_from: int, previous: tuple[int, float] | None, failures: tuple[str, ...] = ()
) -> str | None:
    """The line a restarted torchrun round logs (rank 0), or None in the first round: the restart and the budget,
    the iteration it resumes from, the iterations lost and the time since the failed round's last logged iteration
    (``previous``: ``supervisor.last_logged_iteration`` of the metrics file), and the cause (``failures``: what the
    failed round's ranks recorded, :func:`record_failure`; torchrun's own report names a rank killed before it
    could record anything)."""
    count = restart_count()
    if count == 0:
        return None
    line = f"torchrun restart {count} of {max_restarts()}: resuming from iteration {resumed_from} (`latest`)"
    if previous is None:
        line += "; iterations lost: unknown (no --metrics-file rows of the failed round)"
    else:
        reached, logged_at = previous
        line += (
            f"; the failed round logged iteration {reached}: {max(reached - resumed_from, 0)} iteration(s) "
            f"lost; {time.time() - logged_at:.1f} s since that iteration"
        )
    cause = failure_summary(failures) or "see torchrun's report of the failed rank above"
    return f"{line}; cause: {cause}"
