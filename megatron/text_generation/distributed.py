"""Process groups and the per-rank model for generation at a TP x PP layout (launched like training).

    torchrun --nproc-per-node 4 tools/generate_text.py --load ckpt --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --prompt "..."

:func:`init_inference_distributed` reads the launcher's environment (torchrun, the ``deepspeed`` launcher, ``srun``;
nothing = one process), checks the layout against the checkpoint and the world size before any group exists (every
rank raises the same error, none hangs), creates the default group (gloo on CPU, NCCL on CUDA) and the
``parallel_state`` groups, and returns an :class:`InferenceLayout` (this rank's device and its TP / PP groups).
:func:`load_stage` takes those groups, builds this rank's :class:`GPTStage` and reads only its share of the
checkpoint (``megatron.checkpointing.stage_reader``). With one process nothing distributed is created and the
layout has no groups (the whole model).

    layout = init_inference_distributed(tp, pp, ckpt_dir=ckpt)
    gen = TextGenerator.from_checkpoint(ckpt, device=layout.device, layout=layout)
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron.checkpointing.checksums import sizes_only
from megatron.checkpointing.lora import read_stage_lora_base
from megatron.checkpointing.readers import read_checkpoint_config
from megatron.checkpointing.stage_reader import read_stage_weights
from megatron.config import ModelConfig
from megatron.launch.device import local_device, requested_device
from megatron.launch.rendezvous import ensure_rendezvous_env
from megatron.layout.pipeline import split_layers_for_pp
from megatron.model.stage import GPTStage
from megatron.model.utils import check_tensor_parallel_shapes
from megatron.mpu import parallel_state
from megatron.mpu.context import ParallelContext
from megatron.mpu.parallel_state import ProcessGroup, group_rank, group_world_size

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InferenceLayout:
    """What :func:`init_inference_distributed` set up for this rank, passed to :func:`load_stage`."""

    device: torch.device
    """This rank's device."""
    tp_group: ProcessGroup | None = None
    """This rank's tensor-parallel group (None: one process, TP = 1)."""
    pp_group: ProcessGroup | None = None
    """This rank's pipeline group (None: one process, one stage)."""


def resolve_layout(
    tensor_model_parallel_size: int | None,
    pipeline_model_parallel_size: int | None,
    *,
    world_size: int,
    config: ModelConfig,
    saved: tuple[int, int],
) -> tuple[int, int]:
    """``(TP, PP)`` for generation: the flags, else the checkpoint's layout when it fills the world, else
    TP = world / PP.

    Raises:
        ValueError: TP x PP differs from the number of processes, a size < 1, or the model does not split so.
    """
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if tp is None and pp is None and saved[0] * saved[1] == world_size:
        tp, pp = saved
    pp = pp or 1
    if tp is None:
        tp = max(1, world_size // pp)
    if tp < 1 or pp < 1:
        raise ValueError(
            f"--tensor-model-parallel-size ({tp}) and --pipeline-model-parallel-size ({pp}) must be >= 1."
        )
    if tp * pp != world_size:
        raise ValueError(
            f"--tensor-model-parallel-size ({tp}) x --pipeline-model-parallel-size ({pp}) = {tp * pp} ranks, "
            f"but {world_size} processes were launched; generation has no data parallelism, so launch "
            f"{tp * pp} processes (torchrun --nproc-per-node {tp * pp}) or change the sizes."
        )
    check_tensor_parallel_shapes(config, tp)
    split_layers_for_pp(config.num_layers, pp)  # raises for more stages than layers
    return tp, pp


def init_inference_distributed(
    tensor_model_parallel_size: int | None,
    pipeline_model_parallel_size: int | None,
    *,
    ckpt_dir: str | Path,
    tag: str | None = None,
    device: str | None = None,
    timeout_minutes: float = 30.0,
) -> InferenceLayout:
    """Join the launched job (if any) and build the TP/PP groups; returns this rank's device and groups.

    Raises:
        ValueError / FileNotFoundError: see :func:`resolve_layout`; no checkpoint at ``ckpt_dir``; a CUDA device
            asked for without one.
    """
    _, config, meta = read_checkpoint_config(ckpt_dir, tag)
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ or "SLURM_NTASKS" in os.environ:
        ensure_rendezvous_env()
    world = (
        dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    )
    saved = (int(meta["tensor_model_parallel_size"]), int(meta["pipeline_model_parallel_size"]))
    tp, pp = resolve_layout(
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        world_size=world,
        config=config,
        saved=saved,
    )
    dev = local_device(requested_device(device))
    if world == 1 and not dist.is_initialized():
        return InferenceLayout(device=dev)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if dev.type == "cuda" else "gloo",
            timeout=timedelta(minutes=timeout_minutes),
        )
    state = parallel_state.initialize_model_parallel(
        tp, pp, timeout=timedelta(minutes=timeout_minutes)
    )
    if dist.get_rank() == 0:
        logger.info(
            "generation at TP = %d x PP = %d (checkpoint saved at TP = %d x PP = %d)",
            tp,
            pp,
            *saved,
        )
    return InferenceLayout(
        device=dev,
        tp_group=state.get_tensor_model_parallel_group(),
        pp_group=state.get_pipeline_model_parallel_group(),
    )


def destroy_inference_distributed() -> None:
    """Tear down what :func:`init_inference_distributed` created (nothing in one process)."""
    parallel_state.destroy_model_parallel()  # forgets the default state; a no-op when there is none
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def load_stage(
    ckpt_dir: str | Path,
    tag: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp_group: ProcessGroup | None = None,
    pp_group: ProcessGroup | None = None,
    verify_checksums: bool = True,
) -> tuple[GPTStage, ModelConfig, dict[str, Any]]:
    """This rank's stage of the checkpoint (eval mode) at the layout of ``tp_group`` x ``pp_group`` (an
    :class:`InferenceLayout`'s; None, None: the whole model): ``(stage, config, meta)``. The files read are
    checked against their recorded SHA-256 (``verify_checksums=False``: sizes only).

    Raises:
        FileNotFoundError / ValueError: no checkpoint, a missing or damaged file of this stage.
    """
    found, config, meta = read_checkpoint_config(ckpt_dir, tag)
    pp, pp_rank = group_world_size(pp_group), group_rank(pp_group)
    layers = split_layers_for_pp(config.num_layers, pp)[pp_rank]
    parallel = ParallelContext(seed=0, tp_group=tp_group, params_dtype=dtype, device=device)
    first, last = pp_rank == 0, pp_rank == pp - 1
    stage = GPTStage(config, parallel, layers=layers, pre_process=first, post_process=last)
    weights = read_stage_weights(
        Path(ckpt_dir) / found,
        meta if verify_checksums else sizes_only(meta),
        config,
        tp=parallel.tp_size,
        tp_rank=parallel.tp_rank,
        layers=layers,
        pre_process=first,
        post_process=last,
    )
    # an adapter checkpoint (--lora-rank): the adapters over the base it records
    base = read_stage_lora_base(
        ckpt_dir,
        meta,
        config,
        tp=(parallel.tp_size, parallel.tp_rank),
        layers=layers,
        pre_process=first,
        post_process=last,
        verify_checksums=verify_checksums,
    )
    stage.load_state_dict({**base, **weights}, strict=True)
    return stage.eval(), config, meta
