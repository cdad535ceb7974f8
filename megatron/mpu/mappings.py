"""Every torch.distributed collective of Trident: autograd-aware region functions and plain helpers.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``p`` TP size (ranks in the group), ``v`` vocab.

Region functions (Megatron's names) move activations in and out of tensor-parallel regions; each one's backward
is the adjoint of its forward. All take ``group=None`` meaning the TP group (see
:func:`megatron.mpu.parallel_state.resolve_group`) and are no-ops on a group of one rank. Last-dim splits and
gathers are the TP layout of hidden/vocab features; first-dim ones the sequence-parallel layout of ``[s, b, h]``.

Plain helpers (no autograd) serve the cross-entropy, broadcast_data, activation checkpointing and the collective
benchmark (``megatron/diagnostics/comm_bench.py``); :func:`ring_exchange_async` the ring of context-parallel
attention (``megatron/model/context_parallel.py``, which states what travels in forward and backward).

Observing: inside ``with observe_collectives(fn):`` every tensor collective issued here calls
``fn(op, nbytes, group)`` first (``benchmarks/bench_memory_plan.py`` counts bytes per group with it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist

from megatron.mpu.parallel_state import ProcessGroup, group_rank, group_world_size, resolve_group

# torch 2.13 renamed the "tensor" collectives; keep working on the older names (setup.py allows torch >= 2.1).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

CollectiveOp = Literal[
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
    "send",
    "recv",
]
"""The ``torch.distributed`` operation a reported collective runs (by its long-standing torch name)."""

CollectiveObserver = Callable[[CollectiveOp, int, ProcessGroup | None], None]
"""``observer(op, nbytes, group)``: see :func:`observe_collectives`."""

_observers: list[CollectiveObserver] = []


@contextmanager
def observe_collectives(observer: CollectiveObserver) -> Iterator[None]:
    """While inside, call ``observer(op, nbytes, group)`` just before every tensor collective of this module.

    ``nbytes`` is the size of the whole exchange: an all-gather's gathered output, a reduce-scatter's input, the
    tensor itself otherwise (all-reduce, all-to-all, broadcast, send, recv). Not reported: calls on a group of one
    rank (they return before any collective) and the pickled-object ones (``all_gather_object``,
    ``broadcast_object``). The observer runs on the calling thread, in autograd's backward too; it must not issue
    collectives itself. Observers nest (each sees every call); with none registered the cost is one list check
    per collective.
    """
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


def _report(op: CollectiveOp, nbytes: int, group: ProcessGroup | None) -> None:
    for observer in tuple(_observers):
        observer(op, nbytes, group)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _check_divisible(x: torch.Tensor, dim: int, world: int, what: str) -> int:
    if x.size(dim) % world != 0:
        raise ValueError(
            f"{what}: dimension {dim} of a tensor of shape {tuple(x.shape)} is not divisible by the "
            f"tensor-model-parallel size {world}; pad the sequence / hidden size to a multiple of {world}"
        )
    return x.size(dim) // world


# --- private collectives (each returns a new tensor; the input is never modified) ---------------------------


def _reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if group_world_size(group) == 1:
        return x
    out = x.clone()
    if _observers:
        _report("all_reduce", _nbytes(out), group)
    dist.all_reduce(out, group=group)  # [...] -> [...] summed over the group
    return out


def _split_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    world = group_world_size(group)
    if world == 1:
        return x
    chunk = _check_divisible(x, -1, world, "split along the last dimension")
    rank = group_rank(group)
    return x[..., rank * chunk : (rank + 1) * chunk].contiguous()  # [..., h] -> [..., h/p]


def _gather_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    world = group_world_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    if _observers:
        _report("all_gather", world * _nbytes(x), group)
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)  # p x [..., h/p] -> [..., h]


def _split_first(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    world = group_world_size(group)
    if world == 1:
        return x
    chunk = _check_divisible(x, 0, world, "split along the sequence dimension")
    rank = group_rank(group)
    return x[rank * chunk : (rank + 1) * chunk].contiguous()  # [s, b, h] -> [s/p, b, h]


def _gather_first(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    world = group_world_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    out = torch.empty((world * x.size(0), *x.shape[1:]), dtype=x.dtype, device=x.device)
    if _observers:
        _report("all_gather_into_tensor", _nbytes(out), group)
    _all_gather_single(out, x, group=group)  # [s/p, b, h] -> [s, b, h]
    return out


def _reduce_scatter_first(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    world = group_world_size(group)
    if world == 1:
        return x
    chunk = _check_divisible(x, 0, world, "reduce-scatter along the sequence dimension")
    x = x.contiguous()
    out = torch.empty((chunk, *x.shape[1:]), dtype=x.dtype, device=x.device)
    if _observers:
        _report("reduce_scatter_tensor", _nbytes(x), group)
    _reduce_scatter_single(out, x, group=group)  # [s, b, h] -> [s/p, b, h] summed over the group
    return out


# --- autograd functions ------------------------------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)  # a view, so a Parameter input is fine

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        return _reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_first(grad, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup | None, tensor_parallel_output_grad: bool
    ) -> torch.Tensor:
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_first(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first(grad, ctx.group), None, None
        return _split_first(grad, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_first(grad, ctx.group), None


class _LinearWithSequenceParallelInput(torch.autograd.Function):
    """All-gather on s fused with the matmul: keeps only the local ``[s/p, b, h]`` input for backward."""

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
        total = _gather_first(x, group)  # [s/p, b, h] -> [s, b, h], not kept
        return torch.nn.functional.linear(total, weight, bias)  # [s, b, h] -> [s, b, o/p]

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            full = grad.matmul(weight)  # [s, b, o/p] @ [o/p, h] -> [s, b, h] (partial over TP)
            grad_input = _reduce_scatter_first(full, ctx.group)  # -> [s/p, b, h]
        grad_2d = grad.reshape(-1, grad.size(-1))  # [s*b, o/p]
        if ctx.needs_input_grad[1]:
            total = _gather_first(x, ctx.group)  # gathered again: [s/p, b, h] -> [s, b, h]
            grad_weight = grad_2d.t().matmul(total.reshape(-1, total.size(-1)))  # [o/p, h]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_2d.sum(dim=0)  # [o/p]
        return grad_input, grad_weight, grad_bias, None


# --- public region functions -------------------------------------------------------------------------------


def copy_to_tensor_model_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """forward: identity; backward: all-reduce (sum) over the TP group. Also for Parameters (SP norm weights)."""
    group = resolve_group(group)
    if not torch.is_grad_enabled() and group_world_size(group) == 1:
        return x  # nothing to record, nothing to reduce (generation at TP = 1)
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """forward: all-reduce (sum) over the TP group; backward: identity."""
    group = resolve_group(group)
    if not torch.is_grad_enabled() and group_world_size(group) == 1:
        return x
    return _ReduceFromRegion.apply(x, group)


def reduce_from_ulysses_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """forward: all-reduce (sum) over the Ulysses sequence-parallel ``group`` (None: one rank); backward: identity.

    For the loss sum and token count of a sequence split over the group (``model.utils.loss_func``): every rank
    then holds the whole sequence's mean, and its backward covers its own tokens only; DeepSpeed sums the
    parameter gradients over the group (sequence-data-parallel reduction), which completes them.
    """
    if group is None or group_world_size(group) == 1:
        return x
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """forward: split the last dim, keep this rank's chunk ``[..., h] -> [..., h/p]``; backward: all-gather (last dim)."""
    return _ScatterToRegion.apply(x, resolve_group(group))


