"""Stragglers named (--log-straggler): the test on gathered times, the wait clock, and whole runs with one rank slowed.

How a rank is slowed: on that rank's process only, the step function the trainer calls is wrapped to sleep before
each step from a chosen iteration on. To its peers this is exactly a slower device: it arrives late at every
collective of the step. A CPU quota (cgroups) needs root, and ``nice`` / affinity pinning only slow a rank while
the machine is loaded, which on a CI machine shared with other jobs is luck either way; the sleep is a slowdown
the test controls (its size, its start), so "named within two intervals" and "nothing named" are both checkable.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron.config import parse_args, validate
from megatron.testing import run_distributed
from megatron.training.straggler import RankTimes, find_stragglers, format_stragglers, slowdowns
from tests.training.test_token_schedule import TINY


def _times(busy_ms: list[float], stages: list[int], tp: list[int] | None = None) -> list[RankTimes]:
    """Ranks whose 100 ms steps (the sync makes them equal) held ``busy_ms`` of their own work."""
    tp = tp or [0] * len(busy_ms)
    return [
        RankTimes(b, 100.0, 100.0 - b, s, t) for b, s, t in zip(busy_ms, stages, tp, strict=True)
    ]


def test_find_stragglers_compares_each_rank_with_its_pipeline_stage() -> None:
    hosts = ["a", "a", "b", "b"]
    # TP2 x PP2: stage 1 (ranks 2, 3) does more work than stage 0; rank 3 does 2.2x its TP peer's work
    times = _times([20.0, 21.0, 30.0, 66.0], [0, 0, 1, 1], [0, 1, 0, 1])
    found = find_stragglers(times, hosts, 1.5)
    assert [(s.rank, s.host) for s in found] == [(3, "b")]
    assert found[0].slowdown == pytest.approx(2.2) and found[0].peers_median_ms == pytest.approx(
        30.0
    )
    line = format_stragglers(40, found, 1.5)
    assert "iteration 40" in line and "rank 3 on b is 2.20x slower" in line and "66.0 ms" in line
    # stage differences alone name no one (30 ms vs 20 ms would be 1.5x against the world's median)
    assert (
        find_stragglers(_times([20.0, 21.0, 30.0, 31.0], [0, 0, 1, 1], [0, 1, 0, 1]), hosts, 1.4)
        == []
    )
    # TP2 x DP2: TP rank 0 (ranks 0, 2) also loads the batch: compared with its DP replica, not its TP peer
    assert slowdowns(_times([30.0, 18.0, 31.0, 20.0], [0] * 4, [0, 1, 0, 1])) == pytest.approx(
        [1.0, 1.0, 31 / 30, 20 / 18]
    )
    # PP only (one rank per stage): compared with the world; a 2-rank world with the lower median
    assert slowdowns(_times([10.0, 30.0], [0, 1])) == pytest.approx([1.0, 3.0])
    assert slowdowns(_times([0.0, 0.0], [0, 0])) == [1.0, 1.0]  # nothing to compare with


def test_straggler_flags_are_validated() -> None:
    cfg = parse_args([*TINY, "--log-straggler", "--straggler-threshold", "2.5"])
    assert cfg.logging.log_straggler and cfg.logging.straggler_threshold == 2.5
    assert parse_args([*TINY, "--log-straggler"]).logging.straggler_threshold_or_default == 1.5
    with pytest.raises(ValueError, match=r"--straggler-threshold \(1.0\) must be > 1; e.g. 1.5"):
        validate(parse_args([*TINY, "--log-straggler", "--straggler-threshold", "1"]), world_size=1)
    message = (
        "--straggler-threshold (2) is used only by --log-straggler, which is not given; add --log-straggler "
        "or drop --straggler-threshold."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(parse_args([*TINY, "--straggler-threshold", "2"]), world_size=1)


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.skipif(
    not Path("/proc/thread-self/schedstat").exists(), reason="Linux run-queue delay"
)
def test_time_kept_off_the_cpu_is_not_own_work() -> None:
    """This thread computes 0.1 s of CPU time on one core that a spinning process shares: the span lasts about
    twice that, and the half the OS ran the other process is ``descheduled``, not own work (the old measure, span
    less waits, called it all own work: a rank the scheduler left off a core looked 2x slow)."""
    from megatron.mpu.wait_clock import WaitClock

    cpu = sorted(os.sched_getaffinity(0))[0]
    rival = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})
        time.sleep(0.05)  # the rival is spinning on the core
        clock = WaitClock()
        start = time.thread_time()
        with clock.running():
            _spin(0.1)
        work = time.thread_time() - start
    finally:
        os.sched_setaffinity(0, mine)
        rival.kill()
        rival.wait()
    (span,) = clock.take_spans()
    assert span.seconds > 1.5 * work and span.descheduled > 0.3 * span.seconds, (span, work)
    assert span.own == pytest.approx(work, rel=0.2) and clock.take_spans() == [], (span, work)


class _HostEvent:
    """Stands in for ``torch.cuda.Event`` on CPU: a host timestamp when recorded (a stream with nothing queued
    reaches an event at once), to run the clock's CUDA bookkeeping here."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _HostEvent) -> float:
        return 1e3 * (end.at - self.at)


