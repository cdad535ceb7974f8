"""Stragglers named (--log-straggler): which rank is slower than its peers, on which host, by how much.

Every rank times its training steps with a :class:`~megatron.mpu.wait_clock.WaitClock`: their length, the part
spent blocked in collectives and (CPU) the part its thread was ready to run but off a CPU. Its own work in a step
is ``step - wait - off-CPU``: in synchronous training the step times are equal, the slow rank is the one that waits
least (``wait_clock.py``); the off-CPU time is the scheduler's choice on a machine with fewer free cores than
ranks, which otherwise made a random rank look up to 2.5x slower for an interval (``docs/training.md``). Every
--log-interval all ranks all-gather ``[busy, mean step, mean wait, mean off-CPU, pipeline stage, TP rank]`` (6
floats per rank, one collective over the world; ``busy`` is the median own work of the interval's steps) and
every rank runs the same test:

    peers(r)   = r's data-parallel replicas (same pipeline stage and TP rank: the same work); without DP, the
                 ranks of its stage (the same layers; TP rank 0 also loads the batch); alone in its stage, the
                 world (stages differ in work: the threshold must cover that difference)
    slowdown_r = busy_r / median_low(busy of peers(r))
    named      : slowdown_r > --straggler-threshold

``median_low`` (the lower middle value) keeps a 2-rank group honest: the slow rank is compared with the fast one,
not with the mean of both. The first log interval of a run (or of a resumed run) is measured but names no one: its
first steps allocate and warm up unevenly across ranks. The writing rank (global rank 0) logs one warning per interval naming every straggler
(rank, host, slowdown, ms per iteration), writes ``{"iteration", "stragglers": [...]}`` to the metrics JSONL, and
writes ``straggler/max-slowdown`` and ``straggler/slowest-rank`` (every interval) and ``straggler/rank R slowdown``
(named ranks) to TensorBoard.
"""

from __future__ import annotations

import logging
import socket
import statistics
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megatron.mpu.mappings import all_gather_first_dim, all_gather_object
from megatron.mpu.wait_clock import Span, WaitClock
from megatron.training.metrics import MetricsWriter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankTimes:
    """One rank's timings over a log interval, in ms per iteration."""

    busy_ms: float
    """Its own work: the median over the interval's steps of step time less the time waiting in collectives and
    the time kept off a CPU (the median: a step the OS descheduled the rank for does not name it; a rank slow at every step is named)."""
    step_ms: float
    """Its mean step time (wall time)."""
    wait_ms: float
    """Its mean time blocked in collectives."""
    stage: int
    """Its pipeline stage."""
    tp_rank: int = 0
    """Its tensor-parallel rank (TP rank 0 loads the batch its TP group shares)."""
    descheduled_ms: float = 0.0
    """Its mean time ready to run but kept off a CPU by the OS, outside the waits (CPU runs; not own work)."""


@dataclass(frozen=True)
class Straggler:
    """A rank slower than --straggler-threshold x the median of its peers."""

    rank: int
    host: str
    slowdown: float
    """Its busy time over the median of its peers'."""
    busy_ms: float
    """Its own work per iteration (step time less the time waiting in collectives or kept off a CPU)."""
    peers_median_ms: float
    """The median (lower middle) busy time of its peers."""


def _peers(times: list[RankTimes], rank: int) -> list[int]:
    """The ranks doing the same work as ``rank``: its data-parallel replicas, else its pipeline stage, else all."""
    me = times[rank]
    replicas = [r for r, t in enumerate(times) if (t.stage, t.tp_rank) == (me.stage, me.tp_rank)]
    if len(replicas) > 1:
        return replicas
    stage = [r for r, t in enumerate(times) if t.stage == me.stage]
    return stage if len(stage) > 1 else list(range(len(times)))


def slowdowns(times: list[RankTimes]) -> list[float]:
    """Every rank's busy time over the lower median of its peers' (see the module docstring); 1.0 where the
    peers' median is not positive (nothing to compare with)."""
    out = []
    for rank, t in enumerate(times):
        median = statistics.median_low([times[p].busy_ms for p in _peers(times, rank)])
        out.append(t.busy_ms / median if median > 0 else 1.0)
    return out


