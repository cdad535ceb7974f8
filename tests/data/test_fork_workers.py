"""Ordered forked workers (``megatron/data/fork_workers.py``): order, errors, dead workers, early stop, no hang.

The stop-on-error stress below hung ``multiprocessing.Pool`` (what preprocessing used before) within 30 rounds: its
``terminate`` kills a worker that is writing a result while holding the shared queue's lock, and then waits for
that lock forever.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from megatron.data.fork_workers import WORKER_NAME, WorkerDied, ordered_map


def _children() -> list[int]:
    """Live (not zombie) worker processes of this process (by name: the suite runs other children meanwhile)."""
    me, alive = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm, rest = stat.read_text().split(" (", 1)[1].rsplit(")", 1)
        except (OSError, IndexError, ValueError):
            continue
        fields = rest.split()
        if comm == WORKER_NAME and int(fields[1]) == me and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


@pytest.mark.timeout(60)
def test_results_in_order_for_any_worker_count_and_big_items() -> None:
    def slow_square(i: int) -> tuple[int, bytes]:
        time.sleep(random.random() * 0.004)  # workers finish out of order
        return i * i, b"y" * (
            300_000 if i % 7 == 0 else 10
        )  # some results larger than a pipe buffer

    items = list(range(120))
    want = [(i * i, b"y" * (300_000 if i % 7 == 0 else 10)) for i in items]
    for workers in (1, 2, 3):
        assert list(ordered_map(slow_square, iter(items), workers)) == want
    big_items = [
        b"z" * 500_000
    ] * 8  # items larger than a pipe buffer, several in flight per worker
    assert list(ordered_map(len, big_items, 2, in_flight=3)) == [500_000] * 8
    assert _children() == []
    with pytest.raises(ValueError, match=r"workers \(0\) must be at least 1"):
        list(ordered_map(len, [], 0))


@pytest.mark.timeout(120)
def test_error_in_a_worker_is_raised_and_every_worker_reaped_without_hanging() -> None:
    def fail_at_40(i: int) -> bytes:
        if i == 40:
            raise KeyError(f"item {i}")
        return b"x" * 4_000_000  # workers are mid-write when the caller stops them

    start = time.monotonic()
    for _ in range(30):
        with pytest.raises(KeyError, match="item 40"):
            for _ in ordered_map(fail_at_40, range(100), 2):
                pass
        assert _children() == []
    assert time.monotonic() - start < 100

    class Unpicklable(Exception):
        def __reduce__(self):  # type: ignore[no-untyped-def]
            raise TypeError("no")

    def raise_unpicklable(i: int) -> int:
        raise Unpicklable("lambda inside")

    with pytest.raises(RuntimeError, match="Unpicklable: lambda inside"):
        list(ordered_map(raise_unpicklable, range(3), 2))


@pytest.mark.timeout(60)
def test_a_killed_worker_is_one_error_and_an_early_stop_reaps_all() -> None:
    def die_at_5(i: int) -> int:
        if i == 5:
            os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
        return i

    got = []
    with pytest.raises(
        WorkerDied, match=r"worker 1 \(pid \d+\) was killed by signal 9 before answering"
    ):
        for v in ordered_map(die_at_5, range(50), 2):
            got.append(v)
    assert got == [0, 1, 2, 3, 4]
    assert _children() == []

    def endless():
        i = 0
        while True:
            yield i
            i += 1

    stream = ordered_map(lambda i: -i, endless(), 3)
    assert [next(stream) for _ in range(4)] == [0, -1, -2, -3]
    assert len(_children()) == 3
    stream.close()
    assert _children() == []
