"""The device check (``scripts/gpu_check.sh``) on CPU: its dry run reports every step, survives a hung and a
failing step, keeps to its deadline and exits 0 with its summary; its header lists the steps it runs; its training
flags pass our parser and ``validate()`` for a CUDA run; its step summaries read real metrics files right (and
fail where the run failed); ``gpu_wheels.sh`` resolves what the check carries.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

from megatron.config import build_parser, config_from_namespace, validate

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "scripts" / "gpu_check.sh"


def _helper():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "gpu_check_steps", ROOT / "scripts" / "gpu_check_steps.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _steps() -> list[tuple[str, int, str, int]]:
    """(name, timeout s, expected min, optional) of every row of the script's STEPS table."""
    block = CHECK.read_text().split("STEPS=(", 1)[1].split(")", 1)[0]
    rows = re.findall(r'"(\w+) (\d+) ([\d.]+) ([01]) ([01])"', block)
    return [(n, int(t), e, int(o)) for n, t, e, o, _ in rows]


def _run_group(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in a session of its own; on a timeout kill that whole group (a broken script's children, e.g.
    a build, must not outlive the test)."""
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw
    ) as proc:
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_scripts_parse() -> None:
    for script in ("gpu_check.sh", "gpu_wheels.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True, timeout=30)
    compile((ROOT / "scripts" / "gpu_check_steps.py").read_text(), "gpu_check_steps.py", "exec")


def test_header_lists_every_step_with_its_timeout_and_expected_minutes() -> None:
    steps = _steps()
    assert [s[0] for s in steps] == [
        "wheels", "env", "build", "pytest", "stress", "gpt2", "llama", "fp16", "bench", "memcheck",
    ]  # fmt: skip
    header = [ln for ln in CHECK.read_text().splitlines() if ln.startswith("#")]
    for name, timeout, expected, optional in steps:
        row = next((ln for ln in header if re.match(rf"#\s+{name}\s", ln)), None)
        assert row is not None, f"the header's table lacks {name}"
        assert re.search(rf"\s{timeout} s\s+{re.escape(expected)} min\s", row), row
        assert ("if time" in row) == bool(optional), row
    # the required steps' expected minutes fit the ~8 minutes of one command with room for a rerun
    assert sum(float(e) for _, _, e, o in steps if not o) <= 6.5


def test_dry_run_reports_every_step_times_out_a_hung_one_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "GPU_CHECK_WORK": str(tmp_path / "work"),
        "GPU_CHECK_DRY_RUN": "1",
        "GPU_CHECK_HANG": "pytest",
        "GPU_CHECK_TIMEOUT_pytest": "1",
        "GPU_CHECK_FAIL": "build,llama",
        "GPU_CHECK_BUDGET": "60",  # the optional steps' timeouts (90, 120 s) no longer fit: SKIP
    }
    run = _run_group(["bash", str(CHECK)], env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("gpu-check: ")]
    summary = (out / "summary.txt").read_text()
    verdicts = {}
    for line in summary.splitlines():
        if line.startswith("gpu-check: "):
            name, verdict, seconds = line.split()[1:4]
            verdicts[name] = (verdict, int(seconds.rstrip("s")))
    names = [s[0] for s in _steps()]
    assert list(verdicts) == names  # one verdict line per step, in order, in the summary file ...
    assert lines[: len(names)] == [ln for ln in summary.splitlines() if ln.startswith("gpu-check")]
    assert lines[len(names) :] == lines[: len(names)]  # ... and on stdout, repeated at the end
    assert verdicts["pytest"][0] == "TIMEOUT" and verdicts["pytest"][1] <= 5
    assert verdicts["build"][0] == verdicts["llama"][0] == "FAIL"
    assert verdicts["bench"][0] == verdicts["memcheck"][0] == "SKIP"
    assert {verdicts[n][0] for n in ("wheels", "env", "stress", "gpt2", "fp16")} == {"PASS"}
    # the tails of the failed steps come before the summary
    assert "failed on purpose" in run.stdout
    # every step that ran left its log, moved into logs.tar once it ended
    with tarfile.open(out / "logs.tar") as tar:
        assert sorted(tar.getnames()) == sorted(f"{n}.log" for n in names[:-2])
        gpt2 = tar.extractfile("gpt2.log").read().decode()  # type: ignore[union-attr]
    # the dry run logs the command it would run
    assert "pretrain_gpt.py" in gpt2 and "GPT2_ARGS" in gpt2
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar", "summary.txt"]


def _expand(array: str) -> list[str]:
    out = subprocess.run(
        [
            "bash",
            "-c",
            f'GPU_CHECK_DEFINE_ONLY=1 source "$0"; printf "%s\\0" "${{{array}[@]}}"',
            CHECK,
        ],
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout.decode()
    return out.split("\0")[:-1]


def test_training_flags_parse_and_validate_for_one_gpu() -> None:
    configs = {}
    for array in ("GPT2_ARGS", "LLAMA_ARGS", "FP16_ARGS"):
        cfg = config_from_namespace(build_parser().parse_args(_expand(array)))
        validate(cfg, world_size=1, device_type="cuda")
        configs[array] = cfg
    gpt2, llama, fp16 = configs["GPT2_ARGS"], configs["LLAMA_ARGS"], configs["FP16_ARGS"]
    assert (gpt2.model.num_layers, gpt2.model.hidden_size, gpt2.model.seq_length) == (12, 768, 1024)
    assert gpt2.training.bf16 and gpt2.training.train_iters == 20
    # the reference attention with the kernel softmax
    assert not llama.model.use_flash_attn and llama.model.masked_softmax_fusion
    assert llama.model.swiglu and llama.model.normalization == "rmsnorm"
    assert fp16.training.fp16 and fp16.training.loss_scale is None  # dynamic loss scaling


def _metrics(path: Path, losses: list[float], **extra: object) -> Path:
    rows = [
        {
            "iteration": i + 1,
            "lm_loss": loss,
            "tokens_per_sec": 1000.0 * (i + 1),
            "tflops_per_device": 10.0,
            "mfu": 0.25,
            "loss_scale": 2.0 ** (32 - i),
            "skipped_iter": int(i < 3),
            **extra,
        }
        for i, loss in enumerate(losses)
    ]
    rows.insert(2, {"iteration": 2, "valid_loss": 9.0, "valid_ppl": 8000.0})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_step_summaries_read_real_metrics_files_and_fail_where_the_run_did(tmp_path: Path) -> None:
    h = _helper()
    on = _metrics(tmp_path / "on.jsonl", [10.0, 9.5, 9.0, 8.7, 8.5, 8.4, 8.3, 8.2])
    ok, text = h.train_summary(on)
    # the medians of iterations 6-8 (5 warm-up iterations left out)
    assert ok and "tokens/s 7000" in text and "MFU 0.250" in text
    off = _metrics(tmp_path / "off.jsonl", [10.0, 9.5, 9.01, 8.7, 8.5, 8.4, 8.3, 8.2])
    ok, text = h.compare_losses(on, off, 0.05)
    assert ok and "1.00e-02 at iteration 3" in text
    assert not h.compare_losses(on, off, 0.001)[0]  # a larger difference than the bound fails
    ok, text = h.fp16_summary(on)
    assert ok and "3 of 8 iterations skipped" in text and "4.29497e+09 -> 3.35544e+07" in text
    diverged = _metrics(tmp_path / "nan.jsonl", [10.0, 9.0, 8.0, 7.0, math.nan])
    assert not h.fp16_summary(diverged)[0] and not h.train_summary(diverged)[0]
    assert not h.compare_losses(on, diverged, 1.0)[0]
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps([{"op": "rms_norm", "speedup": 3.0}, {"op": "rope", "speedup": 0.8}])
    )
    assert h.bench_summary(bench) == (
        True,
        "kernel/reference speed-up: rms_norm 3.00x, rope 0.80x (slowest rope)",
    )
    # a missing file (the run died before writing it) is a failed step with a KEY line, not a traceback
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check_steps.py"), "train", "missing.jsonl"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert run.returncode == 1 and run.stdout.startswith("KEY: FileNotFoundError"), run.stderr


def test_wheels_keep_the_images_packages_and_list_what_the_check_carries(tmp_path: Path) -> None:
    h = _helper()
    wheels = tmp_path / "whl"
    wheels.mkdir()
    # pytest is installed here (the "image"): its own is kept, nothing is installed
    (wheels / "pytest-9.2.0-py3-none-any.whl").write_bytes(b"")
    ok, text = h.install_wheels(wheels, tmp_path / "site")
    assert ok and text == "nothing to install (1 on the image)"
    run = _run_group(
        ["bash", str(ROOT / "scripts" / "gpu_wheels.sh"), "--list"],
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert run.returncode == 0, run.stderr
    listed = run.stdout.split()
    names = {pin.split("==")[0] for pin in listed}
    assert {"deepspeed", "hjson", "pydantic", "pydantic-core", "pytest", "pytest-timeout"} <= names
    assert "torch" not in names and all("==" in pin for pin in listed)
