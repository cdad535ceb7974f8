"""pretrain_gpt.py as users launch it: plain python, torchrun, the deepspeed launcher; errors and exit codes."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.launch.exit_codes import (
    EXIT_CONFIG_ERROR,
    EXIT_DURATION,
    EXIT_INTERVAL,
    EXIT_OK,
    EXIT_SIGNAL,
)

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--vocab-size", "99",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1", "--eval-iters", "1",
]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", **extra)
    return env


def _run(
    cmd: list[str], timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=ROOT, env=_env(**(env or {})), capture_output=True, text=True, timeout=timeout
    )


def _records(path: Path) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r for r in lines if "lm_loss" in r], [r for r in lines if "valid_loss" in r]


# A launcher environment of rank 0 in a world of N whose other ranks never start: any process-group creation would
# hang until the test's timeout, so these also prove the checks run before any group exists.
ALONE_IN_4 = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
BAD = [
    (["--tensor-model-parallel-size", "3"], r"--num-attention-heads \(4\) must be divisible"),
    (["--global-batch-size", "6"], r"--global-batch-size \(6\) must be divisible"),
    (["--pipeline-model-parallel-size", "4"], r"exceeds --num-layers \(2\)"),
    (["--fp16"], r"--fp16 needs a CUDA GPU"),
    (
        ["--zero-stage", "2", "--pipeline-model-parallel-size", "2"],
        r"--zero-stage \(2\) is incompatible",
    ),
    (["--train-iters", "2", "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "exclusive"),
    (["--bogus-flag"], "unrecognized arguments"),
    (
        ["--save", "/proc/no_such_ckpt"],
        r"--save /proc/no_such_ckpt: the directory cannot be written",
    ),
    (["--data-path", "no/such_prefix"], "exactly one data source; got --mock-data and --data-path"),
    (["--train-iters", "2", "--tokenizer-type", "GPT2BPETokenizer"], "--vocab-file"),
    (["--global-batch-size", "0"], r"--global-batch-size \(0\) must be a positive"),
    (["--train-iters", "0"], r"--train-iters \(0\) must be a positive"),
    (["--num-workers", "-1"], r"--num-workers \(-1\) must be >= 0"),
    (["--distributed-timeout-minutes", "0"], "must be positive"),
    (["--lr", "-1"], "must not be negative"),
    (["--lr-warmup-fraction", "2.0"], r"--lr-warmup-fraction \(2.0\) must be in \[0, 1\]"),
    (["--lr-warmup-samples", "1000"], "does not apply to a run length given by --train-iters"),
    (["--exit-interval", "0"], r"--exit-interval \(0\) must be >= 1"),
    (["--lr-warmup-iters", "100"], "exceeds the decay length"),
    (["--metrics-file", "/tmp"], "--metrics-file /tmp is a directory"),
    (["--finetune"], "--finetune was given without --load"),
]


def _argv(extra: list[str]) -> list[str]:
    return (
        [*TINY, "--train-iters", "2", *extra] if "--train-iters" not in extra else [*TINY, *extra]
    )


def _main():
    spec = importlib.util.spec_from_file_location("pretrain_gpt", ROOT / "pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("extra,pattern", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_flags_one_line_exit_2(extra: list[str], pattern: str, monkeypatch, capsys) -> None:
    """In process (fast): pretrain_gpt.main returns 2 with one ``error:`` line, as rank 0 of a world of 4."""
    for k, v in ALONE_IN_4.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert _main()(_argv(extra)) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), err


def test_bad_cpu_allocator_env_one_line_exit_2(monkeypatch, capsys) -> None:
    """TRIDENT_CPU_ALLOCATOR is checked with the flags, before any group (rank 0 of a world of 4)."""
    for k, v in ALONE_IN_4.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TRIDENT_CPU_ALLOCATOR", "jemalloc")
    assert _main()(_argv([])) == EXIT_CONFIG_ERROR
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "TRIDENT_CPU_ALLOCATOR='jemalloc' is not a choice" in errors[0]


def test_missing_data_prefix_is_file_not_found(monkeypatch, capsys) -> None:
    for k, v in ALONE_IN_4.items():
        monkeypatch.setenv(k, v)
    argv = [a for a in _argv([]) if a != "--mock-data"] + ["--data-path", "no/such_prefix"]
    assert _main()(argv) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert (
        "error: --data-path no/such_prefix: missing no/such_prefix.bin, no/such_prefix.idx" in err
    )


@pytest.mark.parametrize(
    "extra,pattern",
    [
        (["--split", "abc"], "--split"),
        (["--split", "0,50,50"], "no training documents"),
        ([], "but the tokenizer has 100 tokens; the data was preprocessed with another tokenizer"),
    ],
)
def test_bad_data_split_before_any_group(extra, pattern, monkeypatch, capsys) -> None:
    for k, v in ALONE_IN_4.items():
        monkeypatch.setenv(k, v)
    prefix = str(ROOT / "tests" / "fixtures" / "tiny" / "tiny_text_document")
    argv = [a for a in _argv([]) if a != "--mock-data"] + ["--data-path", prefix, *extra]
    assert _main()(argv) == EXIT_CONFIG_ERROR
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and pattern in errors[0], errors


def test_skip_train_accepts_a_split_without_training_data() -> None:
    from megatron.config import parse_args
    from megatron.training.data_iterators import check_data_flags

    prefix = str(ROOT / "tests" / "fixtures" / "tiny" / "tiny_text_document")
    argv = [a for a in _argv([]) if a != "--mock-data"] + [
        "--data-path",
        prefix,
        "--split",
        "0,50,50",
    ]
    check_data_flags(
        parse_args([*argv, "--skip-train"])
    )  # evaluation only: no training share needed
    with pytest.raises(ValueError, match="no training documents"):
        check_data_flags(parse_args(argv))


def test_bad_flag_as_a_process_no_traceback() -> None:
    no_vocab = ["--train-iters", "2", "--tokenizer-type", "GPT2BPETokenizer"]
    p = _run([PY, "pretrain_gpt.py", *_argv(no_vocab)], timeout=120, env=ALONE_IN_4)
    assert p.returncode == EXIT_CONFIG_ERROR, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].startswith("error: --tokenizer-type GPT2BPETokenizer")
    assert "Traceback" not in p.stderr


def test_ds_config_conflict_fails_on_every_rank_before_groups(tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    p = _run(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "pretrain_gpt.py", *TINY, "--train-iters", "2", "--zero-stage", "1",
         "--deepspeed_config", str(ds)],
    )  # fmt: skip
    assert p.returncode != 0
    # The first rank to fail exits with the config-error code, and torchrun then stops the other one (SIGTERM), so
    # the second rank's own message appears only when it got there first (a timing race: 1 or 2 copies).
    out = p.stdout + p.stderr
    assert 1 <= out.count("error: --zero-stage (1)") <= 2, p.stderr[-3000:]
    assert "zero_optimization.stage = 3" in out
    assert re.search(rf"exitcode\s*: {EXIT_CONFIG_ERROR} ", p.stderr), p.stderr[-3000:]
    assert 'File "' + str(ROOT / "megatron") not in p.stderr  # no traceback from our code


def test_plain_python_no_env_and_exit_interval(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    p = _run(
        [PY, "pretrain_gpt.py", *TINY, "--train-iters", "6", "--exit-interval", "3",
         "--eval-interval", "2", "--metrics-file", str(metrics), "--tensorboard-dir",
         str(tmp_path / "tb")],
    )  # fmt: skip
    assert p.returncode == EXIT_INTERVAL, p.stderr[-3000:]
    train, evals = _records(metrics)
    assert [r["iteration"] for r in train] == [1, 2, 3]
    assert [r["consumed_samples"] for r in train] == [8, 16, 24]
    assert [r["iteration"] for r in evals] == [2]
    assert all(r["grad_norm"] > 0 and r["mfu"] is None and r["tokens_per_sec"] > 0 for r in train)
    assert " iteration        3/       6 |" in p.stderr and "MFU: n/a" in p.stderr
    assert "CPU allocator: freed tensor memory is kept for reuse (auto: planned peak" in p.stderr
    assert list((tmp_path / "tb").iterdir())


def test_exit_duration_and_finish(tmp_path: Path) -> None:
    p = _run(
        [PY, "pretrain_gpt.py", *TINY, "--train-iters", "50", "--exit-duration-in-mins", "1e-6"]
    )
    assert p.returncode == EXIT_DURATION, p.stderr[-3000:]
    metrics = tmp_path / "m.jsonl"
    ok = _run(
        [PY, "pretrain_gpt.py", *TINY, "--train-samples", "24", "--eval-interval", "100",
         "--metrics-file", str(metrics), "--exit-interval", "3"],
    )  # fmt: skip
    # 24 samples = 3 iterations: the last one is also an --exit-interval point, but the run finished (exit 0).
    assert ok.returncode == EXIT_OK, ok.stderr[-3000:]
    train, evals = _records(metrics)
    assert len(train) == 3 and [r["iteration"] for r in evals] == [3]  # final evaluation


def test_sigterm_saves_and_exits_5(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [PY, "pretrain_gpt.py", *TINY, "--train-iters", "100000", "--metrics-file", str(metrics)],
        cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_SIGNAL, err[-3000:]


def test_deepspeed_launcher_two_ranks(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    launcher = Path(PY).parent / "deepspeed"
    p = _run(
        [str(launcher), "--num_gpus", "2", "--master_port", str(29500 + os.getpid() % 1000),
         "pretrain_gpt.py", *TINY, "--train-iters", "2", "--tensor-model-parallel-size", "2",
         "--metrics-file", str(metrics)],
    )  # fmt: skip
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    train, _ = _records(metrics)
    assert [r["iteration"] for r in train] == [1, 2]


def test_srun_environment_two_tasks(tmp_path: Path) -> None:
    """Two tasks started the way ``srun -n 2`` starts them: only SLURM_* variables, no RANK/WORLD_SIZE/MASTER_*.

    (Slurm itself is not installed here; the test reproduces the environment srun gives each task.)
    """
    metrics = tmp_path / "m.jsonl"
    cmd = [PY, "pretrain_gpt.py", *TINY, "--train-iters", "2", "--tensor-model-parallel-size", "2"]
    cmd += ["--metrics-file", str(metrics)]
    slurm = {
        "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "localhost",
        "SLURM_JOB_ID": str(4000 + os.getpid() % 5000),
    }  # fmt: skip
    procs = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=_env(**slurm, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "srun task 0 of 2: rendezvous at localhost:" in outs[0]
    train, _ = _records(metrics)
    assert [r["iteration"] for r in train] == [1, 2]
