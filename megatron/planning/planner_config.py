"""``PlannerConfig``: what the planner reads besides the ``RunPlan``: the model, and the few parallel and optimizer
flags the plan does not derive (expert layout, Ulysses and context-parallel degrees, optimizer states).

    pc = PlannerConfig.from_configs(cfg.model, cfg.parallel, cfg.training)
    mp = plan_memory(pc, plan, ds_config)

The planner's functions take it (or only its ``model`` where that is all they read) plus the ``RunPlan``, never the
whole ``TridentConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.config import ModelConfig, ParallelConfig, TrainingConfig


@dataclass(frozen=True)
class PlannerConfig:
    """The planner's inputs beyond the ``RunPlan`` (each field: the flag it comes from)."""

    model: ModelConfig
    """The model's shapes, MoE layout, recompute and dropout settings."""
    moe_expert_parallel_size: int = 1
    """--moe-expert-parallel-size: the ranks a layer's experts are split over."""
    enable_expert_tensor_parallelism: bool = False
    """--enable-expert-tensor-parallelism: experts TP-split like the dense MLP (off: whole on every TP rank)."""
    ds_sequence_parallel_size: int = 1
    """--ds-sequence-parallel-size: the DeepSpeed-Ulysses degree (activations divided by it)."""
    context_parallel_size: int = 1
    """--context-parallel-size: the context-parallel degree (activations and pipeline buffers divided by it)."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """--optimizer: Adam keeps two fp32 moments, SGD one (none without momentum)."""
    sgd_momentum: float = 0.9
    """--sgd-momentum."""
    cpu_optimizer: bool = False
    """--cpu-optimizer: optimizer states (and the fp32 gradient partition) offloaded to CPU."""

    @classmethod
    def from_configs(
        cls, model: ModelConfig, parallel: ParallelConfig, training: TrainingConfig
    ) -> PlannerConfig:
        """The planner's inputs of a run's model, parallel and training sub-configs."""
        return cls(
            model=model,
            moe_expert_parallel_size=parallel.moe_expert_parallel_size,
            enable_expert_tensor_parallelism=parallel.enable_expert_tensor_parallelism,
            ds_sequence_parallel_size=parallel.ds_sequence_parallel_size,
            context_parallel_size=parallel.context_parallel_size,
            optimizer=training.optimizer,
            sgd_momentum=training.sgd_momentum,
            cpu_optimizer=training.cpu_optimizer,
        )
