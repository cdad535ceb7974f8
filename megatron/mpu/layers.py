"""Tensor-parallel layers: column- and row-parallel linear, vocabulary-parallel embedding.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden (input features), ``o`` output features, ``p`` TP size,
``v`` vocab, ``vp = v/p``.

Parameters carry ``tensor_model_parallel`` (bool), ``partition_dim`` and ``partition_stride``; a parameter
without ``tensor_model_parallel`` is replicated on the TP ranks.

Initialization (:class:`WeightInit`). With ``init.seed`` (an int; the model passes
``param_seed(seed, global_name)``) a layer builds the FULL fp32 master weight on CPU, fills it with
``init.method(master, Generator().manual_seed(init.seed))`` and keeps its shard, so the TP=k shard is exactly
the matching slice of the TP=1 weight: the value depends on ``init.seed`` and the full shape only. ``stride`` s
cuts the partition dim into ``s * p`` chunks and rank r keeps chunks ``r, r + p, ..., r + (s - 1) p`` (fused
QKV / GLU layouts)::

    stride 2, p 2, o = 8:  master rows [c0 c1 c2 c3]  ->  rank 0 [c0 c2], rank 1 [c1 c3]

With ``init.seed=None`` each rank fills its shard directly under ``get_cuda_rng_tracker().fork()`` (faster,
no full-size buffer, but the values depend on the TP layout). Biases start at zero; embedding rows
``>= true_vocab_size`` (vocabulary padding) are zero in both modes.

Async TP all-reduce (Megatron's default; ``--no-async-tensor-model-parallel-allreduce`` turns it off). The input
gradient of a column-parallel linear is a partial sum on each TP rank and must be all-reduced; the weight gradient
needs no communication. So backward computes the input gradient first, starts its all-reduce, computes the weight
and bias gradients while it runs, then waits::

    sync:   dX = dY W  | all-reduce(dX) ........ | dW = dY^T X | db
    async:  dX = dY W  | all-reduce(dX) started -> dW = dY^T X, db (overlapped) | wait

The values are the same (the same matmuls, the same sum); only the order in time differs. Under sequence
parallelism the input gradient is reduce-scattered instead (``linear_with_sequence_parallel_input``), not overlapped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron.mpu.context import TPSettings
from megatron.mpu.lora import LoraSpec, column_parallel_lora, row_parallel_lora
from megatron.mpu.mappings import (
    all_gather_first_dim,
    all_reduce_sum_async_,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    linear_with_sequence_parallel_input,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.mpu.parallel_state import ProcessGroup, group_rank, group_world_size, resolve_group
from megatron.mpu.random import get_cuda_rng_tracker
from megatron.mpu.utils import VocabUtility

InitMethod = Callable[[torch.Tensor, "torch.Generator | None"], None]
"""``init_method(tensor, generator)`` fills ``tensor`` in place (``generator=None``: the default generator)."""


@dataclass(frozen=True)
class WeightInit:
    """How a TP layer fills its weight (see the module docstring)."""

    method: InitMethod | None = None
    """``init_method(tensor, generator)`` (Megatron's ``init_method``); None: N(0, 0.02)."""
    seed: int | None = None
    """Seed of the full fp32 master weight, so the value does not depend on the TP layout; None: each rank fills
    its shard under ``get_cuda_rng_tracker().fork()``."""


_TP_ATTRIBUTE_DEFAULTS = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
}


def init_method_normal(std: float) -> InitMethod:
    """N(0, std) init (Megatron's ``--init-method-std``, default 0.02)."""
    if std < 0:
        raise ValueError(f"init_method_normal: std ({std}) must be >= 0")

    def init_(tensor: torch.Tensor, generator: torch.Generator | None = None) -> None:
        with torch.no_grad():
            tensor.normal_(mean=0.0, std=std, generator=generator)

    return init_


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """N(0, std / sqrt(2 * num_layers)): output projections of the residual branches."""
    if num_layers < 1:
        raise ValueError(f"scaled_init_method_normal: num_layers ({num_layers}) must be >= 1")
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    """Mark ``tensor`` as TP-sharded (or not) along ``dim`` with ``stride``."""
    for name, value in (
        ("tensor_model_parallel", is_parallel),
        ("partition_dim", dim),
        ("partition_stride", stride),
    ):
        setattr(tensor, name, value)


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give a replicated parameter the default TP attributes (not parallel, dim -1, stride 1)."""
    for name, value in _TP_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy the TP attributes of ``source`` (or the defaults) onto ``destination``."""
    for name, value in _TP_ATTRIBUTE_DEFAULTS.items():
        setattr(destination, name, getattr(source, name, value))


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor, group: ProcessGroup | None = None
) -> bool:
    """True for a TP-sharded parameter, or on TP rank 0 for a replicated one (count each value once)."""
    return (
        bool(getattr(param, "tensor_model_parallel", False))
        or group_rank(resolve_group(group)) == 0
    )


