"""``ParallelContext``: what a tensor-parallel model built on one rank needs to know, passed to it explicitly.

Legend: ``p`` TP size.

The model and every block of it are built with one of these instead of reading the process-wide
``parallel_state``: a model built for another grid (a converter writing TP = 4 shards, an inference server, a
sequence-parallel or expert group) gets exactly the group it is given. A run builds it from the ``ParallelState``
``initialize_model_parallel`` returned (:meth:`ParallelContext.from_state`); :meth:`ParallelContext.from_parallel_state`
reads the process-wide default state instead (tests, tools building one model).

    state = initialize_model_parallel(2, 1)
    ctx = ParallelContext.from_state(state, cfg.parallel, seed=1234)               # the run's TP group
    ctx = ParallelContext.from_parallel_state(seed=1234, sequence_parallel=True)   # the default state's
    ctx = ParallelContext(seed=1234)                                                # one process, TP = 1
    model = GPTModel(config, ctx)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.config import ParallelConfig
from megatron.mpu.expert_parallel import expert_parallel_rank
from megatron.mpu.parallel_state import (
    ParallelState,
    ProcessGroup,
    get_parallel_state,
    group_rank,
    group_world_size,
)


@dataclass(frozen=True)
class TPSettings:
    """What every tensor-parallel layer of a model shares (``mpu/layers.py``): its group, sequence parallelism,
    where its parameters live and the backward overlap. A model takes it from :attr:`ParallelContext.tp_settings`."""

    group: ProcessGroup | None = None
    """The TP group the layer is split over (None: the default one of ``parallel_state``)."""
    sequence_parallel: bool = False
    """Activations are ``[s/p, b, h]`` outside the TP region (all-gathered in, reduce-scattered out)."""
    params_dtype: torch.dtype = torch.float32
    """dtype of the parameters (initial values are drawn in fp32, then cast)."""
    device: torch.device | str | None = None
    """Where the parameters live (None: CPU)."""
    async_tensor_model_parallel_allreduce: bool = True
    """Column-parallel linears overlap the input-grad all-reduce with the weight-grad matmul."""


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
    sp_group: ProcessGroup | None = None
    """DeepSpeed-Ulysses group: attention all-to-alls its heads over it (``model/ulysses.py``); None: no Ulysses."""
    cp_group: ProcessGroup | None = None
    """Context-parallel group (``--context-parallel-size``): attention exchanges K/V over it
    (``model/context_parallel.py``); None: no context parallelism."""
    sequence_group: ProcessGroup | None = None
    """The ranks one sequence is split over (CP x Ulysses): the loss sums its tokens and their count over it
    (``model.utils.loss_func``); None: the sequence is whole on this rank."""

    expert_parallel_size: int = 1
    """DeepSpeed-MoE expert-parallel degree ``ep``: an MoE layer holds ``E/ep`` of its experts on this rank."""
    expert_parallel_rank: int = 0
    """This rank's index in its expert-parallel group (``mpu/expert_parallel.py``): its experts are
    ``rank * E/ep .. (rank + 1) * E/ep - 1``."""
    expert_tensor_parallel: bool = False
    """Experts are TP-split like the dense MLP (--enable-expert-tensor-parallelism); else held whole."""

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

    @property
    def cp_size(self) -> int:
        """``cp``: ranks in the context-parallel group (1 without one)."""
        return group_world_size(self.cp_group)

    @property
    def tp_settings(self) -> TPSettings:
        """The settings every TP layer of the model takes (``ColumnParallelLinear(..., tp=ctx.tp_settings)``)."""
        return TPSettings(
            group=self.tp_group,
            sequence_parallel=self.sequence_parallel,
            params_dtype=self.params_dtype,
            device=self.device,
            async_tensor_model_parallel_allreduce=self.async_tensor_model_parallel_allreduce,
        )

    @classmethod
    def from_state(
        cls,
        state: ParallelState,
        parallel: ParallelConfig,
        *,
        seed: int,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> ParallelContext:
        """A context on ``state``'s TP group, with the build settings of ``parallel`` (the run's flags).

        The Ulysses group comes with it when its size is > 1, or always with --force-ds-sequence-parallel; the
        context-parallel group when its size is > 1; the CP x Ulysses group when that is > 1; the
        expert-parallel rank follows from this rank's place in ``state``'s grid.
        """
        grid = state.grid
        sp_size = state.get_sequence_parallel_world_size()
        cp_size = state.get_context_parallel_world_size()
        split = state.get_context_sequence_parallel_world_size() > 1
        force_sp = parallel.force_ds_sequence_parallel
        return cls(
            seed=seed,
            tp_group=state.get_tensor_model_parallel_group(),
            sequence_parallel=parallel.sequence_parallel,
            params_dtype=params_dtype,
            device=device,
            async_tensor_model_parallel_allreduce=parallel.async_tensor_model_parallel_allreduce,
            sp_group=state.get_sequence_parallel_group() if force_sp or sp_size > 1 else None,
            cp_group=state.get_context_parallel_group() if cp_size > 1 else None,
            sequence_group=state.get_context_sequence_parallel_group() if split else None,
            expert_parallel_size=parallel.moe_expert_parallel_size,
            expert_parallel_rank=expert_parallel_rank(
                state.rank,
                world_size=grid.world_size,
                tensor_model_parallel_size=grid.tensor_model_parallel_size,
                pipeline_model_parallel_size=grid.pipeline_model_parallel_size,
                expert_parallel_size=parallel.moe_expert_parallel_size,
                expert_tensor_parallel=parallel.enable_expert_tensor_parallelism,
            ),
            expert_tensor_parallel=parallel.enable_expert_tensor_parallelism,
        )

    @classmethod
    def from_parallel_state(
        cls,
        *,
        seed: int,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        async_tensor_model_parallel_allreduce: bool = True,
        force_ds_sequence_parallel: bool = False,
        moe_expert_parallel_size: int = 1,
        enable_expert_tensor_parallelism: bool = False,
    ) -> ParallelContext:
        """A context on the default state's TP group (``initialize_model_parallel``), or TP = 1 without
        torch.distributed: :meth:`from_state` of ``get_parallel_state()`` with these settings.

        Raises:
            RuntimeError: torch.distributed is initialized but the model-parallel groups are not.
        """
        parallel = ParallelConfig(
            sequence_parallel=sequence_parallel,
            async_tensor_model_parallel_allreduce=async_tensor_model_parallel_allreduce,
            force_ds_sequence_parallel=force_ds_sequence_parallel,
            moe_expert_parallel_size=moe_expert_parallel_size,
            enable_expert_tensor_parallelism=enable_expert_tensor_parallelism,
        )
        if dist.is_available() and dist.is_initialized():
            return cls.from_state(
                get_parallel_state(), parallel, seed=seed, params_dtype=params_dtype, device=device
            )
        return cls(
            seed=seed,
            sequence_parallel=sequence_parallel,
            params_dtype=params_dtype,
            device=device,
            async_tensor_model_parallel_allreduce=async_tensor_model_parallel_allreduce,
            expert_parallel_size=moe_expert_parallel_size,
            expert_tensor_parallel=enable_expert_tensor_parallelism,
        )
