"""Megatron's named timers: ``timers("forward-backward", log_level=1).start()`` ... ``.stop()``.

``--timing-log-level`` decides which timers exist; asking for a timer above it returns a no-op timer, so a level-0
run pays nothing. The levels and the names (Megatron's, so dashboards carry over):

    level 0   (none here: the iteration time is the progress line's "elapsed time per iteration")
    level 1   forward-backward, optimizer                                   once per iteration
    level 2   batch-generator, forward-compute, backward-compute,           once per micro-batch
              forward-send, forward-recv, backward-send, backward-recv      (pipeline stages only)

Level-1 timers start and stop behind a barrier over all ranks (``--no-barrier-with-level-1-timing`` turns it
off), so they measure the slowest rank's work, not the wait for it.

Every ``--log-interval`` iterations all ranks gather their times (one all-gather through ``mpu.mappings``) and the
logging rank prints one block, per ``--timing-log-option``::

    (min, max) time across ranks (ms):
        forward-backward ...............................: (12.31, 12.87)
        optimizer ......................................: (1.02, 1.10)

``max`` prints the max only, ``all`` every rank's time. Times are per iteration (divided by the iterations of the
interval). A rank that never ran a timer (e.g. ``forward-recv`` on the first stage) is left out of min/max.
``--log-timers-to-tensorboard`` writes the max over ranks, in seconds per iteration, under ``<name>-time`` at every
--tensorboard-log-interval (the running mean of the current log interval), as Megatron does.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from megatron.deepspeed_internals import wrap_pipe_instructions
from megatron.mpu.mappings import all_gather_first_dim, all_reduce_max_, communication_device

TIMERS_TO_LOG: tuple[str, ...] = (
    "forward-backward",
    "forward-compute",
    "backward-compute",
    "batch-generator",
    "forward-recv",
    "forward-send",
    "backward-recv",
    "backward-send",
    "optimizer",
)
"""The timers the progress block and TensorBoard report, in Megatron's order."""

MAX_LOG_LEVEL = 2


class ScalarSink(Protocol):
    """Where :meth:`Timers.write` puts its scalars (``MetricsWriter``)."""

    def scalar(self, tag: str, value: float, step: int) -> None: ...


def _synchronize() -> None:
    """Wait for queued CUDA work so a timer measures it (no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _barrier() -> None:
    """Every rank waits for all others (a one-element all-reduce over the world group)."""
    if dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
        all_reduce_max_(torch.zeros(1, device=communication_device(group)), group=group)


class Timer:
    """Accumulates wall time between ``start`` and ``stop`` until read with ``elapsed(reset=True)``."""

    def __init__(self, name: str, *, barrier: bool = False) -> None:
        self.name = name
        self._barrier = barrier
        self._elapsed = 0.0
        self._started_at: float | None = None

    def start(self) -> None:
        """Start (a barrier first when this is a level-1 timer with barriers on)."""
        if self._started_at is not None:
            raise RuntimeError(f"timer {self.name!r} is already running")
        if self._barrier:
            _barrier()
        _synchronize()
        self._started_at = time.perf_counter()

    def stop(self) -> None:
        """Stop and add the time since :meth:`start`."""
        if self._started_at is None:
            raise RuntimeError(f"timer {self.name!r} is not running")
        if self._barrier:
            _barrier()
        _synchronize()
        self._elapsed += time.perf_counter() - self._started_at
        self._started_at = None

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated so far (a running timer counts up to now and keeps running)."""
        total = self._elapsed
        if self._started_at is not None:
            total += time.perf_counter() - self._started_at
        if reset:
            self._elapsed = 0.0
            if self._started_at is not None:
                self._started_at = time.perf_counter()
        return total


class _NoOpTimer(Timer):
    """What a timer above --timing-log-level is: start/stop do nothing."""

    def __init__(self) -> None:
        super().__init__("no-op")

    def start(self) -> None:
        return

    def stop(self) -> None:
        return


