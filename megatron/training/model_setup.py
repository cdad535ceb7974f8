"""Build the model, the torch optimizer and the DeepSpeed engine for a run.

PP = 1: ``GPTModel`` + ``DeepSpeedEngine`` with ``mpu=`` the run's ``ParallelState`` (DeepSpeed then reduces gradients over our
data-parallel group and counts tensor-parallel shards once in the grad norm). PP > 1: ``GPTModelPipe`` on DeepSpeed's
``PipeModelDataParallelTopology(num_pp, num_mp=TP, num_dp=DP x CP)`` + ``PipelineEngine``; its grid must agree with
``parallel_state`` rank by rank (:func:`~megatron.training.initialize.check_pipe_grid`). With context parallelism
DeepSpeed's "data" axis is DP x CP (CP sits between DP and TP in our rank order): it averages the gradients over
``dp * cp`` ranks, which ``loss_func``'s backward scale by ``cp`` turns into the sum over CP and the mean over DP.

The model is built in fp32 (parameters drawn in fp32 from ``(seed, name)``) on the run's TP group, given explicitly
through a ``ParallelContext`` built from the run's ``ParallelState``; with --bf16/--fp16 DeepSpeed casts it and keeps fp32 master weights in its optimizer
wrapper. Under ZeRO-3 (PP = 1) it is built inside ``deepspeed.zero.Init`` instead (``zero_init.py``): partitioned over
DP as each module is built, directly in the run's dtype (the same fp32 draw, cast).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from megatron.config import ModelConfig, ParallelConfig, RunPlan, TrainingConfig
from megatron.deepspeed_internals import keep_fp32_clip_norm, skip_single_rank_allreduce
from megatron.model import GPTModel
from megatron.model.gpt_model_pipe import GPTModelPipe
from megatron.model.lora import freeze_base
from megatron.mpu.context import ParallelContext
from megatron.training.activation_checkpointing import configure_deepspeed_checkpointing
from megatron.training.initialize import Distributed, check_pipe_grid
from megatron.training.optimizer import build_optimizer
from megatron.training.zero_init import uses_zero3_init, zero3_init, zero3_params_dtype

logger = logging.getLogger(__name__)


@dataclass
class EngineBundle:
    """The engine and what the loop needs next to it."""

    engine: Any
    """DeepSpeedEngine or PipelineEngine."""
    client_optimizer: torch.optim.Optimizer
    """The torch optimizer we built (its param groups receive the LR each iteration)."""
    is_pipe: bool
    """True for the pipeline engine."""


def build_model(
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    plan: RunPlan,
    run: Distributed,
    *,
    seed: int,
    ds_config: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """``GPTModel`` or ``GPTModelPipe`` of ``model_cfg`` (vocabulary = the plan's true one), on the TP group of
    ``run.state`` with the build settings of ``parallel``; parameters drawn from ``(seed, name)``.

    With ``ds_config`` and ZeRO-3 (PP = 1) the model is built inside ``deepspeed.zero.Init`` (partitioned over DP as
    it is built; ``zero_init.py``); without ``ds_config`` it is built whole (conversion tools, tests).
    """
    model_cfg = replace(model_cfg, vocab_size=plan.true_vocab_size)
    zero3_config = ds_config if ds_config is not None and uses_zero3_init(plan) else None
    params_dtype = torch.float32 if zero3_config is None else zero3_params_dtype(zero3_config)
    ctx = ParallelContext.from_state(
        run.state, parallel, seed=seed, params_dtype=params_dtype, device=run.device
    )
    if zero3_config is not None:
        with zero3_init(zero3_config, run.state, params_dtype=params_dtype):
            return GPTModel(model_cfg, ctx)
    if not plan.pipeline_engine:
        return GPTModel(model_cfg, ctx)
    topology = PipeModelDataParallelTopology(
        num_pp=plan.pipeline_model_parallel_size,
        num_mp=plan.tensor_model_parallel_size,
        num_dp=plan.data_parallel_size * plan.context_parallel_size,
    )  # CP ranks sit between DP and TP (parallel_state): DeepSpeed's "data" axis is DP x CP
    interval = model_cfg.recompute_num_layers if model_cfg.recompute_granularity == "full" else 0
    return GPTModelPipe(model_cfg, ctx, topology=topology, activation_checkpoint_interval=interval)


def build_engine(
    model_cfg: ModelConfig,
    training: TrainingConfig,
    parallel: ParallelConfig,
    plan: RunPlan,
    ds_config: dict[str, Any],
    run: Distributed,
    *,
    model: torch.nn.Module | None = None,
) -> EngineBundle:
    """Model (``model``, or :func:`build_model` with ``ds_config``: inside ``zero.Init`` under ZeRO-3) + torch
    optimizer (Megatron param groups, ``training``) + ``deepspeed.initialize`` with ``mpu=run.state``."""
    import deepspeed

    configure_deepspeed_checkpointing(
        model_cfg, run.state
    )  # before the first forward; no-op without the flag
    if model is None:
        model = build_model(model_cfg, parallel, plan, run, seed=training.seed, ds_config=ds_config)
    if model_cfg.lora.enabled:  # the optimizer (and ZeRO's partitions) then hold the adapters only
        trainable, frozen = freeze_base(model)
        logger.info(
            "LoRA: %d trainable adapter parameters, %d frozen on this rank (%.2f%%)",
            trainable,
            frozen,
            100.0 * trainable / (trainable + frozen),
        )
    optimizer = build_optimizer(model, training, moe_groups=model_cfg.moe.create_moe_param_group)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        mpu=None if plan.pipeline_engine else run.state,
        config=ds_config,
    )
    if plan.pipeline_engine:
        check_pipe_grid(engine.grid, run.state)
    keep_fp32_clip_norm(engine)
    skip_single_rank_allreduce(engine)
    return EngineBundle(engine=engine, client_optimizer=optimizer, is_pipe=plan.pipeline_engine)


def optimizers_for_lr(bundle: EngineBundle) -> list[Any]:
    """Every optimizer object whose ``param_groups`` must carry the scheduled LR (deduplicated by group identity).

    DeepSpeed's wrappers (ZeRO, BF16_Optimizer, FP16 optimizers) expose their own ``param_groups``; some share the
    client's group dicts, some copy them. Writing the LR into both is harmless and always right.
    """
    seen: set[int] = set()
    out: list[Any] = []
    for opt in (getattr(bundle.engine, "optimizer", None), bundle.client_optimizer):
        groups = getattr(opt, "param_groups", None)
        if not groups:
            continue
        key = id(groups[0])
        if key not in seen:
            seen.add(key)
            out.append(opt)
    return out
