"""How long this process waits in collectives: the clock of the straggler detector (``training/straggler.py``).

Every collective torch.distributed runs for a caller ends in ``Work.wait()``: the blocking calls
(``all_reduce(t)``, ``send``, ``recv``, ``broadcast``, ...) call it before they return, an ``async_op=True`` caller
calls it on the handle. That covers Trident's own collectives (``mappings.py``) and DeepSpeed's (gradient
all-reduce, ZeRO's reduce-scatter and all-gather, the pipeline's send/recv) in one place, whatever function object
DeepSpeed captured at start-up. While a :class:`WaitClock` runs, ``Work.wait`` is wrapped: the wall time spent
inside it on the thread that started the clock is added to the clock (other threads, e.g. an async checkpoint
writer, are not counted). Cost: two ``perf_counter`` calls and a thread-id compare per wait, ~2 us (measured in
``docs/training.md``, "Stragglers").

Why waiting names a straggler: in synchronous training every rank's step takes the same wall time, since the
collectives line them up; a slow rank arrives last at each collective and waits least, the others wait for it. So
``step time - wait time`` (the rank's own work) is what differs between a slow rank and its peers.

On CUDA (NCCL) ``Work.wait()`` only makes the current stream wait and returns at once: the clock reads ~0 and the
detector compares step times only, which synchronous training makes equal; naming GPU stragglers needs CUDA events
on the communication stream (not done yet). On CPU (gloo) the wait blocks the thread and is measured exactly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

_running: list[WaitClock] = []
"""The clocks now running (each counts on its own thread); ``Work.wait`` is wrapped while this is not empty."""
_original_wait: list[Callable[..., Any]] = []
"""``Work.wait`` as torch defines it, while it is wrapped."""


class WaitClock:
    """Seconds (and the number of waits) this thread spent blocked in ``Work.wait()`` while the clock ran."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.waits = 0
        self._thread = threading.get_ident()

    @contextmanager
    def running(self) -> Iterator[WaitClock]:
        """Count this thread's waits while inside (clocks may nest; ``Work.wait`` is restored at the end)."""
        self._thread = threading.get_ident()
        if not _running:
            _wrap_wait()
        _running.append(self)
        try:
            yield self
        finally:
            _running.remove(self)
            if not _running:
                _unwrap_wait()


def _wrap_wait() -> None:
    original = dist.Work.wait
    _original_wait.append(original)

    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(work, *args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            me = threading.get_ident()
            for clock in _running:
                if clock._thread == me:
                    clock.seconds += seconds
                    clock.waits += 1

    dist.Work.wait = wait  # type: ignore[method-assign,assignment]


def _unwrap_wait() -> None:
    dist.Work.wait = _original_wait.pop()  # type: ignore[method-assign]
