"""Reliability round 3 of a training run (issue #35, items 1, 4, 14, 25).

* (1) the NaN guard counts a step DeepSpeed skipped (ZeRO ≥ 1, pipelines run as ZeRO-1) as a failure in fp32/bf16,
  and in fp16 after a few skips at the lowest loss scale: exit 6, ``latest`` stays at the last good checkpoint;
* (4) batches without a loss token: a warning per log interval; a run that never counted one stops with exit 2
  (the catalogue's ``train-every-loss-token-masked`` runs it end to end on a preprocessed dataset);
* (14) an MoE checkpoint's expert-parallel size is recorded and compared before DeepSpeed loads anything;
* (25) a rank SIGKILLed mid-training: the survivor prints one line naming it and exits 8.

Real processes: ``pretrain_gpt.py`` subprocesses (plain ``RANK``/``WORLD_SIZE`` environment, torchrun), real
DeepSpeed engines and gloo groups, real SIGKILLs.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.launch.exit_codes import (
    EXIT_CONFIG_ERROR,
    EXIT_NON_FINITE,
    EXIT_PEER_LOST,
    ConfigError,
)
from megatron.launch.peers import Peer, peer_fate, peer_loss_reason, peer_lost_message, this_process
from megatron.testing import find_free_port
from megatron.training.guards import MAX_SKIPS_AT_MIN_LOSS_SCALE, LossTokenWatch, SkipGuard
from megatron.training.step import StepResult

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
# --lr 1e6: iteration 3's loss is 1e13 with a finite grad norm, iteration 4's gradients overflow.
EXPLODING = [
    *TINY,
    "--lr",
    "1e6",
    "--train-iters",
    "6",
    "--save-interval",
    "2",
    "--log-level",
    "WARNING",
]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", **extra)
    return env


def _step(*, skipped: bool, loss_scale: float = 1.0, grad_norm: float | None = None) -> StepResult:
    norm = grad_norm if grad_norm is not None else (float("inf") if skipped else 1.0)
    return StepResult(loss=5.0, grad_norm=norm, skipped=skipped, loss_scale=loss_scale)


# ----------------------------------------------------------------------------------------------- units
def test_skip_guard_by_precision() -> None:
    """fp32/bf16: the first skipped step is a failure; fp16: only MAX_SKIPS_AT_MIN_LOSS_SCALE in a row at the
    lowest scale (a skip at a higher scale, or an applied step, restarts the count)."""
    for precision in ("fp32", "bf16"):
        guard = SkipGuard(precision)
        assert guard.failure(_step(skipped=False)) is None
        reason = guard.failure(_step(skipped=True))
        assert reason is not None and f"in {precision} there is no loss scale to lower" in reason
    fp16 = SkipGuard("fp16", min_loss_scale=1.0)
    assert fp16.failure(_step(skipped=True, loss_scale=1024.0)) is None  # the scaler's business
    for _ in range(MAX_SKIPS_AT_MIN_LOSS_SCALE - 1):
        assert fp16.failure(_step(skipped=True, loss_scale=1.0)) is None
    assert (
        fp16.failure(_step(skipped=False, loss_scale=1.0)) is None
    )  # an applied step: count restarts
    reasons = [fp16.failure(_step(skipped=True)) for _ in range(MAX_SKIPS_AT_MIN_LOSS_SCALE)]
    assert reasons[:-1] == [None] * (MAX_SKIPS_AT_MIN_LOSS_SCALE - 1)
    assert (
        reasons[-1] is not None
        and "consecutive steps skipped at the lowest fp16 loss scale" in reasons[-1]
    )


def test_deepspeed_fp16_scaler_giving_up_is_recognized() -> None:
    """DeepSpeed's own dynamic loss scaler at --min-loss-scale with no hysteresis left raises a plain Exception
    (fp16 needs CUDA, so the scaler object is driven directly): the loop turns it into exit 6, not a traceback."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from megatron.training.guards import loss_scale_exhausted

    scaler = DynamicLossScaler(
        init_scale=1.0,
        scale_window=1000,
        min_scale=1.0,
        delayed_shift=1,
        consecutive_hysteresis=False,
    )
    with pytest.raises(Exception) as caught:  # noqa: PT011 - DeepSpeed raises a bare Exception
        scaler.update_scale(True)
    reason = loss_scale_exhausted(caught.value)
    assert reason is not None and "cannot lower the loss scale below --min-loss-scale" in reason
    assert loss_scale_exhausted(RuntimeError("CUDA out of memory")) is None


