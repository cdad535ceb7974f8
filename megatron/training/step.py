"""One optimizer step (forward + backward over every micro-batch of a global batch, then the update).

Two engines (see ``ds_config`` for the choice):

* PP = 1, ``DeepSpeedEngine`` around ``GPTModel``: for each of the ``gas`` micro-batches
  ``loss = masked mean of the per-token loss``, ``engine.backward(loss)`` (DeepSpeed scales by 1/gas and averages
  gradients over DP), ``engine.step()`` (the update happens at the accumulation boundary). The reported loss is the
  mean over micro-batches, averaged over the data-parallel group.
* PP > 1, DeepSpeed ``PipelineEngine`` around ``GPTModelPipe``: ``engine.train_batch(iterator)`` pulls ``gas``
  micro-batches ``((input_ids, position_ids[, document_ids]), (labels, loss_mask))`` on the first/last stages, runs
  1F1B, and returns the loss already averaged over micro-batches and DP and broadcast to every stage.

Packed documents (``--reset-attention-mask``): a batch carries ``document_ids [b, S]`` and the model gets
``PackedDocuments(ids)`` as its ``attention_mask`` (at PP > 1 the ids travel in the pipe tuple); no ``[s, s]`` mask.

Context parallelism x DeepSpeed-Ulysses (Ulysses: PP = 1 only): each rank holds ``s/N`` tokens of every sample
(``N = cp * sp``); the micro-batch loss is the mean over the WHOLE sequence (sum and token count reduced over the
CP x Ulysses group in ``loss_func``), and the gradients are summed over that group: DeepSpeed reduces them over its
sequence-data-parallel group (DP x CP x SP) divided by ``dp * cp``, and ``loss_func`` multiplies the backward by
``cp`` (ZeRO-3 with Ulysses: ``ulysses.py``), so the step equals the ``N = 1`` step.

--sft: the loss masks hold the weights of the global per-token mean (``token_weights.py``) and the loss of a
micro-batch is their weighted SUM (``loss_reduction="sum"``): the same averaging over micro-batches and DP then
gives the mean over every loss token of the global batch, at PP 1 and PP > 1.

Either way the loss is the GLOBAL-batch mean: every micro-batch is a fixed slice of the global batch whatever the
layout, so the number is identical (to rounding) on every layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from megatron.deepspeed_internals import loss_scale
from megatron.model.moe import clear_moe_state, moe_aux_loss
from megatron.model.token_layout import PackedDocuments
from megatron.model.utils import loss_func
from megatron.mpu.mappings import all_reduce_sum_
from megatron.mpu.parallel_state import ParallelState, ProcessGroup, group_world_size
from megatron.training.moe_log import ExpertLoad, collect_expert_load
from megatron.training.timers import Timers
from megatron.training.ulysses import ulysses_backward_scale

Batch = dict[str, torch.Tensor]
Reduction = Literal["mean", "sum"]


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
    moe_loss: float | None = None
    """Global-batch mean of the MoE term added to the LM loss (--moe-loss-coeff x summed aux losses; None: dense)."""
    expert_load: ExpertLoad | None = None
    """Tokens per expert and dropped tokens of each MoE layer over the global batch (None: dense)."""


@dataclass(frozen=True)
class StepGroups:
    """The process groups a step reduces over, taken once from the run's ``ParallelState``."""

    data_parallel: ProcessGroup
    """The loss is averaged over it (DeepSpeed reduces the gradients over it itself)."""
    pipeline: ProcessGroup
    """The MoE term of a pipeline batch is summed over its stages."""
    sequence: ProcessGroup | None
    """The CP x DeepSpeed-Ulysses group when its size is > 1: the loss sums its tokens over it; else None."""
    tensor_parallel_size: int
    """TP ranks route the same tokens: the expert load is divided by it."""
    ulysses_size: int = 1
    """DeepSpeed-Ulysses degree (ZeRO-3's backward scale, ``ulysses.py``)."""
    context_parallel_size: int = 1
    """Context-parallel degree (the backward scale of ``loss_func``)."""

    @classmethod
    def of(cls, state: ParallelState) -> StepGroups:
        """The groups of ``state`` (``initialize_model_parallel``'s result)."""
        split = state.get_context_sequence_parallel_world_size() > 1
        return cls(
            data_parallel=state.get_data_parallel_group(),
            pipeline=state.get_pipeline_model_parallel_group(),
            sequence=state.get_context_sequence_parallel_group() if split else None,
            tensor_parallel_size=state.get_tensor_model_parallel_world_size(),
            ulysses_size=state.get_sequence_parallel_world_size(),
            context_parallel_size=state.get_context_parallel_world_size(),
        )


