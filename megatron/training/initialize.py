"""Process start-up of a training run: ``deepspeed.init_distributed``, model-parallel groups, seeds.

The rendezvous environment and the device come from :mod:`megatron.launch` (every launcher, Slurm, a bare process).
Order (the flag checks happen before anything here creates a process group):
``ensure_rendezvous_env -> world_size_from_env -> validate + build_ds_config -> init_distributed ->
initialize_model_parallel -> set_seeds``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron import fused_kernels, mpu
from megatron.config import ParallelConfig
from megatron.deepspeed_internals import set_default_group_timeout, skip_cpu_shm_build
from megatron.launch.cpu_allocator import keep_freed_memory
from megatron.launch.device import device_type, local_device
from megatron.launch.elastic import round_store, uses_agent_store
from megatron.launch.rendezvous import local_world_size
from megatron.log import log_rank_0
from megatron.mpu.mappings import all_gather_object
from megatron.mpu.parallel_state import ParallelState

logger = logging.getLogger(__name__)


def run_device_type(parallel: ParallelConfig) -> str:
    """The device type of this run: :func:`megatron.launch.device.device_type` for --distributed-backend."""
    return device_type(parallel.distributed_backend)


def _backend(parallel: ParallelConfig, dev: str) -> str:
    if parallel.distributed_backend != "auto":
        return parallel.distributed_backend
    return "nccl" if dev == "cuda" else "gloo"


@dataclass(frozen=True)
class Distributed:
    """What :func:`init_distributed` sets up for this rank, kept by the run and passed down."""

    device: torch.device
    """This rank's device."""
    state: ParallelState
    """The model-parallel groups (``initialize_model_parallel``'s result): TP, PP, DP, Ulysses, ..."""
    previous_failures: tuple[str, ...] = ()
    """Under torchrun, after a restart (rank 0): why the failed round's ranks stopped (``launch/elastic.py``)."""


def init_distributed(parallel: ParallelConfig, *, planned_bytes: int | None = None) -> Distributed:
    """``deepspeed.init_distributed`` (gloo on CPU, NCCL on CUDA) and the model-parallel groups of ``parallel``;
    returns the device and the groups.

    On CPU, DeepSpeed's shared-memory all-reduce op (used only by inference) is not JIT-built (that build costs
    30-50 s per cold start and needs a compiler), and glibc is told to keep freed memory for reuse
    (``cpu_allocator``; ``planned_bytes``: the memory planner's peak of one rank, which the default ``auto`` decides
    with). --distributed-timeout-minutes reaches the default group, every group of ``parallel_state``
    and the groups DeepSpeed creates later (``set_default_group_timeout``).
    """
    dev = run_device_type(parallel)
    allocator = None
    if dev == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        skip_cpu_shm_build()
        allocator = keep_freed_memory(planned_bytes=planned_bytes, local_ranks=local_world_size())
    import deepspeed

    device = local_device(dev)
    timeout = timedelta(minutes=parallel.distributed_timeout_minutes)
    failures: tuple[str, ...] = ()
    if uses_agent_store() and not dist.is_initialized():
        failures = _init_round_group(_backend(parallel, dev), timeout)
    # Also when the caller already created the default group (a library user, the test spawner): DeepSpeed then
    # wraps that group; without it DeepSpeed's own comm layer is unset and PipelineModule fails on get_rank().
    deepspeed.init_distributed(
        dist_backend=_backend(parallel, dev),
        auto_mpi_discovery=False,
        verbose=False,
        timeout=timeout,
    )
    set_default_group_timeout(timeout)  # the groups DeepSpeed creates itself (pipeline grid, ...)
    state = mpu.initialize_model_parallel(
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        ds_sequence_parallel_size=parallel.ds_sequence_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        timeout=timeout,
    )
    agree_on_fused_kernels(device.type)
    if allocator is not None:
        log_rank_0(logger, "%s", allocator)
    return Distributed(device=device, state=state, previous_failures=failures)


def _init_round_group(backend: str, timeout: timedelta) -> tuple[str, ...]:
    """Under torchrun's shared agent store: the default group on this restart round's own keys
    (``megatron/launch/elastic.py``: the keys of a dead round would send gloo to dead ports); returns what the
    failed round recorded (rank 0)."""
    rnd = round_store(timeout)
    dist.init_process_group(
        backend,
        store=rnd.store,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )
    return rnd.failures


def agree_on_fused_kernels(device_type: str) -> None:
    """All ranks run the fused kernels, or none does.

    The fused cross-entropy reduces other tensors over TP than the unfused one, so ranks that disagree (one node's
    build failed) would mismatch collectives; and layouts must run the same numbers. If any rank has no kernels,
    every rank uses the references, with one warning naming the ranks.
    """
    have = fused_kernels.extension(device_type) is not None
    everyone = all_gather_object(have, group=dist.group.WORLD)
    if all(everyone) or not any(everyone):
        return
    missing = [rank for rank, ok in enumerate(everyone) if not ok]
    log_rank_0(
        logger,
        "fused kernels: rank(s) %s have no %s kernels; every rank runs the PyTorch references (fix the build "
        "there, or set TRIDENT_NO_KERNELS=1 to silence this)",
        missing,
        device_type,
        level=logging.WARNING,
    )
    fused_kernels.force_references(device_type, f"ranks {missing} have no kernels")


