"""Weights-only loading (``--finetune``) that DeepSpeed's ``load_checkpoint`` cannot do: across ZeRO-3 and the other
stages, and from ZeRO-3 at another data-parallel size.

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


def stage_family(stage: int) -> str:
    """How DeepSpeed stores a stage's state: ZeRO-0 (optimizer in the model-state file), 1/2 (per-DP optimizer
    files), 3 (per-DP model and optimizer files)."""
    return {0: "0", 1: "1/2", 2: "1/2"}.get(stage, "3")


def needs_own_weight_loader(saved_stage: int, run_stage: int, saved_dp: int, run_dp: int) -> bool:
    """Whether a weights-only load (PP = 1) must bypass ``engine.load_checkpoint``."""
    if (saved_stage == 3) != (run_stage == 3):
        return True
    return saved_stage == 3 and saved_dp != run_dp


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
    """Write ``weights`` into the parameters of ``engine.module`` (every rank passes the same values).

    Raises:
        ValueError: a parameter has no weight in ``weights`` or another shape.
    """
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param

    params = dict(engine.module.named_parameters())
    missing = sorted(set(params) - set(weights))
    if missing:
        raise ValueError(
            f"{source} has no weights for {', '.join(missing[:4])}; is it this model's checkpoint?"
        )
    for name, p in params.items():
        shape = tuple(getattr(p, "ds_shape", p.shape))
        value = weights[name]
        if tuple(value.shape) != shape:
            raise ValueError(f"{source}: {name} has shape {tuple(value.shape)}, the model {shape}.")
        zero3 = hasattr(
            p, "ds_id"
        )  # gathered, written on every rank, re-partitioned from rank 0's copy
        gathered = (
            deepspeed.zero.GatheredParameters([p], modifier_rank=0) if zero3 else nullcontext()
        )
        with gathered, torch.no_grad():
            p.data.copy_(value.to(device=p.device, dtype=p.dtype))
        # The optimizer's fp32 master copy (ZeRO-1/2/3, bf16): a no-op for a parameter without one.
        safe_set_full_fp32_param(p, value.to(device=p.device, dtype=torch.float32))