def test_loss_token_watch(caplog) -> None:
    """An empty global batch now and then is a warning at the log interval; none with a token ever is an error at
    the first decision point (end of the first log interval, a save, the run's end)."""
    watch = LossTokenWatch(first_iteration=8, log_interval=4)
    with caplog.at_level(logging.WARNING, logger="megatron.training.guards"):
        for it in range(9, 21):
            watch.record(it, it not in (10, 11, 14))
            watch.check(it, decide_now=it == 12)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # at 12 and 16; none at 20
    assert warnings[0].startswith("2 of the last 4 iterations (10, 11) had no loss token")
    assert warnings[1].startswith("1 of the last 4 iterations (14) had no loss token")
    never = LossTokenWatch(first_iteration=0, log_interval=100)
    never.record(1, False)
    never.check(1, decide_now=False)  # not yet decided
    never.record(2, False)
    with pytest.raises(
        ConfigError, match=r"no loss token in the 2 iteration\(s\) trained \(iterations 1-2\)"
    ):
        never.check(2, decide_now=True)


def test_peer_classification_and_fate() -> None:
    """The transport phrases are recognized; a SIGKILLed local process reads as 'died with signal 9' while it is a
    zombie, and 'is gone' once reaped; a live one is not reported."""
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:40165: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
    )
    assert peer_loss_reason(gloo) == "gloo: Connection reset by peer"
    assert peer_loss_reason(RuntimeError("CUDA out of memory")) is None
    me = this_process(0)
    child = subprocess.Popen(["sleep", "60"])
    try:
        fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
        victim = Peer(rank=1, host=me.host, pid=child.pid, start_ticks=int(fields[19]))
        assert peer_fate(victim) is None
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while peer_fate(victim) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert peer_fate(victim) == "died with signal 9 (SIGKILL)"
        line = peer_lost_message(0, "gloo: Connection reset by peer", [me, victim])
        assert line == (
            f"rank 0: lost contact with a peer (gloo: Connection reset by peer); rank 1 (pid {child.pid}) "
            "died with signal 9 (SIGKILL); stopping"
        )
    finally:
        child.kill()
        child.wait()
    assert peer_fate(victim) == "is gone"


