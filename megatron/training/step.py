"""One optimizer step (forward + backward over every micro-batch of a global batch, then the update).

Two engines (see ``ds_config`` for the choice):

* PP = 1, ``DeepSpeedEngine`` around ``GPTModel``: for each of the ``gas`` micro-batches
  ``loss = masked mean of the per-token loss``, ``engine.backward(loss)`` (DeepSpeed scales by 1/gas and averages
  gradients over DP), ``engine.step()`` (the update happens at the accumulation boundary). The reported loss is the
  mean over micro-batches, averaged over the data-parallel group.
* PP > 1, DeepSpeed ``PipelineEngine`` around ``GPTModelPipe``: ``engine.train_batch(iterator)`` pulls ``gas``
  micro-batches ``((input_ids, position_ids), (labels, loss_mask))`` on the first/last stages, runs 1F1B, and returns
  the loss already averaged over micro-batches and DP and broadcast to every stage.

Either way the loss is the GLOBAL-batch mean: every micro-batch is a fixed slice of the global batch whatever the
layout, so the number is identical (to rounding) on every layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron import mpu
from megatron.deepspeed_internals import loss_scale
from megatron.model.utils import loss_func
from megatron.mpu.mappings import all_reduce_sum_
from megatron.training.timers import Timers

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports."""

    loss: float
    """Global-batch mean LM loss."""
    grad_norm: float | None
    """Global grad norm before clipping (None when DeepSpeed did not compute one, e.g. clipping off)."""
    skipped: bool
    """True when the fp16 loss scaler skipped the update."""
    loss_scale: float
    """Current loss scale (1.0 without fp16)."""


def _forward_loss(engine: Any, batch: Batch) -> torch.Tensor:
    per_token = engine(
        batch["tokens"],
        batch["position_ids"],
        attention_mask=batch.get("attention_mask"),
        labels=batch["labels"],
    )  # [b, s] fp32
    return loss_func(per_token, batch["loss_mask"])


def _grad_norm(engine: Any) -> float | None:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if isinstance(norm, torch.Tensor) else norm)


def dp_mean(value: torch.Tensor) -> torch.Tensor:
    """Average a scalar tensor over the data-parallel group."""
    total = all_reduce_sum_(value.detach().clone(), group=mpu.get_data_parallel_group())
    return total / mpu.get_data_parallel_world_size()


def train_step_engine(
    engine: Any,
    micro_batches: Iterator[Batch],
    gas: int,
    *,
    explicit_boundary: bool = False,
    timers: Timers | None = None,
) -> StepResult:
    """One step with ``DeepSpeedEngine`` (PP = 1): ``gas`` micro-batches from ``micro_batches``.

    ``explicit_boundary``: mark the last micro-batch as the accumulation boundary instead of DeepSpeed's
    ``micro_steps % gas`` count, which is off once the batch size changed (--rampup-batch-size).
    ``timers`` (``timers.py``): forward-backward and optimizer (level 1; the update is the last ``engine.step()``),
    batch-generator, forward-compute, backward-compute (level 2, per micro-batch).
    """
    timers = timers if timers is not None else Timers()
    fwd_bwd, opt = timers("forward-backward", 1), timers("optimizer", 1)
    batch_gen, fwd, bwd = (
        timers(n, 2) for n in ("batch-generator", "forward-compute", "backward-compute")
    )
    engine.train()
    total = torch.zeros((), dtype=torch.float32, device=engine.device)
    fwd_bwd.start()
    for i in range(gas):
        if explicit_boundary:
            engine.set_gradient_accumulation_boundary(i == gas - 1)
        batch_gen.start()
        batch = next(micro_batches)
        batch_gen.stop()
        fwd.start()
        loss = _forward_loss(engine, batch)
        fwd.stop()
        bwd.start()
        engine.backward(loss)
        bwd.stop()
        if i == gas - 1:
            fwd_bwd.stop()
            opt.start()
        engine.step()
        total += loss.detach().float()
    opt.stop()
    loss_mean = dp_mean(total / gas)
    return StepResult(
        loss=float(loss_mean.item()),
        grad_norm=_grad_norm(engine),
        skipped=not engine.was_step_applied(),
        loss_scale=loss_scale(engine),
    )


def train_step_pipe(
    engine: Any, pipe_batches: Iterator[Any], timers: Timers | None = None
) -> StepResult:
    """One step with DeepSpeed's ``PipelineEngine``; ``pipe_batches`` yields its micro-batch tuples.

    forward-backward starts here and stops at the engine's OptimizerStep instruction (``install_pipe_timers``).
    """
    if timers is not None:
        timers("forward-backward", 1).start()
    loss = engine.train_batch(data_iter=pipe_batches)
    return StepResult(
        loss=float(loss.float().item()),
        grad_norm=_grad_norm(engine),
        skipped=not engine.was_step_applied(),
        loss_scale=loss_scale(engine),
    )


@torch.no_grad()
def eval_step_engine(engine: Any, micro_batches: Iterator[Batch], gas: int) -> float:
    """Validation loss of one global batch with ``DeepSpeedEngine`` (mean over micro-batches and DP)."""
    engine.eval()
    total = torch.zeros((), dtype=torch.float32, device=engine.device)
    for _ in range(gas):
        total += _forward_loss(engine, next(micro_batches)).float()
    return float(dp_mean(total / gas).item())


def eval_step_pipe(engine: Any, pipe_batches: Iterator[Any]) -> float:
    """Validation loss of one global batch with the pipeline engine (already averaged, on every stage)."""
    loss = engine.eval_batch(data_iter=pipe_batches)
    return float(loss.float().item())
