"""The one device rule of training, conversion and generation (``megatron/launch/device.py``)."""

from __future__ import annotations

import pytest
import torch

from megatron.launch.device import device_type, local_device, requested_device


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