def model_attention_mask(batch: Batch) -> torch.Tensor | PackedDocuments | None:
    """The model's ``attention_mask`` for ``batch``: packed documents (``document_ids [b, S]``, whole under
    Ulysses) as :class:`PackedDocuments`, else the dense mask the batch carries, else None (causal)."""
    ids = batch.get("document_ids")
    return PackedDocuments(ids) if ids is not None else batch.get("attention_mask")


def _forward_loss(
    engine: Any, batch: Batch, groups: StepGroups, reduction: Reduction = "mean"
) -> torch.Tensor:
    per_token = engine(
        batch["tokens"],
        batch["position_ids"],
        attention_mask=model_attention_mask(batch),
        labels=batch["labels"],
    )  # [b, s] fp32 ([b, s/N] split over CP x Ulysses)
    return loss_func(
        per_token,
        batch["loss_mask"],
        sequence_parallel_group=groups.sequence,
        context_parallel_size=groups.context_parallel_size,
        reduction=reduction,
    )


def _grad_norm(engine: Any) -> float | None:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if isinstance(norm, torch.Tensor) else norm)


def dp_mean(value: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Average a scalar tensor over the data-parallel ``group``."""
    total = all_reduce_sum_(value.detach().clone(), group=group)
    return total / group_world_size(group)


def train_step_engine(
    engine: Any,
    micro_batches: Iterator[Batch],
    gas: int,
    *,
    groups: StepGroups,
    explicit_boundary: bool = False,
    timers: Timers | None = None,
    loss_reduction: Reduction = "mean",
) -> StepResult:
    """One step with ``DeepSpeedEngine`` (PP = 1): ``gas`` micro-batches from ``micro_batches``.

    ``loss_reduction="sum"``: the loss masks hold --sft's global per-token weights (``token_weights.py``).

    ``explicit_boundary``: mark the last micro-batch as the accumulation boundary instead of DeepSpeed's
    ``micro_steps % gas`` count, which is off once the batch size changed (--rampup-batch-size).
    ``timers`` (``timers.py``): forward-backward and optimizer (level 1; the update is the last ``engine.step()``),
    batch-generator, forward-compute, backward-compute (level 2, per micro-batch). ``groups``: the run's groups.
    """
    timers = timers if timers is not None else Timers()
    fwd_bwd, opt = timers("forward-backward", 1), timers("optimizer", 1)
    batch_gen, fwd, bwd = (
        timers(n, 2) for n in ("batch-generator", "forward-compute", "backward-compute")
    )
    engine.train()
    total = torch.zeros((), dtype=torch.float32, device=engine.device)
    backward_scale = ulysses_backward_scale(
        engine, groups.ulysses_size
    )  # 1 except ZeRO-3 + Ulysses (``ulysses.py``)
    moe_total: torch.Tensor | None = None  # MoE term summed over micro-batches
    fwd_bwd.start()
    for i in range(gas):
        if explicit_boundary:
            engine.set_gradient_accumulation_boundary(i == gas - 1)
        batch_gen.start()
        batch = next(micro_batches)
        batch_gen.stop()
        fwd.start()
        clear_moe_state(engine.module)
        loss = _forward_loss(engine, batch, groups, loss_reduction)
        moe_loss = moe_aux_loss(engine.module)  # --moe-loss-coeff x the layers' aux losses, or None
        fwd.stop()
        bwd.start()
        objective = loss if moe_loss is None else loss + moe_loss
        engine.backward(objective if backward_scale == 1.0 else objective * backward_scale)
        bwd.stop()
        if i == gas - 1:
            fwd_bwd.stop()
            opt.start()
        engine.step()
        total += loss.detach().float()
        if moe_loss is not None:
            moe_total = moe_loss.detach() + (0.0 if moe_total is None else moe_total)
    opt.stop()
    dp = groups.data_parallel
    loss_mean = dp_mean(total / gas, dp)
    return StepResult(
        loss=float(loss_mean.item()),
        grad_norm=_grad_norm(engine),
        skipped=not engine.was_step_applied(),
        loss_scale=loss_scale(engine),
        moe_loss=None if moe_total is None else float(dp_mean(moe_total / gas, dp).item()),
        expert_load=_expert_load(engine, groups.tensor_parallel_size),
    )


def train_step_pipe(
    engine: Any, pipe_batches: Iterator[Any], groups: StepGroups, timers: Timers | None = None
) -> StepResult:
    """One step with DeepSpeed's ``PipelineEngine``; ``pipe_batches`` yields its micro-batch tuples.

    forward-backward starts here and stops at the engine's OptimizerStep instruction (``install_pipe_timers``).
    """
    if timers is not None:
        timers("forward-backward", 1).start()
    record = getattr(engine.module, "moe_losses", None)
    if record is not None:
        record.clear()
    loss = float(engine.train_batch(data_iter=pipe_batches).float().item())
    moe = _pipe_moe_loss(engine, groups)
    return StepResult(
        loss=loss if moe is None else loss - moe,  # the engine's loss includes the MoE term
        grad_norm=_grad_norm(engine),
        skipped=not engine.was_step_applied(),
        loss_scale=loss_scale(engine),
        moe_loss=moe,
        expert_load=_expert_load(engine, groups.tensor_parallel_size),
    )


def _expert_load(engine: Any, tp_size: int) -> ExpertLoad | None:
    """This step's expert load (a collective over every rank; None for a dense model)."""
    cfg = engine.module.config
    return collect_expert_load(
        engine.module, cfg.num_layers, cfg.moe.experts_per_layer(cfg.num_layers), tp_size=tp_size
    )


def _pipe_moe_loss(engine: Any, groups: StepGroups) -> float | None:
    """The MoE term of the last pipeline batch (mean over micro-batches and DP), on every stage; None: dense.

    The last stage's loss_fn recorded each micro-batch's term (``GPTModelPipe.moe_losses``); the other stages
    contribute 0 to a sum over the pipeline group.
    """
    model = engine.module
    if not model.config.moe.is_moe(model.config.num_layers):
        return None
    record = model.moe_losses
    mean = torch.stack(record).float().mean() if record else torch.zeros(())
    if engine.is_last_stage():
        value = dp_mean(mean.to(engine.device), groups.data_parallel)
    else:
        value = mean.zero_()
    total = all_reduce_sum_(value.reshape(1).clone(), group=groups.pipeline)
    return float(total.item())


@torch.no_grad()
def eval_step_engine(
    engine: Any,
    micro_batches: Iterator[Batch],
    gas: int,
    groups: StepGroups,
    loss_reduction: Reduction = "mean",
) -> float:
    """Validation loss of one global batch with ``DeepSpeedEngine`` (mean over micro-batches and DP)."""
    engine.eval()
    total = torch.zeros((), dtype=torch.float32, device=engine.device)
    for _ in range(gas):
        total += _forward_loss(engine, next(micro_batches), groups, loss_reduction).float()
    return float(dp_mean(total / gas, groups.data_parallel).item())


def eval_step_pipe(engine: Any, pipe_batches: Iterator[Any], groups: StepGroups) -> float:
    """Validation loss of one global batch with the pipeline engine (already averaged, on every stage)."""
    record = getattr(engine.module, "moe_losses", None)
    if record is not None:
        record.clear()
    loss = float(engine.eval_batch(data_iter=pipe_batches).float().item())
    moe = _pipe_moe_loss(engine, groups)
    return loss if moe is None else loss - moe  # the LM loss, as eval_step_engine reports
