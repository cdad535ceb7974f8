"""Broadcast a batch from the TP source rank to the other ranks of its TP group.

Legend: ``p`` TP size. Only TP rank 0 reads data; the others receive identical tensors.
"""

from __future__ import annotations

import torch

from megatron.mpu.mappings import broadcast_, communication_device
from megatron.mpu.parallel_state import ProcessGroup, group_rank, group_world_size, resolve_group

_MAX_DIMS = 8
_ERROR = -1  # first size entry when the source rank found bad data: every rank raises, none hangs


def _sizes_on_source(
    keys: list[str], data: dict[str, torch.Tensor] | None, datatype: torch.dtype
) -> tuple[torch.Tensor, str | None]:
    sizes = torch.zeros(len(keys), 1 + _MAX_DIMS, dtype=torch.int64)
    for i, key in enumerate(keys):
        tensor = None if data is None else data.get(key)
        if tensor is None:
            problem = f"key {key!r} is missing from data (keys given: {sorted(data or {})})"
        elif tensor.dtype != datatype:
            problem = f"data[{key!r}] has dtype {tensor.dtype}, expected {datatype}"
        elif tensor.dim() > _MAX_DIMS:
            problem = f"data[{key!r}] has {tensor.dim()} dims; at most {_MAX_DIMS} are supported"
        else:
            sizes[i, 0] = tensor.dim()
            sizes[i, 1 : 1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            continue
        sizes[0, 0] = _ERROR
        return sizes, problem
    return sizes, None


def broadcast_data(
    keys: list[str],
    data: dict[str, torch.Tensor] | None,
    datatype: torch.dtype,
    group: ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Send ``data[key]`` for every key from TP rank 0 to its TP group.

    Args:
        keys: the same list, in the same order, on every rank.
        data: needed on TP rank 0 only (ignored elsewhere); every tensor must have dtype ``datatype``.
        datatype: dtype of all tensors (e.g. ``torch.int64`` for tokens).
        group: the TP group (default from parallel_state; without torch.distributed a world of 1).

    Returns:
        ``{key: tensor}`` on every rank, on the communication device (CUDA for NCCL, else CPU); in a group of
        one rank, ``data``'s own tensors.

    Raises:
        ValueError: on TP rank 0 when ``data`` lacks a key or has a wrong dtype; the other ranks raise
            RuntimeError at the same time instead of hanging.
    """
    group = resolve_group(group)
    if not keys:
        return {}
    if (
        group_world_size(group) == 1
    ):  # nothing to send: validate and keep the tensors where they are
        _, problem = _sizes_on_source(keys, data, datatype)
        # data is None only together with a problem (keys is not empty)
        if problem is not None or data is None:
            raise ValueError(f"broadcast_data: {problem}")
        return {key: data[key] for key in keys}
    device = communication_device(group)
    is_source = group_rank(group) == 0
    problem = None
    if is_source:
        sizes, problem = _sizes_on_source(keys, data, datatype)
    else:
        sizes = torch.zeros(len(keys), 1 + _MAX_DIMS, dtype=torch.int64)
    sizes = broadcast_(sizes.to(device), 0, group).cpu()
    if int(sizes[0, 0]) == _ERROR:
        if problem is not None:
            raise ValueError(f"broadcast_data: {problem}")
        raise RuntimeError(
            "broadcast_data: the TP source rank rejected its data (see its ValueError)"
        )
    shapes = [tuple(int(d) for d in row[1 : 1 + int(row[0])]) for row in sizes]
    numels = [int(torch.Size(shape).numel()) for shape in shapes]
    if is_source and data is not None:
        flat = torch.cat([data[k].reshape(-1).to(device) for k in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    flat = broadcast_(flat, 0, group)  # [sum of numels], identical on every TP rank
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for key, shape, numel in zip(keys, shapes, numels):
        out[key] = flat[offset : offset + numel].view(shape)
        offset += numel
    return out
