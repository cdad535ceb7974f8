"""Hang watchdog: a rank whose training step (or checkpoint save) runs past a limit dumps its stack and exits.

A hung collective (a peer died, a NIC flapped, one rank took another branch) otherwise blocks until NCCL's or gloo's
timeout (--distributed-timeout-minutes, default 10) and then dies with an error that does not say where
each rank was. With ``--hang-timeout-minutes M`` (or ``--hang-timeout-factor F``) every rank runs one daemon thread:

    main thread   |-- arm(step 41) --- train step --- disarm --|-- eval (not watched) --|-- arm(step 42) ---- ...
    watchdog      waits until the deadline of the armed region; on time out, in THIS rank, without any collective:
                    1. one ERROR line: rank, iteration, seconds waited, the collective in flight, what to do
                    2. faulthandler.dump_traceback(all_threads=True) to stderr (the log)
                    3. os._exit(EXIT_HANG)

No collective is needed to dump: the ranks blocked in a collective time out on their own, as does the rank that
made them wait (its step is just as late), so every rank of the job leaves its stack in its log and exits with
:data:`~megatron.launch.exit_codes.EXIT_HANG`. The collective in flight is read from the stack of the main
thread (the innermost ``torch.distributed`` function and the first caller outside the communication modules), so
it also names DeepSpeed's own collectives (ZeRO, pipeline p2p) at no cost to the collectives themselves.

The limit of a training step is ``M`` minutes, or ``F`` x the median of the steps so far once
:data:`MIN_HISTORY` steps are done (the larger of the two when both are given: ``M`` then acts as a floor, so a
tiny median cannot turn noise into a kill). A checkpoint save is watched with ``M`` alone (saves are not steps).
With neither flag there is no thread and :meth:`HangWatchdog.watch` is a no-op context.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TextIO

from megatron.launch.elastic import record_failure
from megatron.launch.exit_codes import EXIT_HANG

logger = logging.getLogger(__name__)

MIN_HISTORY = 5
"""Training steps timed before ``--hang-timeout-factor`` applies (the first steps warm up: allocation, JIT)."""

_HISTORY = 100
"""Step durations kept for the median."""

_COMM_MODULES = (
    "torch.distributed",
    "deepspeed.comm",
    "megatron.mpu.mappings",
    "deepspeed.runtime.pipe.p2p",
)
"""Modules whose frames are communication, not the caller of it."""


def step_limit(
    durations: list[float], *, minutes: float | None, factor: float | None
) -> float | None:
    """Seconds a training step may take given the durations of the steps so far; None: not watched."""
    limit = minutes * 60.0 if minutes else None
    if factor and len(durations) >= MIN_HISTORY:
        by_median = factor * statistics.median(durations)
        limit = by_median if limit is None else max(limit, by_median)
    return limit


def collective_in_flight(frame: FrameType | None) -> str | None:
    """The collective ``frame``'s stack is inside, and its first caller outside the communication modules.

    Returns e.g. ``"all_reduce (torch.distributed), called from megatron/training/loop.py:157 in _any_rank"``, or
    None when the stack is in no ``torch.distributed`` function.
    """
    stack: list[FrameType] = []
    while frame is not None:  # innermost first
        stack.append(frame)
        frame = frame.f_back
    name = None
    caller = None
    for f in stack:
        module = str(f.f_globals.get("__name__", ""))
        func = f.f_code.co_name
        if name is None:
            public = not func.startswith("_") and func not in ("wrapper", "wait")
            if module.startswith("torch.distributed") and public:
                name = func
            continue
        if not module.startswith(_COMM_MODULES):
            caller = f
            break
    if name is None:
        return None
    if caller is None:
        return f"{name} (torch.distributed)"
    where = f"{_short_path(caller.f_code.co_filename)}:{caller.f_lineno} in {caller.f_code.co_name}"
    return f"{name} (torch.distributed), called from {where}"


def _short_path(path: str) -> str:
    for marker in ("/megatron/", "/deepspeed/", "/torch/"):
        if marker in path:
            return marker.strip("/") + "/" + path.split(marker, 1)[1]
    return path


class HangWatchdog:
    """This rank's watchdog thread (see the module docstring); a no-op when both limits are off.

    Args:
        minutes: --hang-timeout-minutes (None or 0: no fixed limit).
        factor: --hang-timeout-factor (None or 0: no limit from the median).
        rank: the global rank named in the report.
        stream: where the stacks go (default: ``sys.stderr``, the log); must have a file descriptor.
        exit_fn: ends the process (tests pass a recorder); default ``os._exit``, which does not wait for the
            hung main thread.
    """

    def __init__(
        self,
        *,
        minutes: float | None,
        factor: float | None,
        rank: int,
        stream: TextIO | None = None,
        exit_fn: Callable[[int], None] = os._exit,
    ) -> None:
        self.minutes = minutes or None
        self.factor = factor or None
        self.rank = rank
        self.stream = stream
        self.exit_fn = exit_fn
        self.durations: deque[float] = deque(maxlen=_HISTORY)
        self._cond = threading.Condition()
        self._armed: tuple[str, int, float, float] | None = None  # what, iteration, start, limit
        self._closed = False
        # The thread that trains: its stack names the collective in flight.
        self._main = threading.get_ident()
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._thread = threading.Thread(
                target=self._run, name="trident-hang-watchdog", daemon=True
            )
            self._thread.start()

    @property
    def enabled(self) -> bool:
        """Either limit is on."""
        return bool(self.minutes or self.factor)

    @contextlib.contextmanager
    def watch(self, what: str, iteration: int) -> Iterator[None]:
        """Watch the ``with`` body: ``what`` is ``"train step"`` (timed, limit from both flags) or anything else
        (a checkpoint save: the fixed limit only). ``iteration`` is the one being run (named in the report)."""
        if not self.enabled:
            yield
            return
        step = what == "train step"
        limit = (
            step_limit(list(self.durations), minutes=self.minutes, factor=self.factor)
            if step
            else (self.minutes * 60.0 if self.minutes else None)
        )
        start = time.monotonic()
        if limit is not None:
            with self._cond:
                self._armed = (what, iteration, start, limit)
                self._cond.notify()
        try:
            yield
        finally:
            if limit is not None:
                with self._cond:
                    self._armed = None
                    self._cond.notify()
            if step:
                self.durations.append(time.monotonic() - start)

    def close(self) -> None:
        """Stop the thread (end of the run); idempotent."""
        with self._cond:
            self._closed = True
            self._armed = None
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                armed = self._armed
                if armed is None:
                    self._cond.wait()
                    continue
                left = armed[2] + armed[3] - time.monotonic()
                if left > 0:
                    self._cond.wait(timeout=left)
                    continue
                self._fire(*armed)
                return

    def _fire(self, what: str, iteration: int, start: float, limit: float) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        waited = time.monotonic() - start
        frame = sys._current_frames().get(self._main)
        flight = collective_in_flight(frame) or "none (not inside a torch.distributed call)"
        logger.error(
            "hang watchdog: rank %d, iteration %d: the %s has run %.1f s, past its limit of %.1f s; collective in "
            "flight: %s. Dumping this rank's stacks and exiting with code %d. Compare the ranks' stacks (the ones "
            "not in the same collective are the cause); raise --hang-timeout-minutes / --hang-timeout-factor if "
            "the step is merely slow.",
            self.rank,
            iteration,
            what,
            waited,
            limit,
            flight,
            EXIT_HANG,
        )
        record_failure(
            f"hang watchdog: rank {self.rank}, iteration {iteration}: the {what} ran past its limit of "
            f"{limit:.1f} s; collective in flight: {flight}"
        )
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except (OSError, ValueError):  # a handler whose stream is closed must not stop the dump
                pass
        stream.write(f"--- hang watchdog: stacks of rank {self.rank} (iteration {iteration}) ---\n")
        stream.flush()
        try:
            faulthandler.dump_traceback(file=stream, all_threads=True)
        except (AttributeError, OSError, ValueError):  # a stream with no file descriptor (captured)
            for ident, frame_of_thread in sys._current_frames().items():
                stream.write(f"Thread {ident:#x} (most recent call first):\n")
                stream.writelines(reversed(traceback.format_stack(frame_of_thread)))
        stream.write(f"--- end of the stacks of rank {self.rank} ---\n")
        stream.flush()
        self.exit_fn(EXIT_HANG)
