"""Crash safety: ``pretrain_gpt.py`` subprocesses killed with SIGKILL during a save, and stopped by SIGTERM.

The kills are real: the saving process SIGKILLs itself at a named point of the save (``TRIDENT_TEST_CRASH_AT``,
run through ``crash_driver.py``), or the test sends SIGKILL/SIGTERM from outside at a random moment. After each
kill the same command is relaunched (auto-resume from --load) and its losses must equal the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.model.presets import GPT2_FLAGS

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).resolve().parent / "crash_driver.py"
CRASH_ENV = "TRIDENT_TEST_CRASH_AT"
ITERS = 6

FLAGS = [
    *GPT2_FLAGS,
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "1", "--global-batch-size", "2",
    "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--seed", "7", "--mock-data", "--vocab-size", "299",
    "--eval-interval", "1000", "--eval-iters", "0", "--log-interval", "1", "--log-level", "WARNING",
]  # fmt: skip


def _env(crash: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    env.pop(CRASH_ENV, None)
    if crash:
        env[CRASH_ENV] = crash
    return env


def _cmd(ckpt: Path, metrics: Path, iters: int, *extra: str) -> list[str]:
    return [
        sys.executable, str(ROOT / "pretrain_gpt.py"), *FLAGS, "--train-iters", str(iters),
        "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2",
        "--metrics-file", str(metrics), *extra,
    ]  # fmt: skip


def _losses(path: Path) -> dict[int, float]:
    if not path.exists():
        return {}
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return {r["iteration"]: r["lm_loss"] for r in rows if "lm_loss" in r}


def _run(cmd: list[str], crash: str | None = None) -> int:
    if crash:  # the same flags through the fault-injecting driver
        cmd = [cmd[0], str(DRIVER), *cmd[2:]]
    proc = subprocess.run(
        cmd, env=_env(crash), cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"exit {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.returncode


def _latest(ckpt: Path) -> str:
    return (ckpt / "latest").read_text()


FULL_STEPS = [
    ("after_engine_save:4", "global_step2"),  # all files of step 4 written, no marker: ignored
    ("after_meta:4", "global_step2"),  # step 4 complete, pointers not moved yet
    ("before_engine_save:4", "global_step2"),  # RNG file of step 4 only
    ("after_latest:4", "global_step4"),  # latest moved; the iteration file lags
    ("before_engine_save:6", "global_step4"),
    (None, f"global_step{ITERS}"),
]
DEFAULT_STEPS = [FULL_STEPS[0], FULL_STEPS[3], FULL_STEPS[5]]


@pytest.mark.parametrize(
    "steps",
    [DEFAULT_STEPS, pytest.param(FULL_STEPS, marks=pytest.mark.slow)],
    ids=["default", "all-points"],
)
def test_kill9_during_save_then_resume(tmp_path: Path, steps: list) -> None:
    """SIGKILL at points of a save; every relaunch resumes from the newest complete checkpoint, exactly."""
    straight = tmp_path / "straight.jsonl"
    _run(_cmd(tmp_path / "ref", straight, ITERS))
    ref = _losses(straight)
    assert sorted(ref) == list(range(1, ITERS + 1))
    ck = tmp_path / "ckpt"
    for i, (crash, expected_latest) in enumerate(steps):
        metrics = tmp_path / f"run{i}.jsonl"
        code = _run(_cmd(ck, metrics, ITERS), crash)
        assert code == (0 if crash is None else -signal.SIGKILL)
        assert _latest(ck) == expected_latest, (crash, _latest(ck))
        got = _losses(metrics)
        assert got and all(got[k] == ref[k] for k in got), (crash, got, ref)
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    # Re-saving the very tag 'latest' points at (resume an older tag into the same --save): 'latest' first moves
    # to the newest other complete checkpoint, so a crash during the re-save leaves a loadable pointer.
    older = _cmd(ck, tmp_path / "older.jsonl", ITERS, "--load-tag", "global_step4")
    assert _run(older, f"before_engine_save:{ITERS}") == -signal.SIGKILL
    assert _latest(ck) == "global_step4"
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    again = tmp_path / "again.jsonl"
    _run(_cmd(ck, again, ITERS))
    assert _losses(again) == {k: ref[k] for k in (5, 6)}
    assert _latest(ck) == f"global_step{ITERS}"


def _sigterm_once(tmp_path: Path, kill_signal: int) -> tuple[int, Path, Path]:
    ck = tmp_path / "ckpt"
    metrics = tmp_path / "first.jsonl"
    # --async-save: the save on SIGTERM returns at once; the exit must wait for its files and commit them.
    cmd = _cmd(ck, metrics, 10_000, "--save-interval", "1000", "--async-save")
    proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while len(_losses(metrics)) < 3 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(random.uniform(0.0, 0.3))
    proc.send_signal(kill_signal)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, ck, metrics


def test_sigterm_saves_and_exits_5(tmp_path: Path) -> None:
    code, ck, metrics = _sigterm_once(tmp_path, signal.SIGTERM)
    assert code == 5
    done = max(_losses(metrics))
    assert _latest(ck) == f"global_step{done}"
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(done)
    # Relaunch (same flags but a finite length): resumes at done + 1.
    more = tmp_path / "second.jsonl"
    _run(_cmd(ck, more, done + 2))
    assert sorted(_losses(more)) == [done + 1, done + 2]
    # The same --load with a different model: exit 2 before any process group, one line listing the fields.
    bad = [a if a != "32" else "48" for a in _cmd(ck, more, done + 3)[2:]]  # --hidden-size 48
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), *bad],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "differs from the flags in 3 field(s): hidden_size: checkpoint 32, flags 48" in errors[0]
    assert "head_dim: checkpoint 8, flags 12; ffn_size: checkpoint 128, flags 192" in errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(3))
def test_kill9_at_random_moments(tmp_path: Path, attempt: int) -> None:
    """SIGKILL from outside at a random moment while saving every iteration; the relaunch always resumes."""
    ck = tmp_path / "ckpt"
    metrics = tmp_path / "first.jsonl"
    cmd = _cmd(ck, metrics, 10_000, "--save-interval", "1")
    proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stderr=subprocess.DEVNULL)
    deadline = time.time() + 180
    while len(_losses(metrics)) < 2 and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(random.uniform(0.0, 1.0))
    proc.kill()
    proc.wait(timeout=60)
    start = int(_latest(ck).removeprefix("global_step"))
    more = tmp_path / "second.jsonl"
    _run(_cmd(ck, more, start + 1, "--save-interval", "1"))
    assert sorted(_losses(more)) == [start + 1]
