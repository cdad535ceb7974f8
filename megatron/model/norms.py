"""LayerNorm and RMSNorm with Megatron sequence-parallel semantics.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``p`` TP size.

The weights (and LayerNorm's bias) are replicated over TP. Without sequence parallelism every TP rank sees the same
``[s, b, h]`` activations and computes the same full gradient. With sequence parallelism each rank sees only its
``[s/p, b, h]`` slice, so each rank's gradient is a partial sum: the weight is used through
``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward), which sums the partial gradients
over TP. Initialization: weight ones, bias zeros (layout-invariant by construction).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.mpu.mappings import copy_to_tensor_model_parallel_region
from megatron.mpu.parallel_state import ProcessGroup


def _tp_shared(
    param: torch.Tensor, sequence_parallel: bool, group: ProcessGroup | None
) -> torch.Tensor:
    return copy_to_tensor_model_parallel_region(param, group) if sequence_parallel else param


class LayerNorm(nn.Module):
    """``torch.nn.functional.layer_norm`` over the last dim with weight and bias (GPT-2).

    Args:
        hidden_size: normalized (last) dim ``h``.
        eps: ``--layernorm-epsilon``.
        sequence_parallel: inputs are ``[s/p, b, h]`` slices; grads of weight/bias are summed over TP.
        group: the TP group those grads are summed over (None = the default one).
        params_dtype, device: of the parameters.
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        group: ProcessGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.sequence_parallel = sequence_parallel
        self.group = group
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device))
        for p in (self.weight, self.bias):
            p.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]`` (or ``[s/p, b, h]`` under sequence parallelism)."""
        w = _tp_shared(self.weight, self.sequence_parallel, self.group)
        b = _tp_shared(self.bias, self.sequence_parallel, self.group)
        return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps)`` computed in fp32, cast back, times weight (LLaMA; no bias).

    Args: as :class:`LayerNorm`.
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        group: ProcessGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.sequence_parallel = sequence_parallel
        self.group = group
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))
        self.weight.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]`` (or ``[s/p, b, h]`` under sequence parallelism)."""
        xf = x.to(torch.float32)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return _tp_shared(self.weight, self.sequence_parallel, self.group) * normed.to(x.dtype)


def build_norm(
    normalization: str,
    hidden_size: int,
    *,
    eps: float,
    sequence_parallel: bool,
    group: ProcessGroup | None,
    params_dtype: torch.dtype,
    device: torch.device | str | None,
) -> LayerNorm | RMSNorm:
    """The norm selected by ``--normalization`` (``layernorm`` or ``rmsnorm``).

    Raises:
        ValueError: for any other value.
    """
    kinds: dict[str, type[LayerNorm] | type[RMSNorm]] = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}
    if normalization not in kinds:
        raise ValueError(f"--normalization ({normalization!r}) must be 'layernorm' or 'rmsnorm'.")
    return kinds[normalization](
        hidden_size,
        eps=eps,
        sequence_parallel=sequence_parallel,
        group=group,
        params_dtype=params_dtype,
        device=device,
    )