# ----------------------------------------------------------------------------------------------- (1) ZeRO-1
def test_nan_guard_stops_a_zero1_run_whose_steps_are_skipped(tmp_path: Path) -> None:
    """--zero-stage 1 in fp32: DeepSpeed's ZeRO optimizer skips iteration 4 (inf grad norm); the run stops there
    with exit 6 instead of skipping every later step and saving the result as 'latest' (old: exit 0, latest 6)."""
    save = tmp_path / "ckpt"
    proc = subprocess.run(
        [PY, "pretrain_gpt.py", *EXPLODING, "--zero-stage", "1", "--save", str(save)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_NON_FINITE, out[-3000:]
    assert "Traceback" not in out
    assert (
        "iteration 4: DeepSpeed skipped the update (non-finite gradients, grad norm inf); in fp32"
        in out
    )
    assert (save / "latest").read_text().strip() == "global_step2"
    assert sorted(p.name for p in save.glob("global_step*")) == ["global_step2"]


@pytest.mark.slow  # ~20 s: two ranks under torchrun
def test_nan_guard_stops_a_pipeline_run(tmp_path: Path) -> None:
    """PP 2 (run as ZeRO-1 with clipping): the same stop at iteration 4 on both stages (old: exit 0, latest 6)."""
    save = tmp_path / "ckpt"
    proc = subprocess.run(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "pretrain_gpt.py",
         *EXPLODING, "--pipeline-model-parallel-size", "2", "--save", str(save)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "iteration 4: DeepSpeed skipped the update" in out, out[-3000:]
    assert f"exitcode  : {EXIT_NON_FINITE}" in out, out[-3000:]
    assert (save / "latest").read_text().strip() == "global_step2"


# ----------------------------------------------------------------------------------------------- (14) MoE EP
MOE = [
    *TINY[: TINY.index("--lr")], "--num-experts", "4", "--expert-interval", "1",
    "--lr", "1e-3", "--seed", "1234", "--mock-data", "--vocab-size", "99", "--tokenizer-type", "NullTokenizer",
    "--eval-iters", "0", "--log-level", "WARNING",
]  # fmt: skip


@pytest.mark.slow  # ~25 s: an EP 2 checkpoint needs two ranks
def test_moe_checkpoint_resumed_at_another_expert_parallel_size(tmp_path: Path) -> None:
    """Saved at EP 2 (two ranks) in bf16 with ZeRO-1, resumed at EP 1: one line naming both sizes, why it is not
    converted and the fix, exit 2, before DeepSpeed loads anything (old: a DeepSpeed/torch optimizer traceback,
    exit 1); --no-load-optim resumes. (fp32 checkpoints are converted on load: test_ckpt_relayout_moe.py.)"""
    ck = tmp_path / "ckpt"
    zero1 = ["--bf16", "--zero-stage", "1", "--create-moe-param-group"]
    subprocess.run(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "pretrain_gpt.py",
         *MOE, *zero1, "--moe-expert-parallel-size", "2", "--train-iters", "2", "--save", str(ck)],
        cwd=ROOT, env=_env(), check=True, capture_output=True, timeout=180,
    )  # fmt: skip
    before = (ck / "latest").read_text()
    proc = subprocess.run(
        [PY, "pretrain_gpt.py", *MOE, *zero1, "--moe-expert-parallel-size", "1", "--train-iters", "3",
         "--load", str(ck), "--save", str(ck)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_CONFIG_ERROR, out[-3000:]
    assert "Traceback" not in out
    assert (
        f"error: --load {ck} (tag global_step2) was saved with --moe-expert-parallel-size 2; this run uses 1"
        in out
    )
    assert "DeepSpeed's bf16/fp16 optimizers keep fp32 master groups by EP rank" in out
    assert "Resume with --moe-expert-parallel-size 2" in out and "--no-load-optim" in out
    assert (ck / "latest").read_text() == before
    ok = subprocess.run(
        [PY, "pretrain_gpt.py", *MOE, *zero1, "--moe-expert-parallel-size", "1", "--train-iters", "3",
         "--load", str(ck), "--save", str(ck), "--no-load-optim"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0, (ok.stdout + ok.stderr)[-3000:]


# ----------------------------------------------------------------------------------------------- (25) a peer dies
@pytest.mark.slow  # ~15 s: two ranks, one killed
def test_surviving_rank_names_the_rank_that_was_killed(tmp_path: Path) -> None:
    """Two ranks (plain RANK/WORLD_SIZE launch); rank 1 SIGKILLed mid-training: rank 0 prints one line naming rank
    1, its pid and signal 9, no traceback, exit 8 (old: gloo's 'Connection reset by peer' traceback, exit 1)."""
    port = str(find_free_port())
    procs = []
    for rank in (0, 1):
        env = _env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port)  # fmt: skip
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(
            [PY, "pretrain_gpt.py", *TINY, "--train-iters", "100000"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        ), log))  # fmt: skip
    (r0, log0), (r1, log1) = procs
    try:
        deadline = time.monotonic() + 120
        while "iteration        3/" not in (tmp_path / "rank0.log").read_text():
            assert time.monotonic() < deadline and r0.poll() is None, (
                tmp_path / "rank0.log"
            ).read_text()
            time.sleep(0.1)
        r1.send_signal(
            signal.SIGKILL
        )  # not reaped until rank 0 is done: its wait status stays readable
        code = r0.wait(timeout=60)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            log.close()
    out = (tmp_path / "rank0.log").read_text()
    assert code == EXIT_PEER_LOST, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [x for x in out.splitlines() if "lost contact" in x]
    assert len(lines) == 1, out[-3000:]
    assert lines[0].startswith("rank 0: lost contact with a peer (gloo: "), lines
    assert lines[0].endswith(f"rank 1 (pid {r1.pid}) died with signal 9 (SIGKILL); stopping"), lines