def _partition_index(full: int, rank: int, world: int, stride: int) -> torch.Tensor:
    """Indices (along the partition dim) of the master rows/columns rank ``rank`` keeps, in shard order."""
    chunk = full // (world * stride)
    starts = [(rank + k * world) * chunk for k in range(stride)]
    return torch.cat([torch.arange(s, s + chunk) for s in starts])


def shard_master_weight(
    master: torch.Tensor, partition_dim: int, stride: int, rank: int, world_size: int
) -> torch.Tensor:
    """The shard of ``master`` that TP rank ``rank`` of ``world_size`` holds (see the module docstring)."""
    index = _partition_index(master.size(partition_dim), rank, world_size, stride)
    return master.index_select(partition_dim, index).contiguous()


def _check_partition(layer: str, what: str, size: int, world: int, stride: int = 1) -> None:
    if size < 1 or size % (world * stride) != 0:
        by = f"tensor-model-parallel size ({world})" + (
            f" x stride ({stride})" if stride > 1 else ""
        )
        raise ValueError(
            f"{layer}: {what} ({size}) must be a positive multiple of the {by}; "
            f"pad {what} to a multiple of {world * stride} or change --tensor-model-parallel-size"
        )


def _init_weight(
    weight: torch.nn.Parameter,
    *,
    full_shape: tuple[int, int],
    partition_dim: int,
    stride: int,
    init: WeightInit,
    rank: int,
    world: int,
    true_rows: int | None = None,
) -> None:
    """Fill ``weight`` (this rank's shard); ``true_rows``: only master rows below it are drawn, the rest zero."""
    init_method, init_seed = init.method or init_method_normal(0.02), init.seed
    with torch.no_grad():
        in_place = world == 1 and weight.dtype == torch.float32 and weight.device.type == "cpu"
        if init_seed is not None and in_place:
            # The shard is the master: draw in place, the same numbers without two full-size copies (which
            # would dominate the peak of a ZeRO-3 build, whose largest module is the word embeddings).
            weight.zero_()
            drawn = weight if true_rows is None else weight[:true_rows]
            init_method(drawn, torch.Generator().manual_seed(init_seed))
            return
        if init_seed is not None:
            master = torch.zeros(full_shape, dtype=torch.float32)
            drawn = master if true_rows is None else master[:true_rows]
            init_method(drawn, torch.Generator().manual_seed(init_seed))
            weight.copy_(shard_master_weight(master, partition_dim, stride, rank, world))
            return
        with get_cuda_rng_tracker().fork():
            init_method(weight, None)
        if true_rows is not None:
            # rows of this shard at global index >= true_rows are vocabulary padding
            first = rank * weight.size(0)
            weight[max(true_rows - first, 0) :].zero_()


def _to_master_order(x: torch.Tensor, world: int, stride: int) -> torch.Tensor:
    """Gathered last dim in partition order ``[r0 chunks, r1 chunks, ...]`` -> master order (stride > 1)."""
    if stride == 1 or world == 1:
        return x
    chunk = x.size(-1) // (world * stride)
    # [..., o] -> [..., p, stride, chunk] -> [..., stride, p, chunk] -> [..., o]
    return x.unflatten(-1, (world, stride, chunk)).transpose(-3, -2).flatten(-3)


def _to_partition_order(x: torch.Tensor, world: int, stride: int) -> torch.Tensor:
    """Inverse of :func:`_to_master_order`: master order -> contiguous per-rank blocks."""
    if stride == 1 or world == 1:
        return x
    chunk = x.size(-1) // (world * stride)
    # [..., h] -> [..., stride, p, chunk] -> [..., p, stride, chunk] -> [..., h]
    return x.unflatten(-1, (stride, world, chunk)).transpose(-3, -2).flatten(-3)