class Timers:
    """The run's timers (owned by the trainer, passed where timing happens).

    Args:
        log_level: --timing-log-level (0, 1 or 2).
        log_option: --timing-log-option.
        barrier_level_1: level-1 timers synchronise all ranks (--no-barrier-with-level-1-timing: False).
    """

    def __init__(
        self,
        log_level: int = 0,
        log_option: Literal["max", "minmax", "all"] = "minmax",
        *,
        barrier_level_1: bool = True,
    ) -> None:
        self.log_level = log_level
        self.log_option = log_option
        self.barrier_level_1 = barrier_level_1
        self._timers: dict[str, Timer] = {}
        self._levels: dict[str, int] = {}
        self._no_op = _NoOpTimer()

    def __call__(self, name: str, log_level: int | None = None) -> Timer:
        """The timer ``name``, created at ``log_level`` (default 2) on first use; a no-op one above
        --timing-log-level. ``log_level`` None on later calls: whatever level it was created at."""
        if name in self._timers:
            if log_level is not None and log_level != self._levels[name]:
                raise RuntimeError(
                    f"timer {name!r} exists at level {self._levels[name]}, asked at {log_level}"
                )
            return self._timers[name]
        if log_level is None:
            log_level = MAX_LOG_LEVEL
        if log_level > self.log_level:
            return self._no_op
        timer = Timer(name, barrier=self.barrier_level_1 and log_level == 1)
        self._timers[name] = timer
        self._levels[name] = log_level
        return timer

    @property
    def names(self) -> list[str]:
        """The timers created so far on this rank."""
        return list(self._timers)

    def _all_ranks(self, names: tuple[str, ...], reset: bool) -> torch.Tensor:
        """[world, len(names)] seconds: row r is rank r's (0 where rank r has no such timer). Every rank calls."""
        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        device = communication_device(group) if group is not None else torch.device("cpu")
        mine = torch.zeros(1, len(names), dtype=torch.float64, device=device)
        for i, name in enumerate(names):
            if name in self._timers:
                mine[0, i] = self._timers[name].elapsed(reset=reset)
        if group is None:
            return mine.cpu()
        return all_gather_first_dim(mine, group=group).cpu()  # [1, n] -> [world, n]

    def min_max(
        self, names: tuple[str, ...] = TIMERS_TO_LOG, *, normalizer: float = 1.0, reset: bool = True
    ) -> dict[str, tuple[float, float]]:
        """name -> (min, max) seconds over the ranks that ran it, divided by ``normalizer``. Every rank calls."""
        if normalizer <= 0:
            raise ValueError(f"timer normalizer must be positive, got {normalizer}")
        table = self._all_ranks(names, reset)
        out: dict[str, tuple[float, float]] = {}
        for i, name in enumerate(names):
            ran = table[:, i][table[:, i] > 0.0]
            if ran.numel():
                out[name] = (ran.min().item() / normalizer, ran.max().item() / normalizer)
        return out

    def log_string(
        self, names: tuple[str, ...] = TIMERS_TO_LOG, *, normalizer: float = 1.0, reset: bool = True
    ) -> str | None:
        """The --timing-log-option block in ms per iteration (None when no timer ran). Every rank calls."""
        if self.log_option == "all":
            table = self._all_ranks(names, reset) * 1000.0 / normalizer
            lines = []
            for i, name in enumerate(names):
                ranks = [(r, t) for r, t in enumerate(table[:, i].tolist()) if t > 0]
                if ranks:
                    lines.append(f"  {name}:")
                    lines += [f"     rank {r:2d}: {t:.2f}" for r, t in ranks]
            return "times across ranks (ms):\n" + "\n".join(lines) if lines else None
        times = self.min_max(names, normalizer=normalizer / 1000.0, reset=reset)
        if not times:
            return None
        rows = []
        for name, (lo, hi) in times.items():
            value = f"{hi:.2f}" if self.log_option == "max" else f"({lo:.2f}, {hi:.2f})"
            rows.append(f"    {(name + ' ').ljust(48, '.')}: {value}")
        return "(min, max) time across ranks (ms):\n" + "\n".join(rows)

    def write(
        self,
        sink: ScalarSink | Any,
        iteration: int,
        names: tuple[str, ...] = TIMERS_TO_LOG,
        *,
        normalizer: float = 1.0,
        reset: bool = False,
    ) -> dict[str, float]:
        """Write the max over ranks (seconds per iteration) as ``<name>-time``; returns them. Every rank calls."""
        maxima = {
            name: hi
            for name, (_, hi) in self.min_max(names, normalizer=normalizer, reset=reset).items()
        }
        for name, value in maxima.items():
            sink.scalar(f"{name}-time", value, iteration)
        return maxima


# --- DeepSpeed's pipeline engine ------------------------------------------------------------------------------


def install_pipe_timers(engine: Any, timers: Timers) -> None:
    """Time the pipeline engine's instructions under Megatron's names (training batches only).

    DeepSpeed's own breakdown (``wall_clock_breakdown``) prints its own lines through its logger at
    ``steps_per_print`` under other names; instead the engine's instruction table is wrapped, per engine (an instance
    attribute shadowing the class table, through ``deepspeed_internals.wrap_pipe_instructions``):

        LoadMicroBatch -> batch-generator     ForwardPass -> forward-compute    BackwardPass -> backward-compute
        SendActivation -> forward-send        RecvActivation -> forward-recv
        SendGrad -> backward-send             RecvGrad -> backward-recv         (all level 2)
        OptimizerStep  -> stops forward-backward (started by the step; so it covers the 1F1B schedule and the
                          gradient reductions, like Megatron-DeepSpeed's engine.backward), then times optimizer (1)
    """
    if timers.log_level == 0:
        return
    from deepspeed.runtime.pipe import schedule

    names = {
        schedule.LoadMicroBatch: "batch-generator",
        schedule.ForwardPass: "forward-compute",
        schedule.BackwardPass: "backward-compute",
        schedule.SendActivation: "forward-send",
        schedule.RecvActivation: "forward-recv",
        schedule.SendGrad: "backward-send",
        schedule.RecvGrad: "backward-recv",
    }

    def timed(fn: Any, instr: type) -> Any:
        def run(self: Any, **kwargs: Any) -> Any:
            if not self.module.training:  # eval_batch: not training time
                return fn(self, **kwargs)
            if instr is schedule.OptimizerStep:
                timers("forward-backward", log_level=1).stop()
                timer = timers("optimizer", log_level=1)
            else:
                timer = timers(names[instr], log_level=2)
            timer.start()
            try:
                return fn(self, **kwargs)
            finally:
                timer.stop()

        return run

    wrap_pipe_instructions(
        engine,
        lambda fn, instr: (
            timed(fn, instr) if instr in names or instr is schedule.OptimizerStep else fn
        ),
    )
