"""``ParallelConfig``: how the model is laid out over ranks (TP x PP x DP, ZeRO, sequence parallel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout. The data-parallel degree is derived: world size / (TP x PP x CP x Ulysses SP)."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel degree p (Megatron column/row-parallel layers)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel degree (DeepSpeed PipelineModule stages)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: activations sharded on the sequence between TP regions (TP > 1)."""
    async_tensor_model_parallel_allreduce: bool = True
    """Overlap the TP all-reduce of a column-parallel linear's input gradient with its weight-gradient matmul."""
    ds_sequence_parallel_size: int = 1
    """DeepSpeed-Ulysses sequence-parallel degree N: each rank of a group of N holds s/N tokens; attention
    all-to-alls the heads so every rank attends over the whole sequence with n/N heads (``mpu/ulysses.py``)."""
    context_parallel_size: int = 1
    """Context-parallel degree N (Megatron-LM's ``--context-parallel-size``): each rank of a group of N holds s/N
    tokens in the causal load-balanced order; attention exchanges K/V over the group (``model/context_parallel.py``,
    ``docs/context-parallelism.md``)."""
    force_ds_sequence_parallel: bool = False
    """Route attention through DeepSpeed's DistributedAttention even at --ds-sequence-parallel-size 1."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3 (2 and 3 only without pipeline parallelism)."""
    no_pipeline_parallel: bool = False
    """Use the plain GPTModel with DeepSpeedEngine (needs pipeline size 1; always so at PP = 1)."""
    distributed_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend: auto is nccl with CUDA, gloo on CPU."""
    distributed_timeout_minutes: float = 10.0
    """Timeout of every collective on every process group, in minutes (fractions allowed)."""
    local_rank: int | None = None
    """This process's rank on its node, as the deepspeed launcher passes it (else the LOCAL_RANK variable)."""
    moe_expert_parallel_size: int = 1
    """Expert-parallel degree (DeepSpeed-MoE): each MoE layer's experts are split over this many data-parallel
    ranks; it divides the data-parallel size and every layer's expert count."""
    enable_expert_tensor_parallelism: bool = False
    """Experts are tensor-parallel like the dense MLP (off: every TP rank holds whole experts)."""

    def data_parallel_size(self, world_size: int) -> int:
        """DP degree for ``world_size`` ranks (validate() guarantees divisibility)."""
        return world_size // (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
            * self.ds_sequence_parallel_size
        )

    @property
    def sequence_parallel_enabled(self) -> bool:
        """Sequence parallelism is a no-op at TP = 1 (as in Megatron)."""
        return self.sequence_parallel and self.tensor_model_parallel_size > 1