def _clock_waits(cuda: bool) -> tuple[float, float, int, float]:
    """Rank 1 computes (sleeps) 0.3 s then rank 0 0.2 s, each followed by a collective (sync, then an async
    handle), with another thread's collective in between: (clock seconds, span wait, waits, span seconds)."""
    import threading

    import torch.distributed as dist

    from megatron.mpu import wait_clock

    rank, real_event = dist.get_rank(), torch.cuda.Event
    torch.cuda.Event = _HostEvent  # type: ignore[misc,assignment]
    try:
        clock = wait_clock.WaitClock(cuda=cuda)
        x = torch.ones(4)
        with clock.running():
            time.sleep(0.3 if rank == 1 else 0.0)
            dist.all_reduce(x)  # rank 0 waits ~0.3 s for rank 1
            time.sleep(0.2 if rank == 0 else 0.0)
            handle = dist.all_reduce(x, async_op=True)
            handle.wait()  # an async handle: rank 1 waits ~0.2 s
            other = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1), group=None))
            time.sleep(0.2 if rank == 1 else 0.0)
            other.start()  # another thread's wait (rank 0: ~0.2 s) is not this clock's
            other.join()
        (span,) = clock.take_spans()
    finally:
        torch.cuda.Event = real_event  # type: ignore[misc]
    return clock.seconds, span.wait, clock.waits, span.seconds


def _clock_scenario() -> dict[str, Any]:
    import torch.distributed as dist

    original = dist.Work.wait
    seconds, span_wait, waits, _ = _clock_waits(cuda=False)
    dist.all_reduce(
        torch.ones(4)
    )  # after the clock stopped: not counted, and Work.wait is torch's again
    restored = dist.Work.wait is original
    host_seconds, cuda_wait, cuda_waits, cuda_span = _clock_waits(cuda=True)
    return {"seconds": seconds, "span_wait": span_wait, "waits": waits, "restored": restored,
            "cuda": (host_seconds, cuda_wait, cuda_waits, cuda_span)}  # fmt: skip


def _check_clock(r0: dict[str, Any], r1: dict[str, Any]) -> None:
    assert r0["restored"] and r1["restored"] and r0["waits"] == r1["waits"] == 2
    assert 0.25 < r0["seconds"] < 0.45, r0  # the sync wait only (the other thread's wait excluded)
    assert 0.15 < r1["seconds"] < 0.35, r1  # the async handle's wait only
    assert r0["span_wait"] == r0["seconds"] and r1["span_wait"] == r1["seconds"]
    # CUDA bookkeeping (events around each wait, read when the spans are taken), host events standing in: the
    # same waits, none on the host clock, and the span timed by its events
    for r, low, high in ((r0, 0.25, 0.45), (r1, 0.15, 0.35)):
        host_seconds, wait, waits, span = r["cuda"]
        assert host_seconds == 0.0 and waits == 2 and low < wait < high and span > 0.45, r


