"""The LoRA branch of the tensor-parallel linears: ``scaling * B (A dropout(x))`` split like the base weight.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` input features, ``o`` output features, ``r`` LoRA rank,
``p`` TP size.

Column-parallel linear (``W [o/p, h]`` per rank): ``A [r, h]`` is replicated, ``B [o/p, r]`` is split on dim 0
exactly as ``W``'s rows (same stride)::

    x [s, b, h] -> A -> u [s, b, r] -> B_t -> [s, b, o/p]      (added to this rank's output columns)

``u`` is the same on every rank, but its gradient is a partial sum (each rank's ``B_t`` sees its own columns):
``copy_to_tensor_model_parallel_region`` all-reduces it (``[s, b, r]``, r << h). Under sequence parallelism the input
is ``[s/p, b, h]``: ``u`` is formed on the local tokens and all-gathered on ``s`` (backward: reduce-scatter), and
``A``'s gradient, each rank's share from its own tokens, is summed over TP (``A`` goes through
``copy_to_tensor_model_parallel_region``, as the sequence-parallel norm weights do).

Row-parallel linear (``W [o, h/p]``): ``A [r, h/p]`` is split on dim 1 like ``W``'s columns, ``B [o, r]`` is
replicated. ``B (A_t x_t)`` is this rank's share of the product: it joins the base partial sum before the TP
all-reduce (or reduce-scatter), so the sum over ranks is ``B A x``. ``B``'s gradient ``dY^T (A_t x_t)`` is then a
partial sum too: ``B`` goes through ``copy_to_tensor_model_parallel_region`` (backward all-reduce), as the
sequence-parallel bias does.

Dropout on the adapter input: a replicated input draws from the default generator (the same on every TP rank, so
the replicated ``A`` stays identical); a sharded input (row-parallel, or sequence parallelism) draws under
``get_cuda_rng_tracker().fork()``, as attention dropout does. The masks depend on the layout (like every dropout
of the model), so layout parity holds at ``--lora-dropout 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.mpu.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.mpu.parallel_state import ProcessGroup
from megatron.mpu.random import get_cuda_rng_tracker


@dataclass(frozen=True)
class LoraSpec:
    """What a TP linear with adapters needs at forward time (its ``lora_a`` / ``lora_b`` are parameters)."""

    rank: int
    """r: rows of ``lora_a``, columns of ``lora_b``."""
    scaling: float
    """alpha / r."""
    dropout: float = 0.0
    """Dropout probability on the adapter input (training only)."""


def _dropout(x: torch.Tensor, p: float, training: bool, *, sharded: bool) -> torch.Tensor:
    if p == 0.0 or not training:
        return x
    if sharded:
        with get_cuda_rng_tracker().fork():
            return F.dropout(x, p=p)
    return F.dropout(x, p=p)


def column_parallel_lora(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    spec: LoraSpec,
    *,
    group: ProcessGroup | None,
    sequence_parallel: bool,
    training: bool,
) -> torch.Tensor:
    """The adapter output of a column-parallel linear (module docstring).

    Args:
        x: the linear's input ``[s, b, h]``, or ``[s/p, b, h]`` under sequence parallelism (TP > 1).
        lora_a: ``[r, h]``, replicated.
        lora_b: ``[o/p, r]``, this rank's rows.

    Returns:
        ``[s, b, o/p]``, to add to the base output (before any gather of the output).
    """
    x = _dropout(x, spec.dropout, training, sharded=sequence_parallel)
    if sequence_parallel:
        # each rank's tokens give their share of A's gradient: summed over TP (backward all-reduce)
        a = copy_to_tensor_model_parallel_region(lora_a, group)
        u = F.linear(x, a)  # [s/p, b, h] -> [s/p, b, r]
        u = gather_from_sequence_parallel_region(u, True, group)  # [s/p, b, r] -> [s, b, r]
        return F.linear(u, lora_b) * spec.scaling  # [s, b, r] -> [s, b, o/p]
    u = F.linear(x, lora_a)  # [s, b, h] -> [s, b, r]
    u = copy_to_tensor_model_parallel_region(u, group)  # [s, b, r]; backward: all-reduce
    return F.linear(u, lora_b) * spec.scaling  # [s, b, r] -> [s, b, o/p]


def row_parallel_lora(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    spec: LoraSpec,
    *,
    group: ProcessGroup | None,
    training: bool,
) -> torch.Tensor:
    """This rank's share of the adapter output of a row-parallel linear (module docstring).

    Args:
        x: the linear's (TP-split) input ``[s, b, h/p]``.
        lora_a: ``[r, h/p]``, this rank's columns.
        lora_b: ``[o, r]``, replicated (its gradient is summed over TP here).

    Returns:
        ``[s, b, o]``, a partial sum: add it to the base partial product before the TP reduction.
    """
    u = F.linear(
        _dropout(x, spec.dropout, training, sharded=True), lora_a
    )  # [s, b, h/p] -> [s, b, r]
    b = copy_to_tensor_model_parallel_region(lora_b, group)  # [o, r]; backward: all-reduce
    return F.linear(u, b) * spec.scaling  # [s, b, r] -> [s, b, o] (partial over TP)
