"""The hang watchdog (issue #17 item 6): limits, the collective named from a stack, and a real 2-rank run in which
one rank sleeps inside a step: every rank dumps its stacks to its log and exits with ``EXIT_HANG``.

The sleeping rank is made by monkeypatching the step function inside that rank's own process (the driver below),
not by mocking torch.distributed: the other rank really blocks in DeepSpeed's gradient all-reduce over gloo.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron.diagnostics.watchdog import (
    MIN_HISTORY,
    HangWatchdog,
    collective_in_flight,
    step_limit,
)
from megatron.launch.exit_codes import EXIT_HANG

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "1", "--global-batch-size", "2", "--mock-data", "--vocab-size", "99",
    "--log-interval", "1", "--eval-iters", "0", "--train-iters", "50",
]  # fmt: skip

# Rank 1 sleeps inside its 3rd training step; pretrain_gpt.py runs otherwise unchanged.
DRIVER = """
import os, sys, time
import pretrain_gpt
from megatron.training import trainer
if os.environ["RANK"] == "1":
    real, calls = trainer.train_step_engine, []
    def sleepy_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            time.sleep(120)
        return real(*args, **kwargs)
    trainer.train_step_engine = sleepy_step
pretrain_gpt.exit_now(pretrain_gpt.main(sys.argv[1:]))
"""


def test_step_limit() -> None:
    assert step_limit([], minutes=None, factor=None) is None
    assert step_limit([1.0] * 10, minutes=0.5, factor=None) == 30.0
    short = [1.0] * (MIN_HISTORY - 1)
    assert step_limit(short, minutes=None, factor=10) is None  # warm-up steps: no median yet
    assert step_limit(short, minutes=1, factor=10) == 60.0
    steps = [1.0, 2.0, 2.0, 3.0, 100.0]
    assert step_limit(steps, minutes=None, factor=10) == 20.0  # the median, not the mean
    assert step_limit(steps, minutes=1, factor=10) == 60.0  # --hang-timeout-minutes is the floor
    assert step_limit(steps, minutes=0.1, factor=10) == 20.0


def test_hang_flags_validated() -> None:
    from megatron.config import parse_args, validate

    cfg = parse_args([*TINY, "--hang-timeout-minutes", "2.5", "--hang-timeout-factor", "20"])
    assert (cfg.training.hang_timeout_minutes, cfg.training.hang_timeout_factor) == (2.5, 20.0)
    for flags, match in (
        (["--hang-timeout-minutes", "-1"], r"--hang-timeout-minutes \(-1.0\) must be >= 0"),
        (["--hang-timeout-factor", "0.5"], r"--hang-timeout-factor \(0.5\) must be > 1"),
    ):
        with pytest.raises(ValueError, match=match):
            validate(parse_args([*TINY, *flags]), world_size=1)
    validate(
        parse_args([*TINY, "--hang-timeout-minutes", "0", "--hang-timeout-factor", "0"]),
        world_size=1,
    )


def test_collective_named_from_the_stack() -> None:
    # Frames whose module is torch.distributed's, as a blocked dist.all_reduce leaves them (no process group).
    c10d: dict = {"__name__": "torch.distributed.distributed_c10d"}
    exec("def all_reduce(wait):\n    return wait()\n", c10d)  # noqa: S102 - builds a frame in that module

    seen: list[str | None] = []

    def caller() -> None:
        c10d["all_reduce"](lambda: seen.append(collective_in_flight(sys._getframe())))

    caller()
    named = seen[0] or ""
    assert named.startswith("all_reduce (torch.distributed), called from ") and named.endswith(
        " in caller"
    )
    assert collective_in_flight(sys._getframe()) is None


def test_watchdog_fires_in_process_and_is_free_when_off(tmp_path: Path) -> None:
    off = HangWatchdog(minutes=None, factor=None, rank=0)
    assert not off.enabled and off._thread is None
    with off.watch("train step", 1):
        pass
    assert list(off.durations) == []  # nothing recorded, no thread

    codes: list[int] = []
    fired = threading.Event()
    log = tmp_path / "stacks.txt"
    with log.open("w") as stream:
        wd = HangWatchdog(
            minutes=0.5 / 60, factor=None, rank=3, stream=stream,
            exit_fn=lambda code: (codes.append(code), fired.set()),
        )  # fmt: skip
        with wd.watch("train step", 1):  # fast: disarmed in time
            pass
        with wd.watch("train step", 2):
            assert fired.wait(timeout=20)
        wd.close()
    text = log.read_text()
    assert codes == [EXIT_HANG]
    assert "--- hang watchdog: stacks of rank 3 (iteration 2) ---" in text
    assert "test_watchdog_fires_in_process_and_is_free_when_off" in text  # the main thread's stack
    assert "Current thread" in text or "Thread 0x" in text

    # --hang-timeout-factor alone: unwatched until MIN_HISTORY steps are timed, then F x their median.
    codes.clear()
    fired.clear()
    with log.open("w") as stream:
        wd = HangWatchdog(
            minutes=None, factor=20, rank=0, stream=stream,
            exit_fn=lambda code: (codes.append(code), fired.set()),
        )  # fmt: skip
        for i in range(MIN_HISTORY):
            with wd.watch("train step", i + 1):
                time.sleep(0.01)
        with wd.watch("checkpoint save", MIN_HISTORY):  # saves: the fixed limit only, here none
            time.sleep(0.5)
        assert not fired.is_set()
        with wd.watch("train step", MIN_HISTORY + 1):
            assert fired.wait(timeout=20)
        wd.close()
    assert codes == [EXIT_HANG]
    assert "(iteration 6)" in log.read_text()

    quiet = HangWatchdog(minutes=1, factor=None, rank=0, stream=io.StringIO(), exit_fn=codes.append)
    with quiet.watch("evaluation", 1):  # armed with the fixed limit only, and left in time
        pass
    quiet.close()
    assert codes == [EXIT_HANG] and quiet._thread is None


def test_one_rank_sleeping_in_a_step_every_rank_dumps_and_exits_7(tmp_path: Path) -> None:
    port = 20000 + os.getpid() % 20000
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(port))
    argv = [*TINY, "--hang-timeout-minutes", "0.1", "--distributed-timeout-minutes", "5"]
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    start = time.monotonic()
    procs = []
    for r in range(2):
        with logs[r].open("w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", DRIVER, *argv],
                    cwd=ROOT,
                    env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
            )
    try:
        codes = [p.wait(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    took = time.monotonic() - start
    texts = [log.read_text() for log in logs]
    assert codes == [EXIT_HANG, EXIT_HANG], "\n".join(t[-3000:] for t in texts)
    for r, text in enumerate(texts):
        assert f"hang watchdog: rank {r}, iteration 3: the train step has run" in text, text[-3000:]
        assert f"--- hang watchdog: stacks of rank {r} (iteration 3) ---" in text
        assert "(most recent call first)" in text  # faulthandler's dump
    assert "sleepy_step" in texts[1]  # the sleeping rank's stack shows where it is
    # The waiting rank is inside DeepSpeed's gradient all-reduce, and says so.
    flight = "collective in flight: all_reduce (torch.distributed), called from "
    assert flight in texts[0], texts[0][-3000:]
    assert took < 60, f"took {took:.1f} s"
