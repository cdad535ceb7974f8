"""Loading weights without optimizer state (``--finetune``, ``--no-load-optim``) where DeepSpeed's ``load_checkpoint``
cannot: across ZeRO-3 and the other stages, from ZeRO-3 at another data-parallel size, and ZeRO-3 to ZeRO-3 (where
DeepSpeed reads the tag ``latest`` names instead of the one asked for, and mixes up TP ranks' files).

DeepSpeed names its model-state files by stage (ZeRO-3: ``zero_pp_rank_D_mp_rank_TT_model_states.pt`` holding
placeholders, the weights living in the fp32 optimizer partitions; ZeRO-0/1/2: ``mp_rank_TT_model_states.pt``), and
an engine of one kind looks only for its own. Here the TP rank's full weights are read offline (``zero3.py`` for
ZeRO-3, the ``module`` of ``mp_rank_TT_model_states.pt`` otherwise) and written into the engine's parameters: the
working copy (gathered and re-partitioned under ZeRO-3) and the optimizer's fp32 master copy when there is one.
Pipelines (PP > 1) never need this: their layer files are the same at every stage and ZeRO-3 refuses pipelines.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.safe_load import torch_load_checkpoint_file
from megatron.checkpointing.zero3 import is_zero3_checkpoint, read_zero3_tp_shard
from megatron.deepspeed_internals import (
    full_shape,
    is_zero3_partitioned,
    per_parameter_masters,
    refresh_master_copy,
    set_linked_master,
)


def stage_family(stage: int) -> str:
    """How DeepSpeed stores a stage's state: ZeRO-0 (optimizer in the model-state file), 1/2 (per-DP optimizer
    files), 3 (per-DP model and optimizer files)."""
    return {0: "0", 1: "1/2", 2: "1/2"}.get(stage, "3")


def saved_zero_stage(tag_dir: Path, meta: dict[str, Any], default: int = 1) -> int:
    """The ZeRO stage a checkpoint was saved with: ``meta["zero_stage"]``, or for checkpoints written before it
    was recorded, 3 when ZeRO-3 files are present and ``default`` otherwise."""
    if "zero_stage" in meta:
        return int(meta["zero_stage"])
    return 3 if is_zero3_checkpoint(tag_dir) else default


def needs_own_weight_loader(saved_stage: int, run_stage: int, optimizer_state: bool) -> bool:
    """Whether a load (PP = 1) must bypass ``engine.load_checkpoint``: whenever ZeRO-3 is on either side and the
    optimizer state is not loaded (``--finetune``, ``--no-load-optim``). DeepSpeed's loader cannot cross between
    ZeRO-3 and the other stages or ZeRO-3 data-parallel sizes, and for ZeRO-3 without optimizer state it reads the
    tag named by ``latest`` (not the one asked for) and cannot tell TP ranks' files apart."""
    return not optimizer_state and 3 in (saved_stage, run_stage)


def read_tp_rank_weights(
    tag_dir: Path,
    meta: dict[str, Any],
    tp_rank: int,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """The full fp32 weights of TP rank ``tp_rank`` (TP-local shapes, module names) of a PP = 1 checkpoint.

    Raises:
        FileNotFoundError: a model- or optimizer-state file is missing.
        ValueError: a file cannot be read safely, or holds no weights.
    """
    if is_zero3_checkpoint(tag_dir, meta):
        return read_zero3_tp_shard(tag_dir, tp_rank, progress)
    path = tag_dir / f"mp_rank_{tp_rank:02d}_model_states.pt"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing (checkpoint saved at TP = {meta.get('tensor_model_parallel_size')}); "
            "copy the whole checkpoint directory."
        )
    module = torch_load_checkpoint_file(path).get("module") or {}
    if not module:
        raise ValueError(f"{path} holds no module weights; is the checkpoint complete?")
    return {k: v.float() for k, v in module.items()}


def assign_weights(engine: Any, weights: dict[str, torch.Tensor], source: str) -> None:
    """Write ``weights`` into the parameters of ``engine.module`` (every rank passes the same values), and into the
    optimizer's fp32 master copy when there is one, so the first step starts from them.

    The master copy is set exactly from ``weights`` where DeepSpeed links it to the parameter (ZeRO-1/2 and its
    bf16 optimizer) or keeps it per parameter (its unfused fp16/bf16 optimizer at ZeRO-0); under ZeRO-3 it is
    refreshed from the re-partitioned working copy (exact in fp32; bf16 rounds, as DeepSpeed's own weights-only
    load does).

    Raises:
        ValueError: a parameter has no weight in ``weights`` or another shape.
    """
    import deepspeed

    params = dict(engine.module.named_parameters())
    missing = sorted(set(params) - set(weights))
    if missing:
        raise ValueError(
            f"{source} has no weights for {', '.join(missing[:4])}; is it this model's checkpoint?"
        )
    masters = per_parameter_masters(engine.optimizer)
    zero3 = False
    for name, p in params.items():
        shape = full_shape(p)
        value = weights[name]
        if tuple(value.shape) != shape:
            raise ValueError(f"{source}: {name} has shape {tuple(value.shape)}, the model {shape}.")
        # ZeRO-3: gathered, written, re-partitioned from rank 0's copy.
        partitioned = is_zero3_partitioned(p)
        zero3 = zero3 or partitioned
        gather = deepspeed.zero.GatheredParameters
        gathered = gather([p], modifier_rank=0) if partitioned else nullcontext()
        with gathered, torch.no_grad():
            p.data.copy_(value.to(device=p.device, dtype=p.dtype))
        if partitioned:
            continue  # master copy refreshed below
        fp32 = value.to(device=p.device, dtype=torch.float32)
        if not set_linked_master(p, fp32) and id(p) in masters:
            with torch.no_grad():
                masters[id(p)].copy_(fp32.view_as(masters[id(p)]))
    if zero3:
        # DeepSpeed's per-parameter setter overruns the last rank's piece when DP does not divide a size.
        refresh_master_copy(engine.optimizer)


def refresh_master_weights(engine: Any) -> None:
    """After loading weights without optimizer state (``--no-load-optim``): the optimizer's fp32 master copy,
    where DeepSpeed keeps one, takes the loaded weights (DeepSpeed does this itself for ZeRO-1/2/3, but not for
    its ZeRO-0 low-precision optimizer, whose first step would otherwise bring back the initial weights)."""
    refresh_master_copy(engine.optimizer)
