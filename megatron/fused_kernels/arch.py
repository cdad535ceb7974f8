"""Which GPU generations the CUDA kernels have each dtype for: bf16 needs sm_80 (Ampere) or newer.

Volta (sm_70, V100) has no bf16 arithmetic; its build (``TORCH_CUDA_ARCH_LIST=7.0``, CUDA 12) carries fp32 and
fp16 kernels only, the bf16 ones reduced to a trap (``csrc/cuda/kernels.h``). Asking for bf16 there is refused
with one line before any kernel runs: by ``--bf16`` at preflight, by the ops when a bf16 tensor reaches them, and
by the binding itself.
"""

from __future__ import annotations

import functools

import torch

BF16_MIN_CAPABILITY = (8, 0)
"""The lowest compute capability with bf16 kernels (sm_80)."""


def bf16_refusal(capability: tuple[int, int], device_name: str) -> str | None:
    """The one-line refusal of bf16 on a GPU of ``capability`` (major, minor), or None where bf16 is built."""
    if tuple(capability) >= BF16_MIN_CAPABILITY:
        return None
    major, minor = capability
    return (
        f"bf16 needs a GPU of compute capability >= 8.0 (Ampere or newer); {device_name} is {major}.{minor}: "
        "train with --fp16 (dynamic loss scaling) or in fp32 on this GPU."
    )


@functools.cache
def _device_refusal(index: int) -> str | None:
    return bf16_refusal(torch.cuda.get_device_capability(index), torch.cuda.get_device_name(index))


def check_bf16_device(device: torch.device) -> None:
    """Raise ``RuntimeError`` (one line) if ``device`` is a CUDA GPU without bf16 kernels; else nothing."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    message = _device_refusal(index)
    if message is not None:
        raise RuntimeError(message)
