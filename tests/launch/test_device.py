"""The one device rule of training, conversion and generation (``megatron/launch/device.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.launch.device import device_type, local_device, requested_device

ROOT = Path(__file__).resolve().parents[2]


def test_device_choice_on_a_cpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert device_type() == "cpu" and device_type("gloo") == "cpu"
    assert requested_device(None) == "cpu"
    # a --device string and a torch.device (what generation passes on) are both taken as they are
    assert requested_device("cpu") == "cpu" and requested_device(torch.device("cpu")) == "cpu"
    assert local_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(
            ValueError, match=r"--device cuda:1: this torch sees no CUDA device; use --device cpu"
        ):
            requested_device("cuda:1")
        with pytest.raises(ValueError, match="no CUDA device"):
            requested_device(torch.device("cuda"))


NO_CUDA_SCRIPT = r"""
import tempfile
from pathlib import Path

import torch

touched = []


def _refuse(name):
    def call(*args, **kwargs):
        touched.append(name)
        raise RuntimeError(f"a CPU run called torch.cuda.{name}")

    return call


# A GPU is visible, and every torch.cuda call that would make a CUDA context raises (and is counted).
torch.cuda.is_available = lambda: True
for name in ("_lazy_init", "init", "get_rng_state", "set_rng_state", "manual_seed", "set_device",
             "current_device", "get_rng_state_all", "set_rng_state_all", "get_device_name",
             "get_device_properties"):
    setattr(torch.cuda, name, _refuse(name))

from megatron import mpu
from megatron.checkpointing.rng import load_rng_file, save_rng_file
from megatron.data.samplers import BatchLayout, build_pretraining_data_loader
from megatron.launch.device import device_type
from megatron.planning.flops import detect_peak_tflops

dev = device_type("gloo")
assert dev == "cpu", dev
mpu.model_parallel_cuda_manual_seed(1234, device_type=dev)  # what set_seeds does with run.device.type
tracker = mpu.get_cuda_rng_tracker()
with tracker.fork():
    torch.nn.functional.dropout(torch.ones(8), 0.5)
x = torch.randn(4, 8, requires_grad=True)
mpu.checkpoint(lambda t: torch.nn.functional.dropout(t, 0.5) * 2, False, x).sum().backward()
with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "rng.safetensors"
    save_rng_file(path)
    load_rng_file(path)
data = [{"text": torch.arange(5) + i} for i in range(8)]
loader = build_pretraining_data_loader(data, 0, layout=BatchLayout(2, 4, 0, 1))
assert loader.pin_memory is False, loader.pin_memory
assert next(iter(loader))["text"].shape == (2, 5)
assert detect_peak_tflops(None, dev) is None  # MFU's peak: the table is for CUDA devices only
assert not touched, touched
print("no CUDA call")
"""


def test_cpu_run_never_touches_cuda() -> None:
    """With a GPU visible (``torch.cuda.is_available()`` True) a CPU run's RNG seeding, tracker fork, activation
    checkpointing, RNG checkpoint save/restore and data loader make no ``torch.cuda`` call and pin nothing: each
    would make a CUDA context per gloo rank on GPU 0. One subprocess (the patches stay out of this one)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", NO_CUDA_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0 and "no CUDA call" in proc.stdout, proc.stderr[-3000:]
