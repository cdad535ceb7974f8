"""``RunPlan``: every value a run derives from its flags, its world size, its device and its tokenizer, computed once.

The preflight (``megatron.training.preflight``) builds it before any process group exists, after ``validate()``;
everything downstream (the DeepSpeed config, the checkpoint rules, the engine, the data iterators, the loop) takes
the plan instead of recomputing from ``(cfg, world_size)``:

    plan = RunPlan.build(cfg, world_size=8, device_type="cuda", true_vocab=50257)
    plan.data_parallel_size, plan.global_batch_size, plan.gradient_accumulation_steps, plan.train_iters,
    plan.zero_stage, plan.padded_vocab_size, ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.config.arguments import TridentConfig
from megatron.config.batch_rampup import BatchRampup
from megatron.config.rules import padded_vocab_size
from megatron.config.training import TrainingConfig

Precision = Literal["fp32", "bf16", "fp16"]


def global_batch_size(cfg: TridentConfig, world_size: int) -> int:
    """--global-batch-size, or micro batch x data-parallel size when the flag is absent."""
    t = cfg.training
    if t.global_batch_size is not None:
        return t.global_batch_size
    return t.micro_batch_size * cfg.parallel.data_parallel_size(world_size)


def effective_zero_stage(cfg: TridentConfig) -> int:
    """The ZeRO stage DeepSpeed runs: --zero-stage, except 0 becomes 1 with a pipeline and gradient clipping.

    DeepSpeed 0.19.8 computes a wrong global grad norm for ZeRO-0 pipelines with clipping (non-TP parameters of every
    stage but the first are dropped from the norm); ZeRO-1's norm is right, the numerics are otherwise the same and
    memory only shrinks.
    """
    stage = cfg.parallel.zero_stage
    if stage == 0 and cfg.parallel.pipeline_model_parallel_size > 1 and cfg.training.clip_grad > 0:
        return 1
    return stage


def train_samples_and_iters(t: TrainingConfig, global_batch: int) -> tuple[int, int]:
    """(total training samples, total iterations) from --train-iters or --train-samples.

    Raises:
        ValueError: neither is given, or --train-samples is less than one global batch.
    """
    if t.train_iters is not None:
        return t.train_iters * global_batch, t.train_iters
    if t.train_samples is not None:
        # Megatron: train_iters = train_samples // global batch (a partial last batch is not trained).
        if t.train_samples < global_batch:
            raise ValueError(
                f"--train-samples ({t.train_samples}) is less than one global batch ({global_batch}); "
                "train at least one batch."
            )
        if t.rampup_batch_size:
            # Megatron's count: the ramp's iterations, then whole global batches.
            ramp = BatchRampup.parse(t.rampup_batch_size, global_batch)
            return t.train_samples, ramp.train_iters(t.train_samples)
        return t.train_samples, t.train_samples // global_batch
    raise ValueError("give --train-iters or --train-samples (how long to train).")


def precision_of(cfg: TridentConfig) -> Precision:
    """The run's training precision: ``bf16``, ``fp16`` or ``fp32``."""
    return "bf16" if cfg.training.bf16 else "fp16" if cfg.training.fp16 else "fp32"


@dataclass(frozen=True)
class RunPlan:
    """The derived values of one run (all ranks compute the same plan)."""

    world_size: int
    """Processes in the job."""
    device_type: str
    """``cuda`` or ``cpu``."""
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    """world size / (TP x PP x CP x Ulysses SP): :meth:`ParallelConfig.data_parallel_size`, the one definition."""
    micro_batch_size: int
    global_batch_size: int
    """Samples per optimizer step (--global-batch-size, or micro batch x DP)."""
    gradient_accumulation_steps: int
    """Micro-batches per rank per optimizer step: global / (micro x DP)."""
    train_samples: int
    train_iters: int
    zero_stage: int
    """The ZeRO stage DeepSpeed runs (:func:`effective_zero_stage`)."""
    requested_zero_stage: int
    """--zero-stage as given."""
    pipeline_engine: bool
    """PP > 1: ``GPTModelPipe`` under DeepSpeed's PipelineEngine (else ``GPTModel`` under DeepSpeedEngine)."""
    sequence_parallel: bool
    """Sequence parallelism in effect (--sequence-parallel at TP > 1)."""
    true_vocab_size: int
    """The tokenizer's vocabulary."""
    padded_vocab_size: int
    """The model's vocabulary rows: padded to a multiple of --make-vocab-size-divisible-by x TP."""
    precision: Precision
    context_parallel_size: int = 1
    """--context-parallel-size: ranks splitting each sequence (DeepSpeed's pipeline grid counts them as DP)."""

    @property
    def zero_stage_raised(self) -> bool:
        """True when --zero-stage 0 runs as ZeRO-1 (pipeline + clipping, see :func:`effective_zero_stage`)."""
        return self.zero_stage != self.requested_zero_stage

    @classmethod
    def build(
        cls, cfg: TridentConfig, *, world_size: int, device_type: str = "cpu", true_vocab: int
    ) -> RunPlan:
        """The plan of ``cfg`` on ``world_size`` ranks (call after ``validate``, which guarantees divisibility).

        Raises:
            ValueError: no run length (--train-iters / --train-samples), or a non-positive vocabulary.
        """
        p, t = cfg.parallel, cfg.training
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        dp = p.data_parallel_size(world_size)
        gbs = global_batch_size(cfg, world_size)
        samples, iters = train_samples_and_iters(t, gbs)
        return cls(
            world_size=world_size,
            device_type=device_type,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            data_parallel_size=dp,
            micro_batch_size=t.micro_batch_size,
            global_batch_size=gbs,
            gradient_accumulation_steps=gbs // (t.micro_batch_size * dp),
            train_samples=samples,
            train_iters=iters,
            zero_stage=effective_zero_stage(cfg),
            requested_zero_stage=p.zero_stage,
            pipeline_engine=pp > 1,
            sequence_parallel=p.sequence_parallel_enabled,
            true_vocab_size=true_vocab,
            padded_vocab_size=padded_vocab_size(
                true_vocab, cfg.model.make_vocab_size_divisible_by, tp
            ),
            precision=precision_of(cfg),
            context_parallel_size=p.context_parallel_size,
        )
