"""``ParallelContext``: what a tensor-parallel model built on one rank needs to know, passed to it explicitly.

Legend: ``p`` TP size.

The model and every block of it are built with one of these instead of reading the process-wide
``parallel_state``: a model built for another grid (a converter writing TP = 4 shards, an inference server, a
sequence-parallel or expert group) gets exactly the group it is given. The global getters of ``parallel_state`` stay
the DeepSpeed ``mpu=`` interface and serve code that truly concerns the whole process (the training loop's DP
group, the data sampler).

    ctx = ParallelContext.from_parallel_state(seed=1234, sequence_parallel=True)   # the run's TP group
    ctx = ParallelContext(seed=1234)                                                # one process, TP = 1
    model = GPTModel(config, ctx)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.mpu.parallel_state import (
    ProcessGroup,
    get_tensor_model_parallel_group,
    group_rank,
    group_world_size,
)


@dataclass(frozen=True)
class ParallelContext:
    """The tensor-parallel group of a model and the build settings every layer of it shares.

    ``sequence_parallel`` is stored as it takes effect: False at TP = 1 (where it is a no-op, as in Megatron).

    Raises:
        ValueError: ``tp_group`` is None while torch.distributed is initialized (the group must be named there:
            ``from_parallel_state()`` for the run's, or a group of one rank for a TP = 1 model).
    """

    seed: int
    """The run's seed: each parameter's initial value is a function of ``(seed, global name)``."""
    tp_group: ProcessGroup | None = None
    """The TP group the model is split over; None only in a process without torch.distributed (TP = 1)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: activations ``[s/p, b, h]`` between TP regions."""
    params_dtype: torch.dtype = torch.float32
    """dtype of the parameters (initial values are drawn in fp32, then cast)."""
    device: torch.device | str | None = None
    """Where the parameters live (None = CPU)."""
    async_tensor_model_parallel_allreduce: bool = True
    """Column-parallel linears overlap the input-grad all-reduce with the weight-grad matmul (``mpu/layers.py``)."""

    def __post_init__(self) -> None:
        if self.tp_group is None and dist.is_available() and dist.is_initialized():
            raise ValueError(
                "ParallelContext(tp_group=None) inside an initialized torch.distributed job: name the "
                "tensor-parallel group (ParallelContext.from_parallel_state(...) for the run's, or "
                "torch.distributed.new_group([rank]) for a TP = 1 model)."
            )
        if self.sequence_parallel and self.tp_size == 1:
            object.__setattr__(self, "sequence_parallel", False)

    @property
    def tp_size(self) -> int:
        """``p``: ranks in the TP group."""
        return group_world_size(self.tp_group)

    @property
    def tp_rank(self) -> int:
        """This process's index in the TP group."""
        return group_rank(self.tp_group)

    @classmethod
    def from_parallel_state(
        cls,
        *,
        seed: int,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        async_tensor_model_parallel_allreduce: bool = True,
    ) -> ParallelContext:
        """A context on the run's TP group (``initialize_model_parallel``), or TP = 1 without torch.distributed.

        Raises:
            RuntimeError: torch.distributed is initialized but the model-parallel groups are not.
        """
        group = None
        if dist.is_available() and dist.is_initialized():
            group = get_tensor_model_parallel_group()
        return cls(
            seed=seed,
            tp_group=group,
            sequence_parallel=sequence_parallel,
            params_dtype=params_dtype,
            device=device,
            async_tensor_model_parallel_allreduce=async_tensor_model_parallel_allreduce,
        )
