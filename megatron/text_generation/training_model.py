"""An :class:`InferenceEngine` over the training model's current weights, at the training layout.

Used by the evaluation during training (--eval-harness-tasks): every rank of the run builds one over its own
share of the model, sharing the parameters the optimizer steps (no copy, no checkpoint round trip)::

    PP = 1:  DeepSpeedEngine.module  (GPTModel)        -> GPTStage.from_model   (first and last stage)
    PP > 1:  PipelineEngine.module   (GPTModelPipe)    -> GPTStage.from_pipe    (this rank's stage)

The engine runs on the run's TP group (the model's own) and PP group. Data-parallel replicas are independent
copies of the same weights: each evaluates the same requests and gets the same results, so nothing is exchanged
over the data-parallel group. The caller holds the model in eval mode while the engine runs (dropout off) and back
in train mode afterwards; the engine itself runs under ``torch.no_grad`` and draws random numbers only from the
generators its requests carry.

Sequence parallelism, context parallelism, DeepSpeed-Ulysses and ZeRO-3 are refused at start-up
(``megatron/config/eval_harness.py``): their activations or parameters are split in a way generation cannot use.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.model.gpt_model import GPTModel
from megatron.model.stage import GPTStage
from megatron.mpu.parallel_state import ProcessGroup
from megatron.text_generation.engine import InferenceEngine


def training_stage(module: nn.Module) -> GPTStage:
    """The :class:`GPTStage` sharing ``module``'s parameters: a ``GPTModel`` or a DeepSpeed ``GPTModelPipe``.

    Raises:
        TypeError: ``module`` is neither.
    """
    if isinstance(module, GPTModel):
        return GPTStage.from_model(module)
    from megatron.model.gpt_model_pipe import GPTModelPipe  # imports DeepSpeed: only for a pipe

    if isinstance(module, GPTModelPipe):
        return GPTStage.from_pipe(module)
    raise TypeError(
        f"an inference engine over a training model needs a GPTModel or GPTModelPipe, not {type(module).__name__}."
    )


def training_inference_engine(
    module: nn.Module,
    *,
    pp_group: ProcessGroup | None,
    device: torch.device,
    micro_batch_size: int | None = None,
) -> InferenceEngine:
    """An :class:`InferenceEngine` over ``module`` (the training engine's ``module``) on this rank, in lockstep
    with the other stages of ``pp_group`` (the run's pipeline group; None at PP = 1). Its weights stay the
    training model's, as they are laid out (``own_weights=False``)."""
    return InferenceEngine(
        training_stage(module),
        pp_group=pp_group,
        device=device,
        micro_batch_size=micro_batch_size,
        own_weights=False,
    )