def destroy_distributed() -> None:
    """Destroy every process group (the default one included) of this process, if any.

    For a process that is done with collectives (the end of ``pretrain_gpt.py``): torch asks for it before exit,
    NCCL communicators are then torn down cleanly. ``pretrain`` itself leaves the groups in place so a caller can
    call it again in the same process.
    """
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


PIPELINE_SEED_OFFSET = 100
"""Stage k's generators start from ``seed + 100 k`` (Megatron's ``_set_random_seed``)."""
SEQUENCE_PARALLEL_SEED_OFFSET = 1_000_003
"""DeepSpeed-Ulysses rank u adds ``1000003 u``: its sequence chunk and its attention heads get their own dropout
masks (upstream Megatron-DeepSpeed adds nothing, so every chunk reused the same masks). Far above any stage or
``2718 + tp_rank`` offset, so no two (stage, Ulysses rank, TP rank) streams share a seed."""


def rank_seed(seed: int, pp_rank: int, sp_rank: int) -> int:
    """The seed of the default generators of the ranks at pipeline stage ``pp_rank`` and Ulysses rank ``sp_rank``
    (under context parallelism: ``cp_rank * sp + sp_rank``, the rank's part of the sequence); identical across a
    TP group and across data-parallel ranks, as in Megatron."""
    return seed + PIPELINE_SEED_OFFSET * pp_rank + SEQUENCE_PARALLEL_SEED_OFFSET * sp_rank


def set_seeds(seed: int, state: ParallelState, *, device_type: str) -> None:
    """Seed torch's default generators and the model-parallel RNG tracker for this rank's dropout.

    Parameter values come from ``param_seed(seed, name)`` inside the model and the data order from the sampler's
    seed, so neither depends on the rank or the layout. Dropout does: the default generators start from
    ``rank_seed`` (one stream per stage and Ulysses rank: the layers of stage 1 do not replay stage 0's masks, nor
    one sequence chunk another's), and the tracker's "model-parallel-rng" stream from that plus 2718 + tp_rank
    (Megatron's), for dropout inside tensor-parallel regions. ``device_type`` is the run's (``run.device.type``):
    only a CUDA run saves and restores CUDA generators (a CPU run never touches CUDA).
    """
    # the rank's part of its sequence (CP x Ulysses; the Ulysses rank at cp = 1): each part its own masks
    part = (
        state.get_context_parallel_rank() * state.get_sequence_parallel_world_size()
        + state.get_sequence_parallel_rank()
    )
    own = rank_seed(seed, state.get_pipeline_model_parallel_rank(), part)
    torch.manual_seed(own)
    mpu.model_parallel_cuda_manual_seed(own, device_type=device_type)


def check_pipe_grid(grid: object, state: ParallelState) -> None:
    """Verify that DeepSpeed's pipeline grid and our ``state`` agree on every rank coordinate.

    Raises:
        RuntimeError: a coordinate or size differs (a rank-order bug; training would silently mix shards).
    """
    cp = state.get_context_parallel_world_size()
    pairs = {
        "tensor rank": (grid.get_slice_parallel_rank(), state.get_tensor_model_parallel_rank()),  # type: ignore[attr-defined]
        "tensor size": (
            grid.get_slice_parallel_world_size(),  # type: ignore[attr-defined]
            state.get_tensor_model_parallel_world_size(),
        ),
        "pipeline stage": (grid.get_stage_id(), state.get_pipeline_model_parallel_rank()),  # type: ignore[attr-defined]
        "pipeline size": (
            grid.get_pipe_parallel_world_size(),  # type: ignore[attr-defined]
            state.get_pipeline_model_parallel_world_size(),
        ),
        # DeepSpeed's "data" axis is DP x CP (model_setup.py): index dp_rank * cp + cp_rank
        "data rank": (
            grid.get_data_parallel_rank(),  # type: ignore[attr-defined]
            state.get_data_parallel_rank() * cp + state.get_context_parallel_rank(),
        ),
        "data size": (
            grid.get_data_parallel_world_size(),  # type: ignore[attr-defined]
            state.get_data_parallel_world_size() * cp,
        ),
    }
    bad = {k: v for k, v in pairs.items() if v[0] != v[1]}
    if bad:
        detail = "; ".join(f"{k}: deepspeed {a} vs mpu {b}" for k, (a, b) in bad.items())
        raise RuntimeError(f"DeepSpeed's pipeline grid disagrees with megatron.mpu: {detail}.")