def gather_from_tensor_model_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """forward: all-gather (last dim) ``[..., h/p] -> [..., h]``; backward: split (last dim)."""
    return _GatherFromRegion.apply(x, resolve_group(group))


def scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """forward: split dim 0, keep this rank's chunk ``[s, b, h] -> [s/p, b, h]``; backward: all-gather (dim 0)."""
    return _ScatterToSequenceRegion.apply(x, resolve_group(group))


def gather_from_sequence_parallel_region(
    x: torch.Tensor, tensor_parallel_output_grad: bool = True, group: ProcessGroup | None = None
) -> torch.Tensor:
    """forward: all-gather (dim 0) ``[s/p, b, h] -> [s, b, h]``; backward: reduce-scatter (dim 0), or split if the flag is False.

    ``tensor_parallel_output_grad=True`` when the gathered tensor feeds a TP region (each rank's grad is a
    partial sum); ``False`` when the consumer is replicated (every rank already holds the full grad).
    """
    return _GatherFromSequenceRegion.apply(x, resolve_group(group), tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """forward: reduce-scatter (dim 0) ``[s, b, h] -> [s/p, b, h]``; backward: all-gather (dim 0)."""
    return _ReduceScatterToSequenceRegion.apply(x, resolve_group(group))


def linear_with_sequence_parallel_input(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """forward: all-gather ``x`` (dim 0) then ``x W^T + b``; backward: re-gather ``x`` for the weight grad, reduce-scatter (dim 0) the input grad.

    Same values as ``F.linear(gather_from_sequence_parallel_region(x), weight, bias)`` but saves only the local
    ``[s/p, b, h]`` input for backward instead of the gathered ``[s, b, h]`` (one more all-gather in backward),
    as Megatron's column-parallel layers do under sequence parallelism.
    """
    return _LinearWithSequenceParallelInput.apply(x, weight, bias, resolve_group(group))


# --- plain helpers (no autograd) ---------------------------------------------------------------------------


def all_reduce_sum_(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """In place: sum ``tensor`` over the group (default TP); returns it."""
    group = resolve_group(group)
    if group_world_size(group) > 1:
        if _observers:
            _report("all_reduce", _nbytes(tensor), group)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_sum_async_(tensor: torch.Tensor, group: ProcessGroup | None = None) -> Any | None:
    """In place, asynchronously: start summing ``tensor`` over the group (default TP); returns the handle whose
    ``wait()`` completes it (None on a group of one rank: nothing to wait for). ``tensor`` must not be read or
    written until then."""
    group = resolve_group(group)
    if group_world_size(group) == 1:
        return None
    if _observers:
        _report("all_reduce", _nbytes(tensor), group)
    # [...] -> [...] summed over the group, once wait() returns
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_reduce_max_(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """In place: element-wise max of ``tensor`` over the group (default TP); returns it."""
    group = resolve_group(group)
    if group_world_size(group) > 1:
        if _observers:
            _report("all_reduce", _nbytes(tensor), group)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def broadcast_(
    tensor: torch.Tensor, src_group_rank: int = 0, group: ProcessGroup | None = None
) -> torch.Tensor:
    """In place: overwrite ``tensor`` with the one of group rank ``src_group_rank`` (default TP group)."""
    group = resolve_group(group)
    if group is not None and group_world_size(group) > 1:
        if _observers:
            _report("broadcast", _nbytes(tensor), group)
        dist.broadcast(tensor, src=dist.get_global_rank(group, src_group_rank), group=group)
    return tensor


def all_gather_first_dim(tensor: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0, in group-rank order (no autograd)."""
    return _gather_first(tensor, resolve_group(group))


def all_gather_into_(
    out: torch.Tensor, x: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Into ``out`` (preallocated, ``p`` times ``x`` along dim 0): every rank's ``x`` in group-rank order (no autograd)."""
    group = resolve_group(group)
    if group_world_size(group) == 1:
        return out.copy_(x)
    if _observers:
        _report("all_gather_into_tensor", _nbytes(out), group)
    _all_gather_single(out, x.contiguous(), group=group)  # p x [n, ...] -> [p*n, ...]
    return out


def reduce_scatter_into_(
    out: torch.Tensor, x: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Into ``out`` (preallocated, ``x`` split ``p`` ways on dim 0): this rank's chunk summed over the group (no autograd)."""
    group = resolve_group(group)
    world = group_world_size(group)
    if world == 1:
        return out.copy_(x)
    _check_divisible(x, 0, world, "reduce-scatter along dim 0")
    if _observers:
        _report("reduce_scatter_tensor", _nbytes(x), group)
    _reduce_scatter_single(out, x.contiguous(), group=group)  # [p*n, ...] -> [n, ...] summed
    return out


def all_to_all_into_(
    out: torch.Tensor, x: torch.Tensor, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Into ``out`` (shaped like ``x``): chunk ``i`` of ``x`` (dim 0) goes to group rank ``i``; chunk ``j`` of ``out`` came from rank ``j``."""
    group = resolve_group(group)
    world = group_world_size(group)
    if world == 1:
        return out.copy_(x)
    _check_divisible(x, 0, world, "all-to-all along dim 0")
    if _observers:
        _report("all_to_all_single", _nbytes(x), group)
    dist.all_to_all_single(out, x.contiguous(), group=group)  # [p*n, ...] -> [p*n, ...] by rank
    return out


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in group-rank order (default TP group)."""
    group = resolve_group(group)
    if group_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * group_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def communication_device(group: ProcessGroup | None = None) -> torch.device:
    """Where tensors must live for collectives on ``group``: the current CUDA device for NCCL, else CPU."""
    group = resolve_group(group)
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --- pipeline point-to-point and object broadcast (generation) ------------------------------------------------


def send_to_group_rank(tensor: torch.Tensor, dst_group_rank: int, group: ProcessGroup) -> Any:
    """Start sending ``tensor`` to group rank ``dst_group_rank`` (e.g. the next pipeline stage); returns the handle
    whose ``wait()`` completes it. ``tensor`` must not be written until then."""
    if _observers:
        _report("send", _nbytes(tensor), group)
    return dist.isend(
        tensor.contiguous(), dst=dist.get_global_rank(group, dst_group_rank), group=group
    )


def recv_from_group_rank(
    buffer: torch.Tensor, src_group_rank: int, group: ProcessGroup
) -> torch.Tensor:
    """Fill ``buffer`` (its shape and dtype agreed with the sender) from group rank ``src_group_rank``."""
    if _observers:
        _report("recv", _nbytes(buffer), group)
    dist.recv(buffer, src=dist.get_global_rank(group, src_group_rank), group=group)
    return buffer


def send_recv_(
    send: torch.Tensor,
    dst_group_rank: int,
    recv: torch.Tensor,
    src_group_rank: int,
    group: ProcessGroup,
) -> torch.Tensor:
    """Send ``send`` to group rank ``dst_group_rank`` while filling ``recv`` from ``src_group_rank`` (one batch, so a
    ring of ranks that all send first cannot deadlock on NCCL); returns ``recv`` once both are done."""
    if _observers:
        _report("send", _nbytes(send), group)
        _report("recv", _nbytes(recv), group)
    ops = [
        dist.P2POp(
            dist.isend, send.contiguous(), dist.get_global_rank(group, dst_group_rank), group
        ),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, src_group_rank), group),
    ]
    for handle in dist.batch_isend_irecv(ops):  # [...] -> dst; src -> [...]
        handle.wait()
    return recv


class RingExchange:
    """An exchange started by :func:`ring_exchange_async`: ``wait()`` completes it and returns the received
    tensors (the sent ones stay referenced, so unwritten, until then)."""

    def __init__(self, sent: list[torch.Tensor], received: list[torch.Tensor], handles: list[Any]):
        self._sent, self._received, self._handles = sent, received, handles

    def wait(self) -> list[torch.Tensor]:
        """Block until every send and receive of the exchange is done; the tensors from the previous rank."""
        for handle in self._handles:
            handle.wait()
        self._handles, self._sent = [], []
        return self._received


def ring_exchange_async(
    tensors: list[torch.Tensor], group: ProcessGroup | None, tag: int = 0
) -> RingExchange:
    """Start sending ``tensors`` to the next rank of ``group`` (group rank ``r + 1`` mod ``p``) while receiving
    same-shaped ones from the previous (``r - 1``); ``wait()`` on the result returns them.

    One ``batch_isend_irecv`` per exchange, so a ring where every rank sends first cannot deadlock on NCCL.
    Exchanges in flight at once must be started in the same order on every rank; on gloo tensor ``i`` travels
    with tag ``tag + i`` (give overlapping exchanges distinct tags). A group of one rank: the tensors themselves.
    """
    world = group_world_size(group)
    if group is None or world == 1:
        return RingExchange(tensors, tensors, [])
    rank = group_rank(group)
    dst = dist.get_global_rank(group, (rank + 1) % world)
    src = dist.get_global_rank(group, (rank - 1) % world)
    sent = [x.contiguous() for x in tensors]
    received = [torch.empty_like(x) for x in sent]
    ops = []
    for i, (out, into) in enumerate(zip(sent, received, strict=True)):
        if _observers:
            _report("send", _nbytes(out), group)
            _report("recv", _nbytes(into), group)
        ops.append(dist.P2POp(dist.isend, out, dst, group, tag + i))  # [...] -> rank r+1
        ops.append(dist.P2POp(dist.irecv, into, src, group, tag + i))  # rank r-1 -> [...]
    return RingExchange(sent, received, dist.batch_isend_irecv(ops))


def broadcast_object(obj: Any, src_group_rank: int = 0, group: ProcessGroup | None = None) -> Any:
    """Group rank ``src_group_rank``'s picklable ``obj`` on every rank of ``group`` (default: the world); the
    argument is ignored elsewhere. Identity without torch.distributed or on a group of one rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    size = dist.get_world_size(group)
    if size == 1:
        return obj
    box = [obj]
    src = src_group_rank if group is None else dist.get_global_rank(group, src_group_rank)
    dist.broadcast_object_list(box, src=src, group=group, device=communication_device(group))
    return box[0]
