"""bf16 on a GPU before Ampere (a V100) is refused in one line (issue 30, item 2).

The sm_70 build has no bf16 kernels (``csrc/cuda/kernels.h``), so ``--bf16`` at preflight, a bf16 tensor at the
fused ops and the binding refuse it there. The rule itself is a pure function of the compute capability, checked
here on the CPU; the GPU paths call it with the device's capability.
"""

from __future__ import annotations

import pytest
import torch

from megatron.fused_kernels.arch import bf16_refusal, check_bf16_device


@pytest.mark.parametrize("capability", [(7, 0), (7, 5), (6, 1)])
def test_bf16_refused_before_sm80(capability: tuple[int, int]) -> None:
    message = bf16_refusal(capability, "Tesla V100-SXM2-32GB")
    assert message is not None and "\n" not in message
    major, minor = capability
    assert f"Tesla V100-SXM2-32GB is {major}.{minor}" in message
    assert ">= 8.0" in message and "--fp16" in message


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0), (10, 0)])
def test_bf16_accepted_from_sm80(capability: tuple[int, int]) -> None:
    assert bf16_refusal(capability, "any") is None


def test_cpu_tensors_are_never_refused() -> None:
    check_bf16_device(torch.device("cpu"))  # no CUDA call, no error
