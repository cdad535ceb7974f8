"""LayerNorm and RMSNorm with Megatron sequence-parallel semantics.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``p`` TP size.

The weights (and LayerNorm's bias) are replicated over TP. Without sequence parallelism every TP rank sees the same
``[s, b, h]`` activations and computes the same full gradient. With sequence parallelism each rank sees only its
``[s/p, b, h]`` slice, so each rank's gradient is a partial sum: the weight is used through
``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward), which sums the partial gradients
over TP. Initialization: weight ones, bias zeros (layout-invariant by construction).

``--apply-layernorm-1p`` (Megatron's zero-centered gamma): the stored weight is ``w = gamma - 1``, initialized to
zero, and the norm multiplies by ``1 + w``. The function is the same as a plain norm with ``gamma = 1 + w``; the
stored values (and what a weight decay would pull them towards) differ. Megatron-DeepSpeed applies it to LayerNorm
only and silently ignores it with RMSNorm; Trident applies it to both (no flag is accepted and ignored).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron import fused_kernels
from megatron.mpu.mappings import copy_to_tensor_model_parallel_region
from megatron.mpu.parallel_state import ProcessGroup


def _tp_shared(
    param: torch.Tensor, sequence_parallel: bool, group: ProcessGroup | None
) -> torch.Tensor:
    return copy_to_tensor_model_parallel_region(param, group) if sequence_parallel else param


def _gamma(norm: LayerNorm | RMSNorm) -> torch.Tensor:
    """The scale the norm multiplies by: ``weight``, or ``1 + weight`` with ``apply_layernorm_1p``."""
    w = _tp_shared(norm.weight, norm.sequence_parallel, norm.group)
    return w + 1.0 if norm.apply_layernorm_1p else w


class LayerNorm(nn.Module):
    """``torch.nn.functional.layer_norm`` over the last dim with weight and bias (GPT-2).

    Args:
        hidden_size: normalized (last) dim ``h``.
        eps: ``--layernorm-epsilon``.
        apply_layernorm_1p: store ``gamma - 1`` (initialized to 0) and multiply by ``1 + weight``.
        sequence_parallel: each TP rank sees different inputs (its ``[s/p, b, h]`` slice under sequence
            parallelism; its own heads for the attention's QK-norm), so grads of weight/bias are summed over TP.
        group: the TP group those grads are summed over (None = the default one).
        params_dtype, device: of the parameters.
        fused: run the fused kernel where one is built (``--no-persist-layer-norm`` turns it off).
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        eps: float = 1e-5,
        apply_layernorm_1p: bool = False,
        sequence_parallel: bool = False,
        group: ProcessGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        fused: bool = True,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.apply_layernorm_1p = apply_layernorm_1p
        self.sequence_parallel = sequence_parallel
        self.group = group
        init = torch.zeros if apply_layernorm_1p else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device))
        for p in (self.weight, self.bias):
            p.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]`` (or ``[s/p, b, h]`` under sequence parallelism)."""
        b = _tp_shared(self.bias, self.sequence_parallel, self.group)
        return fused_kernels.layer_norm(x, _gamma(self), b, self.eps, fused=self.fused)


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps)`` computed in fp32, cast back, times weight (LLaMA; no bias).

    Args: as :class:`LayerNorm`.
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        eps: float = 1e-5,
        apply_layernorm_1p: bool = False,
        sequence_parallel: bool = False,
        group: ProcessGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        fused: bool = True,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.apply_layernorm_1p = apply_layernorm_1p
        self.sequence_parallel = sequence_parallel
        self.group = group
        init = torch.zeros if apply_layernorm_1p else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=params_dtype, device=device))
        self.weight.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]`` (or ``[s/p, b, h]`` under sequence parallelism)."""
        return fused_kernels.rms_norm(x, _gamma(self), self.eps, fused=self.fused)


def norm_class(normalization: str) -> type[LayerNorm] | type[RMSNorm]:
    """The norm selected by ``--normalization`` (``layernorm`` or ``rmsnorm``); both take the same arguments.

    Raises:
        ValueError: for any other value.
    """
    kinds: dict[str, type[LayerNorm] | type[RMSNorm]] = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}
    if normalization not in kinds:
        raise ValueError(f"--normalization ({normalization!r}) must be 'layernorm' or 'rmsnorm'.")
    return kinds[normalization]