def _record_intervals() -> list[dict[str, float]]:
    """Patch the detector (this process) to record, per log interval: its steps' time, their waits, and how long
    the interval's gather and test took."""
    from megatron.training.straggler import StragglerDetector

    seen: list[dict[str, float]] = []
    real = StragglerDetector.at_log_interval

    def at_log_interval(self: StragglerDetector, iteration: int, writer: Any) -> Any:
        spans = self.clock._spans  # this interval's, before the gather takes them
        steps, step_s, waits = len(spans), sum(sp.seconds for sp in spans), self.clock.waits
        start = time.perf_counter()
        out = real(self, iteration, writer)
        seen.append(
            {
                "steps": steps,
                "step_s": step_s,
                "waits": waits,
                "cost_s": time.perf_counter() - start,
            }
        )
        return out

    StragglerDetector.at_log_interval = at_log_interval  # type: ignore[method-assign]
    return seen


def _overhead(seen: list[dict[str, float]]) -> dict[str, float]:
    """The measurement's share of the step time: per-wait and per-step costs timed here (a completed ``Work``
    waited on 20000 times with and without the clock; 20000 empty timed steps), per-interval costs as recorded."""
    import torch.distributed as dist

    from megatron.mpu.wait_clock import WaitClock
    from megatron.training.straggler import StragglerDetector

    n = 20000
    handle = dist.all_reduce(torch.zeros(1), async_op=True)
    handle.wait()
    start = time.perf_counter()
    for _ in range(n):
        handle.wait()
    bare = (time.perf_counter() - start) / n
    with WaitClock().running():
        start = time.perf_counter()
        for _ in range(n):
            handle.wait()
        per_wait = (time.perf_counter() - start) / n - bare
    detector = StragglerDetector(1.5, stage=0, tp_rank=0, device=torch.device("cpu"))
    start = time.perf_counter()
    for _ in range(n):
        with detector.step():
            pass
    per_step = (time.perf_counter() - start) / n
    steps = sum(r["steps"] for r in seen[1:])  # the first interval is warm-up
    step_s = sum(r["step_s"] for r in seen[1:]) / steps
    waits = seen[-1]["waits"] / sum(r["steps"] for r in seen)  # the clock counts over the whole run
    interval_s = sum(r["cost_s"] for r in seen[1:]) / steps
    cost = waits * per_wait + per_step + interval_s
    return {"step_ms": 1e3 * step_s, "waits_per_step": waits, "per_wait_us": 1e6 * per_wait,
            "per_step_us": 1e6 * per_step, "interval_us_per_step": 1e6 * interval_s,
            "fraction": cost / step_s}  # fmt: skip


