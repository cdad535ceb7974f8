"""Process start-up: rendezvous environment, ``deepspeed.init_distributed``, model-parallel groups, seeds.

Launchers: ``deepspeed`` (passes ``--local_rank`` and sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*), ``torchrun``
(sets the same variables), a plain environment with those variables, Slurm's ``srun`` (one task per GPU; the
variables are derived from ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``, the first host of
``SLURM_STEP_NODELIST`` and a port derived from ``SLURM_JOB_ID``, see :func:`slurm_rendezvous_env`), or a bare
``python pretrain_gpt.py`` with none of them: then this is a world of one process and :func:`ensure_rendezvous_env`
sets the variables itself (DeepSpeed would otherwise try MPI discovery and fail on ``mpi4py``).

Order (the flag checks happen before anything here creates a process group):
``ensure_rendezvous_env -> world_size_from_env -> validate + build_ds_config -> init_distributed ->
initialize_model_parallel -> set_seeds``.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron import fused_kernels, mpu
from megatron.config import TridentConfig
from megatron.deepspeed_internals import set_default_group_timeout, skip_cpu_shm_build
from megatron.log import log_rank_0
from megatron.mpu.mappings import all_gather_object
from megatron.training.cpu_allocator import keep_freed_memory

logger = logging.getLogger(__name__)

_RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: ``"gpu[007-010,12],cpu1"`` -> ``"gpu007"``, ``"r[1-2]-n[5-6]"`` ->
    ``"r1-n5"``.

    Raises:
        ValueError: an empty or unbalanced hostlist.
    """
    first, depth = "", 0
    for ch in nodelist.strip():
        if ch == "," and depth == 0:
            break
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0:
            break
        first += ch
    out, rest = "", first
    while "[" in rest:
        head, _, tail = rest.partition("[")
        inside, closed, rest = tail.partition("]")
        if not closed:
            depth = 1
            break
        out += head + inside.split(",")[0].split("-")[0]
    out += rest
    if not out or depth != 0 or "]" in out:
        raise ValueError(
            f"cannot read the Slurm node list {nodelist!r}; set MASTER_ADDR to the first node's address."
        )
    return out


def slurm_rendezvous_env(environ: Mapping[str, str]) -> dict[str, str]:
    """RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT for a task started by ``srun`` (empty dict otherwise).

    Only job steps (``SLURM_STEP_NUM_TASKS`` set by ``srun``) count: a batch script's own shell also has
    ``SLURM_PROCID``/``SLURM_NTASKS`` but is one process. MASTER_ADDR is the first host of the step's node list,
    MASTER_PORT from the job and step ids (:func:`_slurm_port`); values already set win.
    """
    if "SLURM_STEP_NUM_TASKS" not in environ or "SLURM_PROCID" not in environ:
        return {}
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
    env = {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_STEP_NUM_TASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_slurm_host(nodelist or "127.0.0.1"),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(_slurm_port(environ)),
    }
    return env


def _slurm_port(environ: Mapping[str, str]) -> int:
    """15000 + 16 * (job id mod 1000) + (step id mod 16): the same on every task of a step, different for
    concurrent steps of a job, and below Linux's ephemeral range (32768+), where the OS picks client ports."""

    def number(var: str) -> int:
        digits = "".join(ch for ch in environ.get(var, "") if ch.isdigit())
        return int(digits) if digits else 0

    return 15000 + 16 * (number("SLURM_JOB_ID") % 1000) + number("SLURM_STEP_ID") % 16


def ensure_rendezvous_env(local_rank: int | None = None) -> bool:
    """Make the environment describe a process group; returns True when a world of 1 was set up here.

    With RANK or WORLD_SIZE present (any launcher) only LOCAL_RANK is filled in (from ``--local_rank`` or 0); the
    rest must be there. Under ``srun`` without them, they come from Slurm's variables (:func:`slurm_rendezvous_env`).
    With none of them: RANK=0, WORLD_SIZE=1, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT.

    Raises:
        ValueError: a launcher environment lacks one of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
    """
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        slurm = slurm_rendezvous_env(os.environ)
        if slurm:
            os.environ.update(slurm)
            logger.info(
                "srun task %s of %s: rendezvous at %s:%s",
                slurm["RANK"],
                slurm["WORLD_SIZE"],
                slurm["MASTER_ADDR"],
                slurm["MASTER_PORT"],
            )
    created = "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    if created:
        os.environ["RANK"] = "0"
        os.environ["WORLD_SIZE"] = "1"
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(local_rank if local_rank is not None else 0)
    missing = [v for v in _RENDEZVOUS_VARS if v not in os.environ]
    if missing:
        raise ValueError(
            f"incomplete launch environment: {', '.join(missing)} not set (RANK={os.environ.get('RANK')}, "
            f"WORLD_SIZE={os.environ.get('WORLD_SIZE')}); launch with torchrun or deepspeed, or set "
            "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."
        )
    return created


def world_size_from_env() -> int:
    """WORLD_SIZE as an int (call :func:`ensure_rendezvous_env` first)."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"WORLD_SIZE={value!r} is not an integer.") from None


def local_world_size() -> int:
    """Ranks of this job on this node: LOCAL_WORLD_SIZE (torchrun, the spawner) or LOCAL_SIZE (DeepSpeed's launcher),
    else WORLD_SIZE (every rank counted here: the safe side)."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE"):
        value = os.environ.get(key, "")
        if value.strip().isdigit() and int(value) > 0:
            return int(value)
    return 1


