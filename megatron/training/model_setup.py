"""Build the model, the torch optimizer and the DeepSpeed engine for a run.

PP = 1: ``GPTModel`` + ``DeepSpeedEngine`` with ``mpu=megatron.mpu`` (DeepSpeed then reduces gradients over our
data-parallel group and counts tensor-parallel shards once in the grad norm). PP > 1: ``GPTModelPipe`` on DeepSpeed's
``PipeModelDataParallelTopology(num_pp, num_mp=TP, num_dp)`` + ``PipelineEngine``; its grid must agree with
``parallel_state`` rank by rank (:func:`~megatron.training.initialize.check_pipe_grid`).

The model is built in fp32 (parameters drawn in fp32 from ``(seed, name)``); with --bf16/--fp16 DeepSpeed casts it
and keeps fp32 master weights in its optimizer wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from megatron import mpu
from megatron.config import TridentConfig
from megatron.training.ds_config import uses_pipeline_engine
from megatron.training.initialize import check_pipe_grid
from megatron.training.optimizer import build_optimizer


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
    cfg: TridentConfig, *, true_vocab: int, device: torch.device, world_size: int
) -> torch.nn.Module:
    """``GPTModel`` or ``GPTModelPipe`` for ``cfg`` with ``vocab_size = true_vocab``."""
    model_cfg = replace(cfg.model, vocab_size=true_vocab)
    seed = cfg.training.seed
    sp = cfg.parallel.sequence_parallel_enabled
    if not uses_pipeline_engine(cfg):
        from megatron.model import GPTModel

        return GPTModel(model_cfg, seed=seed, device=device, sequence_parallel=sp)
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from megatron.model import GPTModelPipe

    p = cfg.parallel
    topology = PipeModelDataParallelTopology(
        num_pp=p.pipeline_model_parallel_size,
        num_mp=p.tensor_model_parallel_size,
        num_dp=p.data_parallel_size(world_size),
    )
    interval = model_cfg.recompute_num_layers if model_cfg.recompute_granularity == "full" else 0
    return GPTModelPipe(
        model_cfg,
        seed=seed,
        topology=topology,
        params_dtype=torch.float32,
        device=device,
        sequence_parallel=sp,
        activation_checkpoint_interval=interval,
    )


def build_engine(
    cfg: TridentConfig,
    ds_config: dict[str, Any],
    *,
    true_vocab: int,
    device: torch.device,
    world_size: int,
) -> EngineBundle:
    """Model + torch optimizer (Megatron param groups) + ``deepspeed.initialize``."""
    import deepspeed

    model = build_model(cfg, true_vocab=true_vocab, device=device, world_size=world_size)
    optimizer = build_optimizer(model, cfg.training)
    is_pipe = uses_pipeline_engine(cfg)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        mpu=None if is_pipe else mpu,
        config=ds_config,
    )
    if is_pipe:
        check_pipe_grid(engine.grid)
    _keep_fp32_clip_norm(engine)
    return EngineBundle(engine=engine, client_optimizer=optimizer, is_pipe=is_pipe)


def _keep_fp32_clip_norm(engine: Any) -> None:
    """Make the plain fp32 ZeRO-0 path remember the grad norm it clips with.

    DeepSpeed 0.19.8's ``clip_fp32_gradients`` (fp32, ZeRO-0, clipping on) computes the global norm with
    ``runtime.utils.clip_grad_norm_`` and throws it away, so ``get_global_grad_norm()`` stays None there. This
    instance-level wrapper makes the same call and keeps the result; nothing else changes.
    """
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_and_keep() -> None:
        norm = clip_grad_norm_(
            parameters=engine.module.parameters(),
            max_norm=engine.gradient_clipping(),
            mpu=engine.mpu,
        )
        engine._global_grad_norm = norm

    engine.clip_fp32_gradients = clip_and_keep


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
