"""Expert-parallel (EP) and expert-data-parallel (EDP) groups of DeepSpeed-MoE, as DeepSpeed builds them from our grid.

Legend: ``p`` TP size, ``pp`` pipeline stages, ``dp`` data-parallel size, ``ep`` --moe-expert-parallel-size,
``E`` experts of a layer, ``E/ep`` experts per EP rank.

DeepSpeed creates the groups itself when the engine is built (``MoE.set_deepspeed_parallelism`` ->
``deepspeed.utils.groups``), from the ``mpu`` we pass (our ``parallel_state``; the pipeline engine's grid under PP);
this module only *lists* them, so the model can place its experts before the engine exists (a rank's local experts
are ``ep_rank * E/ep .. (ep_rank + 1) * E/ep - 1``) and a test can hold the two together. Our dense grid is
``rank = pp_rank*(dp*p) + dp_rank*p + tp_rank`` (``parallel_state``); each pipeline stage is a block of ``dp*p``
consecutive ranks, and DeepSpeed builds EP/EDP groups inside each block. Two orders, chosen by
``--enable-expert-tensor-parallelism``:

* **Whole experts** (default; DeepSpeed's ``_create_expert_and_data_parallel``): EP groups are runs of ``ep``
  *consecutive* ranks, so with TP > 1 an EP group spans the TP ranks of a replica first. Every TP rank holds whole
  experts; DeepSpeed's MoE layer splits the (TP-replicated) dispatched tokens over TP ranks (``drop_tokens``), so
  each TP rank sends only its share to the all-to-all, and gathers them back after. EDP groups: the ranks
  ``start + i, start + i + ep, ...`` of a stage block (the same EP rank in every EP group), over which expert
  gradients are averaged.
* **TP-split experts** (``--enable-expert-tensor-parallelism``; ``_create_expert_data_and_model_parallel``): EP
  groups are runs of ``ep`` consecutive ranks *of a data-parallel group* (the same TP rank), EDP groups zip them.

Worked example: world 8, p = 2, pp = 1 (dp = 4), ep = 2::

    TP groups [0,1] [2,3] [4,5] [6,7]      DP groups [0,2,4,6] [1,3,5,7]
    whole experts:  EP  [0,1] [2,3] [4,5] [6,7]          EDP [0,2,4,6] [1,3,5,7]
                    (EP rank = tp rank here: rank 0 holds experts 0..E/2-1, rank 1 experts E/2..E-1)
    TP-split:       EP  [0,2] [4,6] [1,3] [5,7]          EDP [0,4] [2,6] [1,5] [3,7]
                    (EP rank = dp rank % 2; each expert's shards live on the two TP ranks of one replica)

With pp = 2 the same lists hold in each stage block (stage 1: add 8). MoE with DeepSpeed-Ulysses is refused
(``config/moe_rules.py``), so the Ulysses axis is 1 here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron.mpu.parallel_state import ProcessGroup


@dataclass(frozen=True)
class ExpertGroups:
    """Every EP and EDP group of a layout (global ranks, in DeepSpeed's creation order)."""

    expert_parallel: tuple[tuple[int, ...], ...]
    """Groups the all-to-all of tokens runs over; each holds all ``E`` experts of a layer between its ranks."""
    expert_data_parallel: tuple[tuple[int, ...], ...]
    """Groups over which an expert's gradients are averaged (ranks holding the same experts)."""

    def group_of(self, rank: int, *, data: bool = False) -> tuple[int, ...]:
        """The EP group (or EDP group, ``data=True``) holding ``rank``."""
        groups = self.expert_data_parallel if data else self.expert_parallel
        return next(g for g in groups if rank in g)


def expert_parallel_groups(
    *,
    world_size: int,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    expert_parallel_size: int,
    expert_tensor_parallel: bool,
) -> ExpertGroups:
    """The EP and EDP groups DeepSpeed builds for this layout (see the module docstring).

    The caller guarantees the divisibility ``validate()`` checks: ``ep`` divides ``dp = world / (p * pp)``.
    """
    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_parallel_size
    stage = world_size // pp
    ep_groups: list[tuple[int, ...]] = []
    edp_groups: list[tuple[int, ...]] = []
    if not expert_tensor_parallel or tp == 1:
        for start in range(0, world_size, stage):
            edp_groups += [tuple(range(start + i, start + stage, ep)) for i in range(ep)]
        ep_groups = [tuple(range(i * ep, (i + 1) * ep)) for i in range(world_size // ep)]
        return ExpertGroups(tuple(ep_groups), tuple(edp_groups))
    dp = stage // tp
    for start in range(0, world_size, stage):
        for t in range(tp):
            dp_ranks = list(range(start + t, start + stage, tp))  # one data-parallel group
            parts = [tuple(dp_ranks[i : i + ep]) for i in range(0, dp, ep)]
            ep_groups += parts
            edp_groups += [tuple(g) for g in zip(*parts, strict=True)]
    return ExpertGroups(tuple(ep_groups), tuple(edp_groups))


def expert_parallel_rank(
    rank: int,
    *,
    world_size: int,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    expert_parallel_size: int,
    expert_tensor_parallel: bool,
) -> int:
    """``rank``'s index in its EP group: its local experts are ``ep_rank * E/ep`` .. ``(ep_rank + 1) * E/ep - 1``."""
    groups = expert_parallel_groups(
        world_size=world_size,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        expert_parallel_size=expert_parallel_size,
        expert_tensor_parallel=expert_tensor_parallel,
    )
    return groups.group_of(rank).index(rank)


_SELF_GROUP: tuple[Any, ProcessGroup] | None = None


def single_rank_group() -> ProcessGroup:
    """A group of this rank alone: the "TP group" of whole experts, which every TP rank holds entirely.

    Created once per torch.distributed job with local synchronization (only this rank takes part), so ranks need
    not create it in step.
    """
    global _SELF_GROUP
    world = dist.group.WORLD
    if _SELF_GROUP is None or _SELF_GROUP[0] is not world:
        group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        _SELF_GROUP = (world, group)
    return _SELF_GROUP[1]
