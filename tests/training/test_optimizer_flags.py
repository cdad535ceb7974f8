"""--cpu-optimizer / --cpu_torch_adam: DeepSpeed's CPU Adam with ZeRO optimizer offload to CPU.

DeepSpeed's CPU Adam against torch's AdamW (10 steps, 1e-6 relative), the generated DeepSpeed config, the flag
checks, the one-line errors of a failed build and of a stale build lock, and real single-rank ``pretrain`` runs
(the loss falls, the engine offloads and steps with the chosen optimizer).

The C++ op compiles in 1.5-5 minutes on a small CPU box (measured: 5 min wall on 2 busy cores), so these tests
use torch's default extension cache (``~/.cache/torch_extensions``, or ``$TORCH_EXTENSIONS_DIR`` when set): the
first run builds it, later runs and CI with a cached home only load it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron.config import RunPlan, parse_args, validate
from megatron.launch.exit_codes import ConfigError
from megatron.testing import run_distributed
from megatron.training.ds_config import build_ds_config
from megatron.training.optimizer import (
    STALE_LOCK_SECONDS,
    build_optimizer,
    cpu_adam_build_dir,
    load_cpu_adam_op,
)

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "6",
    "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "linear",
    "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234",
    "--mock-data", "--vocab-size", "299", "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
    "--eval-iters", "0", "--log-interval", "1", "--log-level", "WARNING",
]  # fmt: skip


def _params(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(40, 72), torch.nn.LayerNorm(72), torch.nn.Linear(72, 9)
    )


def test_cpu_adam_matches_torch_adamw() -> None:
    cfg = parse_args(
        [
            *TINY,
            "--cpu-optimizer",
            "--zero-stage",
            "1",
            "--adam-beta2",
            "0.95",
            "--adam-eps",
            "1e-6",
        ]
    ).training
    ours, ref = _params(0), _params(0)
    opt = build_optimizer(ours, cfg)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    assert isinstance(opt, DeepSpeedCPUAdam) and opt.adam_w_mode
    ref_opt = torch.optim.AdamW(
        [
            {"params": [p for p in ref.parameters() if p.dim() > 1], "weight_decay": 0.01},
            {"params": [p for p in ref.parameters() if p.dim() == 1], "weight_decay": 0.0},
        ],
        lr=2e-3,
        betas=(0.9, 0.95),
        eps=1e-6,
    )
    g = torch.Generator().manual_seed(1)
    for step in range(10):
        for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
            grad = torch.randn(a.shape, generator=g) * (1.0 + step)
            a.grad, b.grad = grad.clone(), grad.clone()
        for group in (*opt.param_groups, *ref_opt.param_groups):
            group["lr"] = 2e-3 * (1.0 - step / 20)  # as the LR schedule does, every iteration
        opt.step()
        ref_opt.step()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        # 1e-6 relative (fp32; DeepSpeed's SIMD loop rounds differently); atol only for values crossing zero.
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert not torch.equal(ours[0].weight, _params(0)[0].weight)  # it did train


def test_cpu_torch_adam_is_torch_adamw() -> None:
    cfg = parse_args([*TINY, "--cpu-optimizer", "--cpu_torch_adam", "--zero-stage", "1"]).training
    assert type(build_optimizer(_params(0), cfg)) is torch.optim.AdamW


def _ds(flags: list[str], user: dict | None = None) -> dict:
    cfg = parse_args([*TINY, *flags])
    validate(cfg, world_size=1)
    return build_ds_config(
        cfg, RunPlan.build(cfg, world_size=1, device_type="cpu", true_vocab=299), user
    )


def test_ds_config_offload() -> None:
    assert "offload_optimizer" not in _ds(["--zero-stage", "1"])["zero_optimization"]
    zero = _ds(["--cpu-optimizer", "--zero-stage", "2"])["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu"} and zero["stage"] == 2
    # The user's offload tuning is kept; another device is an error naming both sources.
    tuned = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    merged = _ds(["--cpu-optimizer", "--zero-stage", "1"], tuned)
    assert merged["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    nvme = {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}
    with pytest.raises(
        ValueError,
        match=r'--cpu-optimizer \(True\) sets zero_optimization.offload_optimizer.device = "cpu"',
    ):
        _ds(["--cpu-optimizer", "--zero-stage", "1"], nvme)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--cpu-optimizer"],
            "--cpu-optimizer offloads the optimizer to the CPU through ZeRO, which --zero-stage 0",
        ),
        (
            ["--cpu-optimizer", "--zero-stage", "1", "--optimizer", "sgd"],
            "--cpu-optimizer runs Adam on the CPU, but --optimizer is sgd",
        ),
        (["--cpu_torch_adam", "--zero-stage", "1"], "--cpu_torch_adam chooses torch's AdamW"),
    ],
)
def test_validate_cpu_optimizer(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(parse_args([*TINY, *flags]), world_size=1)


def test_stale_build_lock_is_one_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cpu_adam_build_dir() == tmp_path / "cpu_adam"
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    old = time.time() - STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with pytest.raises(
        ConfigError, match=r"the build lock .*cpu_adam/lock is 31 minutes old.*delete that file"
    ):
        load_cpu_adam_op()


_FAILING_BUILD = """
import sys
from megatron.launch.exit_codes import ConfigError
from megatron.training.optimizer import load_cpu_adam_op
try:
    load_cpu_adam_op()