def device_type(cfg: TridentConfig) -> str:
    """'cuda' when a GPU is visible and neither --distributed-backend gloo nor DS_ACCELERATOR=cpu ask for CPU."""
    if cfg.parallel.distributed_backend == "gloo" or os.environ.get("DS_ACCELERATOR") == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _backend(cfg: TridentConfig, dev: str) -> str:
    if cfg.parallel.distributed_backend != "auto":
        return cfg.parallel.distributed_backend
    return "nccl" if dev == "cuda" else "gloo"


def init_distributed(cfg: TridentConfig, *, planned_bytes: int | None = None) -> torch.device:
    """``deepspeed.init_distributed`` (gloo on CPU, NCCL on CUDA) and the model-parallel groups; returns the device.

    On CPU, DeepSpeed's shared-memory all-reduce op (used only by inference) is not JIT-built (that build costs
    30-50 s per cold start and needs a compiler), and glibc is told to keep freed memory for reuse
    (``cpu_allocator``; ``planned_bytes``: the memory planner's peak of one rank, which the default ``auto`` decides
    with). --distributed-timeout-minutes reaches the default group, every group of ``parallel_state``
    and the groups DeepSpeed creates later (``set_default_group_timeout``).
    """
    dev = device_type(cfg)
    allocator = None
    if dev == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        skip_cpu_shm_build()
        allocator = keep_freed_memory(planned_bytes=planned_bytes, local_ranks=local_world_size())
    import deepspeed

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dev == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    timeout = timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    # Also when the caller already created the default group (a library user, the test spawner): DeepSpeed then
    # wraps that group; without it DeepSpeed's own comm layer is unset and PipelineModule fails on get_rank().
    deepspeed.init_distributed(
        dist_backend=_backend(cfg, dev),
        auto_mpi_discovery=False,
        verbose=False,
        timeout=timeout,
    )
    set_default_group_timeout(timeout)  # the groups DeepSpeed creates itself (pipeline grid, ...)
    mpu.initialize_model_parallel(
        cfg.parallel.tensor_model_parallel_size,
        cfg.parallel.pipeline_model_parallel_size,
        ds_sequence_parallel_size=cfg.parallel.ds_sequence_parallel_size,
        timeout=timeout,
    )
    agree_on_fused_kernels(device.type)
    if allocator is not None:
        log_rank_0(logger, "%s", allocator)
    return device


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
    (identical across a TP group and across data-parallel ranks, as in Megatron)."""
    return seed + PIPELINE_SEED_OFFSET * pp_rank + SEQUENCE_PARALLEL_SEED_OFFSET * sp_rank


def set_seeds(seed: int) -> None:
    """Seed torch's default generators and the model-parallel RNG tracker for this rank's dropout.

    Parameter values come from ``param_seed(seed, name)`` inside the model and the data order from the sampler's
    seed, so neither depends on the rank or the layout. Dropout does: the default generators start from
    ``rank_seed`` (one stream per stage and Ulysses rank: the layers of stage 1 do not replay stage 0's masks, nor
    one sequence chunk another's), and the tracker's "model-parallel-rng" stream from that plus 2718 + tp_rank
    (Megatron's), for dropout inside tensor-parallel regions.
    """
    own = rank_seed(seed, mpu.get_pipeline_model_parallel_rank(), mpu.get_sequence_parallel_rank())
    torch.manual_seed(own)
    mpu.model_parallel_cuda_manual_seed(own)


def check_pipe_grid(grid: object) -> None:
    """Verify that DeepSpeed's pipeline grid and our ``parallel_state`` agree on every rank coordinate.

    Raises:
        RuntimeError: a coordinate or size differs (a rank-order bug; training would silently mix shards).
    """
    pairs = {
        "tensor rank": (grid.get_slice_parallel_rank(), mpu.get_tensor_model_parallel_rank()),  # type: ignore[attr-defined]
        "tensor size": (
            grid.get_slice_parallel_world_size(),  # type: ignore[attr-defined]
            mpu.get_tensor_model_parallel_world_size(),
        ),
        "pipeline stage": (grid.get_stage_id(), mpu.get_pipeline_model_parallel_rank()),  # type: ignore[attr-defined]
        "pipeline size": (
            grid.get_pipe_parallel_world_size(),  # type: ignore[attr-defined]
            mpu.get_pipeline_model_parallel_world_size(),
        ),
        "data rank": (grid.get_data_parallel_rank(), mpu.get_data_parallel_rank()),  # type: ignore[attr-defined]
        "data size": (
            grid.get_data_parallel_world_size(),  # type: ignore[attr-defined]
            mpu.get_data_parallel_world_size(),
        ),
    }
    bad = {k: v for k, v in pairs.items() if v[0] != v[1]}
    if bad:
        detail = "; ".join(f"{k}: deepspeed {a} vs mpu {b}" for k, (a, b) in bad.items())
        raise RuntimeError(f"DeepSpeed's pipeline grid disagrees with megatron.mpu: {detail}.")
