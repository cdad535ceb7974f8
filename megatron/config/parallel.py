"""``ParallelConfig``: how the model is laid out over ranks (TP x PP x DP, ZeRO, sequence parallel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout. The data-parallel degree is derived: world_size / (tp * pp)."""

    tensor_model_parallel_size: int = 1
    """--tensor-model-parallel-size: TP degree p (Megatron column/row-parallel layers)."""
    pipeline_model_parallel_size: int = 1
    """--pipeline-model-parallel-size: PP degree (DeepSpeed PipelineModule stages)."""
    sequence_parallel: bool = False
    """--sequence-parallel: Megatron sequence parallelism (activations sharded on s between TP regions; TP > 1)."""
    zero_stage: int = 0
    """--zero-stage: DeepSpeed ZeRO stage 0-3 (2/3 only without pipeline parallelism)."""
    no_pipeline_parallel: bool = False
    """--no-pipeline-parallel: use the plain GPTModel with DeepSpeedEngine (needs PP = 1; required for ZeRO-2/3)."""
    distributed_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """--distributed-backend: auto = nccl with CUDA, gloo on CPU."""
    distributed_timeout_minutes: int = 10
    """--distributed-timeout-minutes: process-group timeout."""
    local_rank: int | None = None
    """--local_rank / --local-rank: passed by the deepspeed launcher (LOCAL_RANK env otherwise)."""

    def data_parallel_size(self, world_size: int) -> int:
        """DP degree for ``world_size`` ranks (validate() guarantees divisibility)."""
        return world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    @property
    def sequence_parallel_enabled(self) -> bool:
        """Sequence parallelism is a no-op at TP = 1 (as in Megatron)."""
        return self.sequence_parallel and self.tensor_model_parallel_size > 1
