"""Reliability of a training run (issue #15): NaN guard, LR flags on resume, the --save lock, collective timeouts
on every process group, Ctrl-C, non-finite float flags.

Real processes throughout: ``pretrain_gpt.py`` subprocesses for exit codes and signals, ``run_distributed`` (real gloo
groups, the real DeepSpeed engine) for in-process resume checks.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.launch.exit_codes import (
    EXIT_CONFIG_ERROR,
    EXIT_INTERRUPTED,
    EXIT_NON_FINITE,
    EXIT_OK,
)
from megatron.testing import find_free_port, run_distributed

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "1", "--global-batch-size", "2",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--seed", "1234", "--mock-data", "--vocab-size", "299", "--tokenizer-type", "NullTokenizer",
    "--eval-iters", "0", "--log-interval", "1",
]  # fmt: skip
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", **extra)
    return env


def _popen(argv: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "pretrain_gpt.py", *argv],
        cwd=ROOT,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_line(proc: subprocess.Popen, fragment: str, timeout: float = 90.0) -> list[str]:
    """Read ``proc``'s output until a line contains ``fragment``; returns the lines read."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if fragment in line:
            return lines
    raise AssertionError(f"{fragment!r} never appeared:\n{''.join(lines)[-3000:]}")


# ----------------------------------------------------------------------------------------------- flags, units
def test_non_finite_float_flags_and_nan_perplexity() -> None:
    from megatron.config import parse_args, validate
    from megatron.training.metrics import EvalRecord, format_eval_line, perplexity

    for flag in (
        "--lr=nan",
        "--lr=inf",
        "--weight-decay=nan",
        "--adam-eps=-inf",
        "--clip-grad=nan",
    ):
        with pytest.raises(ValueError, match=rf"{flag.split('=')[0]}: .*not a finite number"):
            parse_args([*TINY, flag])
    cfg = parse_args([*TINY, "--distributed-timeout-minutes", "0.1"])
    assert cfg.parallel.distributed_timeout_minutes == pytest.approx(0.1)
    both = parse_args(
        [*TINY, "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"]
    )
    with pytest.raises(ValueError, match="exclusive"):
        validate(both, world_size=1)
    assert parse_args([*TINY]).training.check_for_nan_in_loss_and_grad
    assert not parse_args(
        [*TINY, "--no-check-for-nan-in-loss-and-grad"]
    ).training.check_for_nan_in_loss_and_grad
    parse_args([*TINY, "--check-for-nan-in-loss-and-grad"])  # Megatron's spelling of the default
    assert math.isnan(perplexity(float("nan")))
    line = format_eval_line(
        EvalRecord(iteration=3, valid_loss=float("nan"), valid_ppl=perplexity(float("nan")))
    )
    assert "PPL: NAN" in line.upper() and "4.85" not in line


