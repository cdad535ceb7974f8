"""Fused kernels (``csrc/cpu``, ``csrc/cuda``) behind autograd functions, each with its PyTorch reference.

The reference (``reference.py``) is the fallback wherever no kernel is built (``TRIDENT_NO_KERNELS=1`` forces it)
and the oracle of the tests. ``loader.py`` finds the extension built at install or JIT-builds it once per user
cache; ``ops.py`` holds the autograd functions. The vocabulary-parallel cross-entropy's two TP reductions live in
``megatron.mpu.cross_entropy``, which takes this package's local passes (``cross_entropy_kernels``).
"""

from __future__ import annotations

from megatron.fused_kernels.loader import extension, force_references, status
from megatron.fused_kernels.ops import (
    bias_gelu,
    bias_swiglu,
    cross_entropy_kernels,
    layer_norm,
    rms_norm,
    rope,
    scaled_masked_softmax,
    scaled_upper_triang_masked_softmax,
)

__all__ = [
    "bias_gelu",
    "bias_swiglu",
    "cross_entropy_kernels",
    "extension",
    "force_references",
    "layer_norm",
    "rms_norm",
    "rope",
    "scaled_masked_softmax",
    "scaled_upper_triang_masked_softmax",
    "status",
]
