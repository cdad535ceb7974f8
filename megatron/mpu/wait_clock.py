"""How long this process waits in collectives: the clock of the straggler detector (``training/straggler.py``).

Every collective torch.distributed runs for a caller ends in ``Work.wait()``: the blocking calls
(``all_reduce(t)``, ``send``, ``recv``, ``broadcast``, ...) call it before they return, an ``async_op=True`` caller
calls it on the handle. That covers Trident's own collectives (``mappings.py``) and DeepSpeed's (gradient
all-reduce, ZeRO's reduce-scatter and all-gather, the pipeline's send/recv) in one place, whatever function object
DeepSpeed captured at start-up. While a :class:`WaitClock` runs, ``Work.wait`` is wrapped: the time spent inside it
on the thread that started the clock is added to the clock (other threads, e.g. an async checkpoint writer, are not
counted).

Why waiting names a straggler: in synchronous training every rank's step takes the same wall time, since the
collectives line them up; a slow rank arrives last at each collective and waits least, the others wait for it. So
``step time - wait time`` (the rank's own work) is what differs between a slow rank and its peers.

**CPU (gloo).** The wait blocks the thread and is measured with ``perf_counter``. A second thing is measured: the
time the thread was ready to run but the OS ran something else (the run-queue delay, ``/proc/thread-self/schedstat``
field 2, Linux), outside the waits (read before and after each wait: the wake-up from a wait is waiting, not
work). On a machine with fewer free cores than ranks (a CI machine, a shared node) that time is neither the rank's
work nor slowness of its own: whichever rank the scheduler happened to leave off a core looked slow for an interval.
``Span.descheduled`` carries it, and the detector leaves it out of the rank's own work. A rank slowed on its own
(it computes more, its core is slower, it sleeps, blocks on I/O) still counts. Where the file is missing (not
Linux) the delay reads 0. Cost per wait: two ``perf_counter`` calls and two ``pread`` of the 30-byte file, ~6-9 us
(measured in ``docs/training.md``, "Stragglers").

**CUDA (NCCL).** ``Work.wait()`` only makes the current stream wait for the collective and returns at once, so
host time reads ~0. There the clock records a CUDA event on the current stream before and after each wait: the
stream's idle time between them is the time it waited for the collective; each span (a step) is timed by events
on the same stream, and both are read (one synchronize) when the spans are taken, once per log interval. No
synchronize inside a step, so compute and communication still overlap. Not run on a GPU yet (no GPU here).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_running: list[WaitClock] = []
"""The clocks now running (each counts on its own thread); ``Work.wait`` is wrapped while this is not empty."""
_original_wait: list[Callable[..., Any]] = []
"""``Work.wait`` as torch defines it, while it is wrapped."""
_SCHEDSTAT = "/proc/thread-self/schedstat"
_local = threading.local()
"""Per thread: ``fd``, its open schedstat file (None where there is none)."""


def run_delay() -> float:
    """Seconds the calling thread has spent runnable but not running (Linux run-queue delay); 0.0 elsewhere."""
    fd = getattr(_local, "fd", -1)
    if fd == -1:
        try:
            fd = os.open(_SCHEDSTAT, os.O_RDONLY)
        except OSError:
            fd = None
        _local.fd = fd
    if fd is None:
        return 0.0
    return int(os.pread(fd, 64, 0).split()[1]) * 1e-9


@dataclass(frozen=True)
class Span:
    """One measured span (a training step) of a clock, in seconds."""

    seconds: float
    """Its length (host wall time; on CUDA the current stream's time)."""
    wait: float
    """The part spent waiting in collectives."""
    descheduled: float
    """The part, outside the waits, the thread was ready to run but off a CPU (0 on CUDA)."""

    @property
    def own(self) -> float:
        """The rank's own work: the span less its waits and the time the OS kept it off a CPU."""
        return self.seconds - self.wait - self.descheduled


class _CudaSpan:
    """A span's CUDA events: start, end, and a (before, after) pair per wait; read later."""

    def __init__(self) -> None:
        self.start, self.end = _event(), _event()
        self.waits: list[tuple[Any, Any]] = []

    def read(self) -> Span:
        self.end.synchronize()
        wait = sum(a.elapsed_time(b) for a, b in self.waits)
        return Span(1e-3 * self.start.elapsed_time(self.end), 1e-3 * wait, 0.0)


def _event() -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class WaitClock:
    """Time this thread spent blocked in ``Work.wait()`` while the clock ran, per span.

    Args:
        cuda: time waits and spans with CUDA events on the current stream (NCCL), else host clocks (gloo).
    """

    def __init__(self, *, cuda: bool = False) -> None:
        self.cuda = cuda
        self.seconds = 0.0
        """Host seconds in ``Work.wait`` (CPU; on CUDA ~0, see the module docstring)."""
        self.waits = 0
        self.delay_in_waits = 0.0
        """Run-queue delay inside the waits (host; it belongs to the waiting)."""
        self._thread = threading.get_ident()
        self._spans: list[Span | _CudaSpan] = []
        self._cuda_span: _CudaSpan | None = None

    @contextmanager
    def running(self) -> Iterator[WaitClock]:
        """One span: count this thread's waits while inside (clocks may nest; ``Work.wait`` is restored at the
        end)."""
        self._thread = threading.get_ident()
        wait0, in_waits0, delay0 = self.seconds, self.delay_in_waits, run_delay()
        self._cuda_span = _CudaSpan() if self.cuda else None
        if not _running:
            _wrap_wait()
        _running.append(self)
        start = time.perf_counter()
        try:
            yield self
        finally:
            seconds = time.perf_counter() - start
            _running.remove(self)
            if not _running:
                _unwrap_wait()
            if self._cuda_span is not None:
                self._cuda_span.end.record()
                self._spans.append(self._cuda_span)
            else:
                outside = run_delay() - delay0 - (self.delay_in_waits - in_waits0)
                self._spans.append(Span(seconds, self.seconds - wait0, max(0.0, outside)))

    def take_spans(self) -> list[Span]:
        """The spans completed since the last call (on CUDA this waits for their events)."""
        spans, self._spans = self._spans, []
        return [s.read() if isinstance(s, _CudaSpan) else s for s in spans]

    def _timed_wait(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._cuda_span is not None:
            before = _event()
            try:
                return call(*args, **kwargs)
            finally:
                self._cuda_span.waits.append((before, _event()))
                self.waits += 1
        start, delay = time.perf_counter(), run_delay()
        try:
            return call(*args, **kwargs)
        finally:
            self.delay_in_waits += run_delay() - delay
            self.seconds += time.perf_counter() - start
            self.waits += 1


def _wrap_wait() -> None:
    original = dist.Work.wait
    _original_wait.append(original)

    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        me = threading.get_ident()
        mine = [clock for clock in _running if clock._thread == me]
        if len(mine) == 1:  # the usual case: the training thread's one clock
            return mine[0]._timed_wait(original, work, *args, **kwargs)
        call = functools.partial(original, work, *args, **kwargs)
        for clock in (
            mine
        ):  # clocks nested on one thread: each times the wait (the outer ones a little more)
            call = functools.partial(clock._timed_wait, call)
        return call()

    dist.Work.wait = wait  # type: ignore[method-assign,assignment]


def _unwrap_wait() -> None:
    dist.Work.wait = _original_wait.pop()  # type: ignore[method-assign]