def _run(tmp: str, flags: list[str], slow: tuple[int, int, float] | None) -> dict[str, Any]:
    """``pretrain`` with --log-straggler; ``slow = (rank, from_iteration, seconds)`` sleeps on that rank; a run
    with no slowdown also measures the overhead."""
    from megatron.training import pretrain, trainer

    rank = int(os.environ["RANK"])
    if slow is not None and slow[0] == rank:
        steps = {"n": 0}
        for name in ("train_step_engine", "train_step_pipe"):
            real = getattr(trainer, name)

            def slowed(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
                steps["n"] += 1
                if steps["n"] >= slow[1]:
                    time.sleep(slow[2])
                return _real(*args, **kwargs)

            setattr(trainer, name, slowed)
    seen = _record_intervals()
    warnings: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("megatron.training.straggler").addHandler(_Keep(level=logging.WARNING))
    argv = [*TINY, "--log-straggler", "--metrics-file", f"{tmp}/m.jsonl", *flags]
    start = time.perf_counter()
    result = pretrain(parse_args([*argv, "--tensorboard-dir", f"{tmp}/tb"]))
    seconds = time.perf_counter() - start
    out = {"exit": result.exit_code, "warnings": warnings, "seconds": seconds}
    if slow is None:
        out["overhead"] = _overhead(seen)
    elif slow[2] >= 0.5:
        out["clock"] = _clock_scenario()  # the same spawn: cheaper than one of its own
    return out


def _named(tmp: Path) -> dict[int, list[int]]:
    """Iteration -> the ranks the metrics file names there."""
    out = {}
    for line in (tmp / "m.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "stragglers" in rec:
            out[rec["iteration"]] = [s["rank"] for s in rec["stragglers"]]
    return out


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_a_slowed_data_parallel_rank_is_named(tmp_path: Path) -> None:
    """DP2 (log interval 2), rank 1 sleeps 0.5 s per step from its 3rd step on: named at iteration 4 in the log,
    the metrics file and TensorBoard; the first interval (warm-up) names no one. 0.5 s: more than any step of
    this tiny model takes even on a loaded machine, so the slowdown exceeds the default threshold (1.5) however
    slow the other rank runs. Then, in the same spawn, the wait clock alone: this thread's sync and async waits
    are counted, another thread's are not, and ``Work.wait`` is torch's again after."""
    flags = ["--train-iters", "4", "--log-interval", "2"]
    r0, r1 = run_distributed(_run, 2, str(tmp_path), flags, (1, 3, 0.5), timeout=180)
    assert r0["exit"] == r1["exit"] == 0
    assert _named(tmp_path) == {4: [1]}
    assert len(r0["warnings"]) == 1 and "straggler at iteration 4" in r0["warnings"][0], r0
    assert "rank 1 on " in r0["warnings"][0] and "x slower than its peers" in r0["warnings"][0]
    tb = _scalars(tmp_path / "tb")
    assert [s for s, _ in tb["straggler/rank 1 slowdown"]] == [4]
    assert tb["straggler/rank 1 slowdown"][0][1] > 1.5
    assert tb["straggler/slowest-rank"][-1] == (4, 1.0) and len(tb["straggler/max-slowdown"]) == 2
    _check_clock(r0["clock"], r1["clock"])


@pytest.mark.slow
def test_tp2_pp2_straggler_named_within_two_intervals_and_none_unslowed(tmp_path: Path) -> None:
    """TP2 x PP2, log interval 5, the default --straggler-threshold (1.5): rank 3 (stage 1) sleeps 0.3 s per step
    from its 13th step: named by the second log boundary after (iteration 15 or 20) and at every boundary from
    there, no one before. Then 100 iterations with no slowdown (log interval 10; 4 ranks on however few cores the
    machine has, shared with other jobs) name no one, and the measurement costs < 1 % of the step time."""
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    slowed = tmp_path / "slowed"
    flags = [*layout, "--train-iters", "30", "--log-interval", "5"]
    res = run_distributed(_run, 4, str(slowed), flags, (3, 13, 0.3), timeout=600)
    assert [r["exit"] for r in res] == [0, 0, 0, 0]
    named = _named(slowed)
    assert named and min(named) <= 20 and all(it > 12 for it in named), named
    assert all(named.get(it) == [3] for it in (20, 25, 30)), named
    quiet = tmp_path / "quiet"
    flags = [*layout, "--train-iters", "100", "--log-interval", "10"]
    res = run_distributed(_run, 4, str(quiet), flags, None, timeout=600)
    assert [r["exit"] for r in res] == [0, 0, 0, 0]
    maxima = [v for _, v in _scalars(quiet / "tb")["straggler/max-slowdown"]]
    assert _named(quiet) == {} and res[0]["warnings"] == [], maxima
    assert len(maxima) == 10, maxima
    overhead = [r["overhead"] for r in res]
    assert all(o["fraction"] < 0.01 for o in overhead), overhead