class _LinearWithAsyncAllreduce(torch.autograd.Function):
    """``F.linear`` whose backward overlaps the TP all-reduce of the input grad with the weight-grad matmul."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)  # [s, b, h] -> [s, b, o/p]

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = handle = None
        if ctx.needs_input_grad[0]:
            grad_input = grad.matmul(
                weight
            )  # [s, b, o/p] @ [o/p, h] -> [s, b, h] (partial over TP)
            handle = all_reduce_sum_async_(grad_input, ctx.group)  # summed over TP while we go on
        grad_2d = grad.reshape(-1, grad.size(-1))  # [s*b, o/p]
        if ctx.needs_input_grad[1]:
            # dY^T X, the product autograd's linear backward forms, so the values match the sync path bit for bit
            grad_weight = grad_2d.t().mm(
                x.reshape(-1, x.size(-1))
            )  # [o/p, s*b] @ [s*b, h] -> [o/p, h]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_2d.sum(dim=0)  # [o/p]
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None


def linear_with_async_allreduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """``F.linear(copy_to_tensor_model_parallel_region(x), weight, bias)`` with the backward all-reduce of the input
    grad overlapped with the weight/bias grads (module docstring). ``x`` ``[s, b, h]`` replicated over TP."""
    return _LinearWithAsyncAllreduce.apply(x, weight, bias, resolve_group(group))


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its output rows: ``A = [A_0; ...; A_{p-1}]``.

    Input ``[s, b, h]`` replicated on the TP ranks (``[s/p, b, h]`` under sequence parallelism: all-gathered
    in forward, grads reduce-scattered). Output ``[s, b, o/p]`` (this rank's columns), or ``[s, b, o]`` with
    ``gather_output`` (in master order, also for ``stride > 1``). Backward all-reduces the input grad over TP,
    overlapped with the weight-grad matmul when ``tp.async_tensor_model_parallel_allreduce`` (the default).

    ``init`` fills the weight (:class:`WeightInit`); ``tp`` gives the group, sequence parallelism, the parameters'
    dtype and device and the async all-reduce choice (:class:`~megatron.mpu.context.TPSettings`).

    Attributes:
        weight: ``[o/p, h]``; bias ``[o/p]`` (zero), both partitioned on dim 0 with ``stride``.
    """

    lora_a: torch.Tensor
    """LoRA ``A`` (registered by ``megatron.model.lora.add_lora``; read only when ``self.lora`` is set)."""
    lora_b: torch.Tensor
    """LoRA ``B`` (likewise)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        gather_output: bool = False,
        init: WeightInit = WeightInit(),
        stride: int = 1,
        skip_bias_add: bool = False,
        tp: TPSettings = TPSettings(),
    ) -> None:
        super().__init__()
        self.group = resolve_group(tp.group)
        self.async_tensor_model_parallel_allreduce = tp.async_tensor_model_parallel_allreduce
        sequence_parallel, params_dtype, device = tp.sequence_parallel, tp.params_dtype, tp.device
        world, rank = group_world_size(self.group), group_rank(self.group)
        _check_partition("ColumnParallelLinear", "output_size", output_size, world, stride)
        if input_size < 1:
            raise ValueError(f"ColumnParallelLinear: input_size ({input_size}) must be >= 1")
        if gather_output and sequence_parallel:
            raise ValueError(
                "ColumnParallelLinear: gather_output=True cannot be combined with sequence_parallel=True "
                "(the output would be full on s and o); gather the output yourself or disable one"
            )
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = output_size // world
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel, self.stride, self.world_size = sequence_parallel, stride, world
        self.weight = torch.nn.Parameter(
            torch.empty(
                self.output_size_per_partition, input_size, dtype=params_dtype, device=device
            )
        )
        _init_weight(
            self.weight,
            full_shape=(output_size, input_size),
            partition_dim=0,
            stride=stride,
            init=init,
            rank=rank,
            world=world,
        )
        set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
        if bias:
            self.bias = torch.nn.Parameter(
                torch.zeros(self.output_size_per_partition, dtype=params_dtype, device=device)
            )
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)
        self.lora: LoraSpec | None = None  # set with lora_a, lora_b by model/lora.py's add_lora

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_`` ``[s, b, h]`` (``[s/p, b, h]`` with SP) -> ``(output, bias if skip_bias_add else None)``."""
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel and self.world_size > 1:
            # all-gather [s/p, b, h] -> [s, b, h] inside the matmul, keeping only the local input for backward
            output = linear_with_sequence_parallel_input(input_, self.weight, bias, self.group)
        elif self.async_tensor_model_parallel_allreduce and self.world_size > 1:
            output = linear_with_async_allreduce(
                input_, self.weight, bias, self.group
            )  # -> [s, b, o/p]
        else:
            # [s, b, h] unchanged; backward all-reduces the input grad
            x = copy_to_tensor_model_parallel_region(input_, self.group)
            output = F.linear(x, self.weight, bias)  # [s, b, h] -> [s, b, o/p]
        if self.lora is not None:
            output = output + column_parallel_lora(
                input_,
                self.lora_a,
                self.lora_b,
                self.lora,
                group=self.group,
                sequence_parallel=self.sequence_parallel and self.world_size > 1,
                training=self.training,
            )  # [s, b, o/p]
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.group)  # -> [s, b, o]
            output = _to_master_order(output, self.world_size, self.stride)
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its input columns: ``A = [A_0, ..., A_{p-1}]``.

    Input ``[s, b, h/p]`` with ``input_is_parallel`` (else ``[s, b, h]``, scattered here). The partial products
    are all-reduced over TP (output ``[s, b, o]``) or, under sequence parallelism, reduce-scattered on ``s``
    (output ``[s/p, b, o]``); the full bias ``[o]`` is added AFTER that reduction. Under sequence parallelism the
    bias goes through :func:`copy_to_tensor_model_parallel_region`, so its grad is summed over the TP ranks.

    ``init`` and ``tp`` as in :class:`ColumnParallelLinear` (``tp.async_tensor_model_parallel_allreduce`` does not
    apply: the output all-reduce is needed at once).

    Attributes:
        weight: ``[o, h/p]`` partitioned on dim 1 with ``stride``; bias ``[o]`` (zero), replicated.
    """

    lora_a: torch.Tensor
    """LoRA ``A`` (registered by ``megatron.model.lora.add_lora``; read only when ``self.lora`` is set)."""
    lora_b: torch.Tensor
    """LoRA ``B`` (likewise)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        input_is_parallel: bool = False,
        init: WeightInit = WeightInit(),
        stride: int = 1,
        skip_bias_add: bool = False,
        tp: TPSettings = TPSettings(),
    ) -> None:
        super().__init__()
        self.group = resolve_group(tp.group)
        sequence_parallel, params_dtype, device = tp.sequence_parallel, tp.params_dtype, tp.device
        world, rank = group_world_size(self.group), group_rank(self.group)
        _check_partition("RowParallelLinear", "input_size", input_size, world, stride)
        if output_size < 1:
            raise ValueError(f"RowParallelLinear: output_size ({output_size}) must be >= 1")
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel=True needs input_is_parallel=True "
                "(the input must come from a column-parallel layer)"
            )
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size // world
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel, self.stride, self.world_size = sequence_parallel, stride, world
        self.weight = torch.nn.Parameter(
            torch.empty(
                output_size, self.input_size_per_partition, dtype=params_dtype, device=device
            )
        )
        _init_weight(
            self.weight,
            full_shape=(output_size, input_size),
            partition_dim=1,
            stride=stride,
            init=init,
            rank=rank,
            world=world,
        )
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        if bias:
            self.bias = torch.nn.Parameter(
                torch.zeros(output_size, dtype=params_dtype, device=device)
            )
            set_tensor_model_parallel_attributes(self.bias, False, -1, 1)
            self.bias.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        self.lora: LoraSpec | None = None  # set with lora_a, lora_b by model/lora.py's add_lora

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``input_`` ``[s, b, h/p]`` (or ``[s, b, h]``) -> ``(output, bias if skip_bias_add else None)``."""
        if self.input_is_parallel:
            x = input_
        else:
            x = _to_partition_order(input_, self.world_size, self.stride)
            x = scatter_to_tensor_model_parallel_region(x, self.group)  # [s, b, h] -> [s, b, h/p]
        partial = F.linear(x, self.weight)  # [s, b, h/p] -> [s, b, o] (partial sum)
        if self.lora is not None:
            partial = partial + row_parallel_lora(
                x, self.lora_a, self.lora_b, self.lora, group=self.group, training=self.training
            )  # [s, b, o] (partial sum)
        if self.sequence_parallel:
            # [s, b, o] partial sums -> [s/p, b, o] summed
            output = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:
            output = reduce_from_tensor_model_parallel_region(partial, self.group)  # -> [s, b, o]
        bias: torch.Tensor | None = self.bias
        if bias is not None and self.sequence_parallel:
            bias = copy_to_tensor_model_parallel_region(bias, self.group)  # grad: sum over TP
        if self.skip_bias_add:
            return output, bias
        return (output + bias if bias is not None else output), None


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split by vocabulary rows: TP rank r owns rows ``[r*vp, (r+1)*vp)``.

    Forward: ids (any shape, e.g. ``[b, s]``, replicated on the TP ranks) -> ``[*ids.shape, h]``. Each rank looks
    up the ids it owns (zeros elsewhere) and the results are all-reduced over TP (exact: every output row is a
    sum of one value and zeros). Returns a tensor (not a tuple), as Megatron's embedding does.

    Ids outside ``[0, true_vocab_size)`` raise ValueError instead of silently embedding zeros (one device sync
    per call). Rows ``>= true_vocab_size`` (padding to a multiple of 128 * p) are initialized to zero.

    ``init`` fills the table (:class:`WeightInit`); of ``tp`` the group, the parameters' dtype and device apply
    (sequence parallelism is the caller's: it scatters the embeddings, as Megatron's language model does).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init: WeightInit = WeightInit(),
        true_vocab_size: int | None = None,
        tp: TPSettings = TPSettings(),
    ) -> None:
        super().__init__()
        self.group = resolve_group(tp.group)
        world, rank = group_world_size(self.group), group_rank(self.group)
        _check_partition(
            "VocabParallelEmbedding", "num_embeddings (padded vocab size)", num_embeddings, world
        )
        if embedding_dim < 1:
            raise ValueError(
                f"VocabParallelEmbedding: embedding_dim ({embedding_dim}) must be >= 1"
            )
        if true_vocab_size is not None and not 1 <= true_vocab_size <= num_embeddings:
            raise ValueError(
                f"VocabParallelEmbedding: true_vocab_size ({true_vocab_size}) must be in "
                f"[1, num_embeddings ({num_embeddings})]; the padded size must not be smaller than the tokenizer's"
            )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.true_vocab_size = true_vocab_size or num_embeddings
        self.world_size = world
        self.vocab_start_index, self.vocab_end_index = (
            VocabUtility.vocab_range_from_global_vocab_size(num_embeddings, rank, world)
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = torch.nn.Parameter(
            torch.empty(
                self.num_embeddings_per_partition,
                embedding_dim,
                dtype=tp.params_dtype,
                device=tp.device,
            )
        )
        _init_weight(
            self.weight,
            full_shape=(num_embeddings, embedding_dim),
            partition_dim=0,
            stride=1,
            init=init,
            rank=rank,
            world=world,
            true_rows=self.true_vocab_size,
        )
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"VocabParallelEmbedding: token ids must be integers, got {ids.dtype}")
        if ids.numel() == 0:
            return
        bad = (ids < 0) | (ids >= self.true_vocab_size)
        if bool(bad.any()):
            where = bad.nonzero()[0].tolist()
            raise ValueError(
                f"VocabParallelEmbedding: token id {int(ids[tuple(where)])} at index {where} is outside the "
                f"vocabulary [0, {self.true_vocab_size}); check that the data was tokenized with the same "
                "tokenizer (--vocab-file / --tokenizer-model) as the model"
            )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` ``[b, s]`` (any shape) -> embeddings ``[b, s, h]``, identical on every TP rank."""
        self._check_ids(input_ids)
        if self.world_size == 1:
            return F.embedding(input_ids, self.weight)  # [b, s] -> [b, s, h]
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight)  # [b, s] -> [b, s, h]
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        # [b, s, h], summed over TP: one rank's row plus zeros
        return reduce_from_tensor_model_parallel_region(partial, self.group)


def gather_full_parameter(param: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """The full (master-order) value of a TP parameter; a replicated one is returned as a detached copy."""
    group = resolve_group(group)
    world = group_world_size(group)
    if not getattr(param, "tensor_model_parallel", False) or world == 1:
        return param.detach().clone()
    dim, stride = param.partition_dim, param.partition_stride  # type: ignore[attr-defined]
    local = param.detach().transpose(0, dim).contiguous()  # partition dim first
    full = all_gather_first_dim(local, group)  # [n/p, ...] -> [n, ...] (rank order)
    full = _to_master_order(full.transpose(0, -1), world, stride).transpose(0, -1)
    return full.transpose(0, dim).contiguous()