# ----------------------------------------------------------------------------------------------- NaN guard
def test_nan_guard_stops_with_exit_code_and_keeps_latest(tmp_path: Path) -> None:
    """--lr 1e6: the loss is NaN from iteration 4 on; the run stops there with exit 6, latest stays at 3."""
    save = tmp_path / "ckpt"
    proc = subprocess.run(
        [PY, "pretrain_gpt.py", *TINY, "--lr", "1e6", "--train-iters", "8", "--save", str(save),
         "--save-interval", "1", "--log-level", "WARNING"],  # fmt: skip
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_NON_FINITE, out[-3000:]
    assert "Traceback" not in out
    assert "non-finite" in out and "iteration 4" in out, out[-3000:]
    assert (save / "latest").read_text().strip() == "global_step3"
    assert not (save / "global_step4" / "trident_meta.json").exists()
    assert not (save / ".trident_save.lock").exists()


# ----------------------------------------------------------------------------------------------- LR on resume
def _lrs(path: Path) -> list[float]:
    return [json.loads(x)["lr"] for x in path.read_text().splitlines() if '"lm_loss"' in x]


def _lr_resume_scenario(tmp: str) -> dict:
    from megatron.config import parse_args
    from megatron.training import pretrain

    ck = str(Path(tmp) / "ckpt")
    base = [*TINY, "--log-level", "WARNING", "--lr-decay-style", "linear", "--min-lr", "0"]
    pretrain(parse_args([*base, "--train-iters", "4", "--save", ck]))
    out: dict = {}

    def attempt(name: str, *extra: str) -> None:
        metrics = str(Path(tmp) / f"{name}.jsonl")
        try:
            r = pretrain(parse_args([*base, "--load", ck, "--metrics-file", metrics, *extra]))
            out[name] = (r.iteration, _lrs(Path(metrics)))
        except ValueError as e:
            out[name] = str(e)

    attempt("other_lr", "--train-iters", "4", "--lr", "2e-3")
    attempt("override", "--train-iters", "6", "--lr", "2e-3", "--override-opt_param-scheduler")
    attempt(
        "checkpoint", "--train-iters", "6", "--lr", "2e-3", "--use-checkpoint-opt_param-scheduler"
    )
    attempt("extend", "--train-iters", "8")
    attempt("explicit_decay", "--train-iters", "8", "--lr-decay-iters", "6")
    return out


def test_lr_flags_on_resume(tmp_path: Path) -> None:
    r = run_distributed(_lr_resume_scenario, 1, str(tmp_path), timeout=240)[0]
    assert isinstance(r["other_lr"], str), r["other_lr"]
    assert "--lr" in r["other_lr"] and "--override-opt_param-scheduler" in r["other_lr"]
    assert "--use-checkpoint-opt_param-scheduler" in r["other_lr"]
    # Iterations 5, 6 of a linear decay over 6 iterations (warmup 1) from the flags' --lr 2e-3: the schedule is at
    # sample 8 of 12 -> 2e-3 * (1 - (8 - 2) / (12 - 2)) = 8e-4, then 4e-4.
    it, lrs = r["override"]
    assert it == 6 and lrs == pytest.approx([8e-4, 4e-4])
    # The checkpoint's schedule (--lr 1e-3, decay over its 4 iterations): past the horizon -> --min-lr 0.
    it, lrs = r["checkpoint"]
    assert it == 6 and lrs == pytest.approx([0.0, 0.0])
    # Extending: the implicit horizon (--lr-decay-iters unset = --train-iters) follows the new --train-iters 8:
    # 1e-3 * (1 - (8 - 2) / (16 - 2)), ... never lr 0 before the last iteration.
    it, lrs = r["extend"]
    expected = [1e-3 * (1 - (s - 2) / 14) for s in (8, 10, 12, 14)]
    assert it == 8 and lrs == pytest.approx(expected)
    # An explicit --lr-decay-iters that differs from the checkpoint's horizon is a mismatch like --lr.
    assert isinstance(r["explicit_decay"], str) and "decay" in r["explicit_decay"]


# ----------------------------------------------------------------------------------------------- --save lock
HOLDER = """
import sys, time
from megatron.checkpointing.save_lock import acquire_save_lock
lock = acquire_save_lock(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def test_save_lock_live_stale_and_sigint(tmp_path: Path) -> None:
    """A live holder refuses a second run (exit 2, naming it); SIGINT of a run saves and exits 130 with no lock
    left; a holder killed with SIGKILL leaves a stale lock the next run takes over."""
    save = tmp_path / "ckpt"
    lock = save / ".trident_save.lock"
    first = _popen(
        [*TINY, "--train-iters", "100000", "--save", str(save), "--save-interval", "100000"]
    )
    try:
        _wait_for_line(first, "iteration        2/")
        assert lock.is_file()
        first.send_signal(signal.SIGSTOP)  # alive but idle: the second run gets the CPU
        second = subprocess.run(
            [PY, "pretrain_gpt.py", *TINY, "--train-iters", "2", "--save", str(save)],
            cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        out = second.stdout + second.stderr
        assert second.returncode == EXIT_CONFIG_ERROR, out[-3000:]
        assert f"pid {first.pid}" in out and "Traceback" not in out, out[-3000:]
        first.send_signal(signal.SIGCONT)
        first.send_signal(signal.SIGINT)
        rest, _ = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == EXIT_INTERRUPTED, rest[-3000:]
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest
    assert (
        save / "latest"
    ).is_file() and not lock.exists()  # saved like SIGTERM; the lock released

    # SIGKILL leaves the lock behind; the next run takes it over (same host, the holder is gone).
    other = tmp_path / "other"
    holder = subprocess.Popen(
        [PY, "-c", HOLDER, str(other)], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        _wait_for_line(holder, "held", timeout=60)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert (other / ".trident_save.lock").is_file()
    taker = subprocess.run(
        [PY, "pretrain_gpt.py", *TINY, "--train-iters", "1", "--save", str(other), "--log-level", "INFO"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = taker.stdout + taker.stderr
    assert taker.returncode == EXIT_OK, out[-3000:]
    assert "stale lock" in out and f"pid {holder.pid}" in out, out[-3000:]
    assert not (other / ".trident_save.lock").exists()


def test_save_lock_units(tmp_path: Path) -> None:
    """Another host's lock is refused naming the host and how to remove it; release keeps a lock it does not own."""
    from megatron.checkpointing.save_lock import LOCK_FILE, acquire_save_lock

    (tmp_path / LOCK_FILE).write_text(
        json.dumps({"host": "node-elsewhere-7", "pid": 4242, "start_ticks": 1, "boot_id": "x"})
    )
    with pytest.raises(ValueError, match=r"pid 4242 on host node-elsewhere-7.*delete"):
        acquire_save_lock(str(tmp_path))
    (tmp_path / LOCK_FILE).unlink()
    held = acquire_save_lock(str(tmp_path))
    with pytest.raises(ValueError, match=rf"pid {os.getpid()}"):
        acquire_save_lock(str(tmp_path))
    held.release()
    assert not (tmp_path / LOCK_FILE).exists()


# ----------------------------------------------------------------------------------------------- timeouts
def _group_timeouts(timeout_minutes: float) -> dict[str, float]:
    """Seconds of the timeout of every group our code and DeepSpeed's pipeline grid create."""
    import torch
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

    from megatron import mpu
    from megatron.config import parse_args
    from megatron.training.initialize import init_distributed

    def seconds(group: object) -> float:
        backend = group._get_backend(torch.device("cpu"))  # type: ignore[attr-defined]
        return backend.options._timeout.total_seconds()

    cfg = parse_args(
        [
            *TINY,
            "--distributed-timeout-minutes",
            str(timeout_minutes),
            "--pipeline-model-parallel-size",
            "2",
        ]  # fmt: skip
    )
    state = init_distributed(cfg.parallel).state
    out = {f"mpu {k}": seconds(g) for k, g in state.groups.items() if g is not None}
    grid = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=1))
    for name in ("ds_model_proc_group", "dp_proc_group", "pp_proc_group", "slice_proc_group"):
        out[f"deepspeed {name}"] = seconds(getattr(grid, name))
    mpu.destroy_model_parallel()
    return out