def find_stragglers(times: list[RankTimes], hosts: list[str], threshold: float) -> list[Straggler]:
    """The ranks whose slowdown exceeds ``threshold``, slowest first."""
    found = []
    for rank, ratio in enumerate(slowdowns(times)):
        if ratio > threshold:
            median = statistics.median_low([times[p].busy_ms for p in _peers(times, rank)])
            found.append(Straggler(rank, hosts[rank], ratio, times[rank].busy_ms, median))
    return sorted(found, key=lambda s: -s.slowdown)


def format_stragglers(iteration: int, found: list[Straggler], threshold: float) -> str:
    """The warning line naming ``found``."""
    named = "; ".join(
        f"rank {s.rank} on {s.host} is {s.slowdown:.2f}x slower than its peers "
        f"({s.busy_ms:.1f} ms of own work per iteration vs a median of {s.peers_median_ms:.1f} ms)"
        for s in found
    )
    return f"straggler at iteration {iteration} (over --straggler-threshold {threshold:g}): {named}"


class StragglerDetector:
    """Times this rank's steps and waits; every log interval gathers all ranks' times and names stragglers.

    Construct it on every rank (the constructor gathers the host names: a collective).

    Args:
        threshold: --straggler-threshold.
        stage: this rank's pipeline stage.
        tp_rank: this rank's tensor-parallel rank.
        device: where the world group's collectives run.
    """

    def __init__(self, threshold: float, *, stage: int, tp_rank: int, device: torch.device) -> None:
        self.threshold, self._device = threshold, device
        self._where = (float(stage), float(tp_rank))
        self.clock = WaitClock(cuda=device.type == "cuda")
        self.hosts: list[str] = all_gather_object(socket.gethostname(), group=dist.group.WORLD)
        self._judge = False
        """False during the run's first log interval (warm-up: allocations, DeepSpeed's first step)."""
        self.last: list[Straggler] = []

    def step(self) -> AbstractContextManager[WaitClock]:
        """Time one training step and the waiting inside it (the wait clock runs only inside a step)."""
        return self.clock.running()

    def gather(self) -> list[RankTimes]:
        """Every rank's times since the last call (one all-gather of 6 floats per rank)."""
        spans = self.clock.take_spans() or [Span(0.0, 0.0, 0.0)]
        n = len(spans)
        mine = torch.tensor(
            [
                statistics.median(s.own for s in spans),
                sum(s.seconds for s in spans) / n,
                sum(s.wait for s in spans) / n,
                sum(s.descheduled for s in spans) / n,
                *self._where,
            ],
            dtype=torch.float64,
            device=self._device,
        )
        rows = all_gather_first_dim(mine.reshape(1, 6), group=dist.group.WORLD)  # [world, 6]
        return [
            RankTimes(
                1000.0 * r[0], 1000.0 * r[1], 1000.0 * r[2], int(r[4]), int(r[5]), 1000.0 * r[3]
            )
            for r in rows.cpu().tolist()
        ]

    def at_log_interval(self, iteration: int, writer: MetricsWriter) -> list[Straggler]:
        """Every rank, at each progress line: gather, test, and (writing rank) report. Returns the stragglers."""
        times = self.gather()
        ratios = slowdowns(times)
        self.last = find_stragglers(times, self.hosts, self.threshold) if self._judge else []
        self._judge = True
        slowest = max(range(len(ratios)), key=lambda r: ratios[r])
        writer.scalar("straggler/max-slowdown", ratios[slowest], iteration)
        writer.scalar("straggler/slowest-rank", float(slowest), iteration)
        if self.last:
            for s in self.last:
                writer.scalar(f"straggler/rank {s.rank} slowdown", s.slowdown, iteration)
            writer.stragglers(iteration, [asdict(s) for s in self.last])
            if writer.enabled:
                logger.warning(format_stragglers(iteration, self.last, self.threshold))
        return self.last