except ConfigError as e:
    print("error:", e)
    sys.exit(2)
"""


def test_failed_build_is_one_error(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(tmp_path),
        "CXX": "/bin/false",
        "DS_ACCELERATOR": "cpu",
    }
    run = subprocess.run(
        [sys.executable, "-c", _FAILING_BUILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 2, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, run.stdout
    assert lines[0].startswith("error: --cpu-optimizer: DeepSpeed's CPU Adam op could not be built")
    assert "--cpu_torch_adam" in lines[0] and f"ninja -C {tmp_path / 'cpu_adam'}" in lines[0]


class _Probe:
    """Checkpoint hooks that save nothing; the final ``save`` records how the engine steps."""

    seen: dict = {}

    def load(self, engine, scheduler, state) -> None:
        pass

    def restore_rng(self) -> None:
        pass

    def save(self, engine, scheduler, state) -> None:
        master = engine.optimizer.single_partition_of_fp32_groups[0]
        offload = engine._config.zero_config.offload_optimizer
        _Probe.seen = {
            "offload": engine.zero_offload_optimizer(),
            "device": str(offload.device) if offload is not None else None,
            "basic": type(engine.basic_optimizer).__name__,
            "master_device": master.device.type,
        }


def _cpu_optimizer_runs(tmp: str) -> dict:
    from megatron.training import pretrain

    out = {}
    for name, flags in {
        "cpu_adam": ["--cpu-optimizer"],
        "cpu_torch_adam": ["--cpu-optimizer", "--cpu_torch_adam"],
        "plain": [],
    }.items():
        save = ["--save", f"{tmp}/{name}", "--save-interval", "1000"]
        cfg = parse_args([*TINY, "--zero-stage", "1", *save, *flags])
        result = pretrain(cfg, checkpoint_hooks=_Probe())
        out[name] = {"losses": result.losses, "exit": result.exit_code, **_Probe.seen}
    return out


def test_cpu_optimizer_trains_with_offload(tmp_path: Path) -> None:
    r = run_distributed(_cpu_optimizer_runs, 1, str(tmp_path), timeout=500)[0]
    for name, basic in (("cpu_adam", "DeepSpeedCPUAdam"), ("cpu_torch_adam", "AdamW")):
        run = r[name]
        assert run["exit"] == 0 and len(run["losses"]) == 6
        assert run["losses"][-1] < run["losses"][0]
        assert run["offload"] and run["device"].endswith("cpu") and run["basic"] == basic
        assert run["master_device"] == "cpu"
    assert not r["plain"]["offload"] and r["plain"]["basic"] == "AdamW"
    # The same AdamW update wherever it runs: the three loss curves agree (fp32 rounding of the CPU kernel).
    for name in ("cpu_adam", "cpu_torch_adam"):
        assert r[name]["losses"] == pytest.approx(r["plain"]["losses"], rel=1e-5)


_RANK = """
import sys, torch
from megatron.training.optimizer import load_cpu_adam_op
load_cpu_adam_op()
from deepspeed.ops.adam import DeepSpeedCPUAdam
p = torch.nn.Parameter(torch.ones(8))
p.grad = torch.ones(8)
DeepSpeedCPUAdam([p], lr=0.1).step()
print(p[0].item())
"""


@pytest.mark.slow
def test_two_ranks_build_once_into_an_empty_dir(tmp_path: Path) -> None:
    """Two ranks start at once on an empty extension dir: one compiles, the other waits, both load (3-6 min)."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "DS_ACCELERATOR": "cpu"}
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [float(o) for o in outs] == [pytest.approx(0.9)] * 2
    log = (tmp_path / "cpu_adam" / ".ninja_log").read_text().splitlines()[1:]
    assert sorted(line.split()[3] for line in log) == [
        "cpu_adam.o",
        "cpu_adam.so",
        "cpu_adam_impl.o",
    ]
    assert not (tmp_path / "cpu_adam" / "lock").exists()