def test_timeout_reaches_every_group_and_a_stopped_rank_fails_the_others(tmp_path: Path) -> None:
    timeouts = run_distributed(_group_timeouts, 2, 0.25, timeout=120, init_process_group=False)
    for per_rank in timeouts:
        assert per_rank and all(v == pytest.approx(15.0) for v in per_rank.values()), per_rank

    # Two real ranks (TP 2); rank 1 is stopped (SIGSTOP) mid-training: rank 0 must fail within timeout + margin.
    port = str(find_free_port())
    argv = [*TINY, "--tensor-model-parallel-size", "2", "--train-iters", "100000",
            "--distributed-timeout-minutes", "0.05"]  # fmt: skip
    ranks = [
        _popen(
            argv,
            RANK=str(r),
            WORLD_SIZE="2",
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        for r in range(2)
    ]
    try:
        _wait_for_line(ranks[0], "iteration        2/")
        ranks[1].send_signal(signal.SIGSTOP)
        start = time.monotonic()
        ranks[0].communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert ranks[0].returncode not in (0, None)
    assert elapsed < 3.0 + 20.0, elapsed
    print(f"rank 0 exited {ranks[0].returncode} {elapsed:.1f} s after rank 1 stopped (timeout 3 s)")


# ----------------------------------------------------------------------------------------------- DeepSpeed JSON keys
def test_deepspeed_config_unknown_and_invalid_keys() -> None:
    from megatron.config import RunPlan, parse_args
    from megatron.training.ds_config import build_ds_config

    cfg = parse_args([*TINY, "--train-iters", "2", "--zero-stage", "1"])
    plan = RunPlan.build(cfg, world_size=1, true_vocab=299)
    with pytest.raises(
        ValueError,
        match=r"unknown top-level key zero_optimisation .*'zero_optimization'.*Known keys:",
    ):
        build_ds_config(cfg, plan, {"zero_optimisation": {"stage": 1}})
    with pytest.raises(
        ValueError, match=r"rejects zero_optimization\.reduce_bucket_sizee \(Extra inputs"
    ):
        build_ds_config(cfg, plan, {"zero_optimization": {"reduce_bucket_sizee": 5}})
    with pytest.raises(
        ValueError, match=r"rejects zero_optimization\.overlap_comm \(Input should be"
    ):
        build_ds_config(cfg, plan, {"zero_optimization": {"overlap_comm": "maybe"}})
    merged = build_ds_config(
        cfg, plan, {"zero_optimization": {"reduce_bucket_size": 5}, "wandb": {"enabled": False}}
    )
    assert merged["zero_optimization"] == {"reduce_bucket_size": 5, "stage": 1}
