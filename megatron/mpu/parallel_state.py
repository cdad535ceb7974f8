"""Process groups of 3D parallelism (+ context parallelism, DeepSpeed-Ulysses): the ONLY module of Trident with
process-wide state.

Legend: ``p`` tensor-parallel (TP) size, ``pp`` pipeline-parallel (PP) size, ``dp`` data-parallel (DP) size,
``cp`` context-parallel size (``--context-parallel-size``), ``sp`` DeepSpeed-Ulysses sequence-parallel size
(``--ds-sequence-parallel-size``), ``W = p * sp * cp * dp * pp`` the world size.

Rank order (identical to Megatron and to DeepSpeed's ``PipeModelDataParallelTopology`` with axes
``pipe, data, model`` when ``cp = sp = 1``): TP fastest, then Ulysses SP, then CP, then DP, then PP::

    rank = pp_rank * (dp * cp * sp * p) + dp_rank * (cp * sp * p) + cp_rank * (sp * p) + sp_rank * p + tp_rank
    grid = arange(W).reshape(pp, dp, cp, sp, p)

Worked example, W = 16, p = 2, pp = 4 (so dp = 2)::

               dp_rank 0     dp_rank 1
    stage 0    [ 0,  1]      [ 2,  3]          each [a, b] is one TP group
    stage 1    [ 4,  5]      [ 6,  7]
    stage 2    [ 8,  9]      [10, 11]
    stage 3    [12, 13]      [14, 15]

    tensor-model-parallel  [0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]      grid[k, j, c, m, :]
    data-parallel          [0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]      grid[k, :, c, m, i]
    pipeline-model-parallel [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]             grid[:, j, c, m, i]
    model-parallel (TP x PP, one DP index)  [0,1,4,5,8,9,12,13] [2,3,6,7,10,11,14,15]  grid[:, j, c, m, :]
    embedding (first + last stage)          [0,12] [1,13] [2,14] [3,15]
    position-embedding (first stage)        [0] [1] [2] [3]
    sequence-parallel (Ulysses, sp = 1), context-parallel (cp = 1)   [0] [1] ... [15]
    sequence-data-parallel (= data-parallel while cp = sp = 1)

Worked example with Ulysses, W = 8, p = 2, sp = 2, pp = 1 (so dp = 2)::

               sp_rank 0     sp_rank 1
    dp_rank 0  [0, 1]        [2, 3]             each [a, b] is one TP group
    dp_rank 1  [4, 5]        [6, 7]

    tensor-model-parallel   [0,1] [2,3] [4,5] [6,7]                     grid[k, j, c, m, :]
    sequence-parallel       [0,2] [1,3] [4,6] [5,7]                     grid[k, j, c, :, i]
    data-parallel           [0,4] [1,5] [2,6] [3,7]                     grid[k, :, c, m, i]
    sequence-data-parallel  [0,2,4,6] [1,3,5,7]                         grid[k, :, :, :, i]
    model-parallel (TP x PP, one DP and SP index)  [0,1] [2,3] [4,5] [6,7]   grid[:, j, c, m, :]

Worked example with context parallelism and Ulysses inside it (two-level), W = 16, p = 2, sp = 2, cp = 2, pp = 1
(so dp = 2)::

                          sp_rank 0   sp_rank 1
    dp_rank 0  cp_rank 0  [ 0,  1]    [ 2,  3]          each [a, b] is one TP group
               cp_rank 1  [ 4,  5]    [ 6,  7]
    dp_rank 1  cp_rank 0  [ 8,  9]    [10, 11]
               cp_rank 1  [12, 13]    [14, 15]

    sequence-parallel (Ulysses)   [0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]     grid[k, j, c, :, i]
    context-parallel              [0,4] [1,5] [2,6] [3,7] [8,12] [9,13] [10,14] [11,15]     grid[k, j, :, m, i]
    context-sequence-parallel (CP x SP: one sequence)  [0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15]
                                                                                            grid[k, j, :, :, i]
    data-parallel                 [0,8] [1,9] [2,10] [3,11] [4,12] [5,13] [6,14] [7,15]     grid[k, :, c, m, i]
    sequence-data-parallel (DP x CP x SP)  [0,2,4,6,8,10,12,14] [1,3,5,7,9,11,13,15]       grid[k, :, :, :, i]

A context-parallel group holds the ``cp`` parts of the same samples: CP rank ``c`` keeps chunks ``c`` and
``2cp-1-c`` of the ``2cp`` chunks of every sequence (``model/token_layout.py``), and inside that the Ulysses rank
``m`` keeps the ``m``-th contiguous ``1/sp`` of them. Here ranks 0, 2, 4, 6 (one DP index, TP rank 0) read the same
micro-batch of ``S`` tokens; rank 0 keeps the first half of chunks 0 and 3, rank 2 the second half, rank 4 the
first half of chunks 1 and 2, rank 6 the rest. Ulysses all-to-alls heads inside a CP rank (ranks 0 and 2 then
attend over chunks 0 and 3 with half the heads each), the ring exchanges K/V across CP ranks (0 with 4).

A Ulysses group holds the ``sp`` slices of the same samples (one DP index), so its ranks read the same micro-batch
and keep ``s/sp`` tokens each. DeepSpeed reduces dense gradients over sequence-data-parallel (DP x CP x SP) and
shards ZeRO states over it; the loss sums its tokens over context-sequence-parallel (``model.utils.loss_func``);
"data-parallel" stays the DP axis (the data sampler, the reported loss). Megatron's sequence parallelism
(``--sequence-parallel``) is another thing: it reuses the TP group.

``initialize_model_parallel`` validates the degrees (identically on every rank, before any group exists), builds
every group on every rank with ``torch.distributed.new_group`` and returns a :class:`ParallelState`; the module
keeps it as the default for the module-level getters. Both the module and the object can be passed to DeepSpeed as
``mpu=``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron.config.rules import divisors

ProcessGroup = dist.ProcessGroup

_NOT_INITIALIZED = "model parallel is not initialized; call initialize_model_parallel"


@dataclass(frozen=True)
class RankGrid:
    """Every group of a layout as lists of global ranks (pure data; see the module docstring for an example)."""

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    tensor_model_parallel: list[list[int]]
    data_parallel: list[list[int]]
    pipeline_model_parallel: list[list[int]]
    model_parallel: list[list[int]]
    embedding: list[list[int]]
    position_embedding: list[list[int]]
    sequence_parallel: list[list[int]]
    sequence_parallel_size: int = 1
    """DeepSpeed-Ulysses degree N (``--ds-sequence-parallel-size``)."""
    sequence_data_parallel: list[list[int]] = field(default_factory=list)
    """DP x CP x Ulysses SP ranks at one stage and TP rank (DeepSpeed reduces dense gradients and shards ZeRO over
    it)."""
    context_parallel_size: int = 1
    """Context-parallel degree (``--context-parallel-size``)."""
    context_parallel: list[list[int]] = field(default_factory=list)
    """The CP ranks of one stage, DP index, Ulysses rank and TP rank (attention exchanges K/V over them)."""
    context_sequence_parallel: list[list[int]] = field(default_factory=list)
    """CP x Ulysses SP ranks of one stage, DP index and TP rank: the ranks splitting one sequence (the loss sums
    its tokens over them)."""

    def group_of(self, kind: str, rank: int) -> list[int] | None:
        """The ranks of the ``kind`` group holding ``rank`` (None when no such group holds it)."""
        for ranks in getattr(self, kind):
            if rank in ranks:
                return ranks
        return None


def validate_degrees(
    world_size: int,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    *,
    ds_sequence_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> int:
    """Check the parallel degrees and return the derived data-parallel size ``W / (p * pp * cp * sp)``.

    Raises:
        ValueError: one message with world size, TP, PP, CP and Ulysses SP when a degree is not a positive integer
            or ``world_size`` is not divisible by ``tp * pp * cp * sp``.
    """
    tp, pp, sp = tensor_model_parallel_size, pipeline_model_parallel_size, ds_sequence_parallel_size
    cp = context_parallel_size
    values = (
        f"world size {world_size}, --tensor-model-parallel-size {tp}, "
        f"--pipeline-model-parallel-size {pp}"
    )
    if sp != 1:
        values += f", --ds-sequence-parallel-size {sp}"
    if cp != 1:
        values += f", --context-parallel-size {cp}"
    for name, v in (
        ("world size", world_size),
        ("tensor", tp),
        ("pipeline", pp),
        ("sequence", sp),
        ("context", cp),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(
                f"invalid parallel degrees ({values}): the {name} size must be a positive integer; "
                "pass 1 to disable that kind of parallelism."
            )
    if world_size % (tp * pp * sp * cp) != 0:
        what = (
            "tensor x pipeline"
            + (" x context" if cp != 1 else "")
            + (" x sequence" if sp != 1 else "")
        )
        raise ValueError(
            f"invalid parallel degrees ({values}): the world size must be divisible by "
            f"{what} = {tp * pp * sp * cp} (data-parallel size = world / ({what})); "
            f"choose {what} among the divisors of {world_size}: {', '.join(map(str, divisors(world_size)))}."
        )
    return world_size // (tp * pp * sp * cp)


def rank_grid(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    *,
    ds_sequence_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> RankGrid:
    """The rank lists of every group kind for a layout (pure function, no torch.distributed needed).

    Raises:
        ValueError: see :func:`validate_degrees`.
    """
    tp, pp, sp = tensor_model_parallel_size, pipeline_model_parallel_size, ds_sequence_parallel_size
    cp = context_parallel_size
    dp = validate_degrees(
        world_size, tp, pp, ds_sequence_parallel_size=sp, context_parallel_size=cp
    )
    grid = torch.arange(world_size).reshape(pp, dp, cp, sp, tp)  # [pp, dp, cp, sp, p]

    def lists(index: Callable[[int, int, int, int, int], torch.Tensor]) -> list[list[int]]:
        # one group per (stage, DP, CP, SP, TP) index that ``index`` keeps; duplicates dropped, order kept
        out: dict[tuple[int, ...], None] = {}
        for k, j, c, m, i in itertools.product(*(range(n) for n in (pp, dp, cp, sp, tp))):
            out[tuple(index(k, j, c, m, i).flatten().tolist())] = None
        return [list(r) for r in out]

    pipe = lists(lambda k, j, c, m, i: grid[:, j, c, m, i])
    return RankGrid(
        world_size=world_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=dp,
        tensor_model_parallel=lists(lambda k, j, c, m, i: grid[k, j, c, m, :]),
        data_parallel=lists(lambda k, j, c, m, i: grid[k, :, c, m, i]),
        pipeline_model_parallel=pipe,
        model_parallel=lists(lambda k, j, c, m, i: grid[:, j, c, m, :]),
        embedding=[[r[0], r[-1]] if len(r) > 1 else [r[0]] for r in pipe],
        position_embedding=[[r[0]] for r in pipe],
        sequence_parallel=lists(lambda k, j, c, m, i: grid[k, j, c, :, i]),
        sequence_parallel_size=sp,
        sequence_data_parallel=lists(lambda k, j, c, m, i: grid[k, :, :, :, i]),
        context_parallel_size=cp,
        context_parallel=lists(lambda k, j, c, m, i: grid[k, j, :, m, i]),
        context_sequence_parallel=lists(lambda k, j, c, m, i: grid[k, j, :, :, i]),
    )


@dataclass(frozen=True)
class ParallelState:
    """The groups of one rank. Its methods are the DeepSpeed ``mpu`` interface (pass the object as ``mpu=``)."""

    grid: RankGrid
    rank: int
    groups: dict[str, ProcessGroup | None] = field(repr=False)
    """kind (a :class:`RankGrid` field name) -> this rank's group of that kind (None: rank in no such group)."""

    def _ranks(self, kind: str) -> list[int]:
        ranks = self.grid.group_of(kind, self.rank)
        if ranks is None:
            holders = {
                "embedding": "only the first and last pipeline stages are; check is_rank_in_embedding_group()",
                "position_embedding": "only the first pipeline stage is; check is_pipeline_first_stage()",
            }.get(kind, "see rank_grid()")
            raise RuntimeError(
                f"rank {self.rank} is in no {kind.replace('_', '-')} group ({holders})"
            )
        return ranks

    def _group(self, kind: str) -> ProcessGroup:
        self._ranks(kind)
        group = self.groups[kind]
        if group is None:  # pragma: no cover - _ranks raised already
            raise RuntimeError(f"no {kind} group on rank {self.rank}")
        return group

    # tensor model parallel (Megatron's TP; DeepSpeed's "slice")
    def get_tensor_model_parallel_group(self) -> ProcessGroup:
        """The TP group of this rank."""
        return self._group("tensor_model_parallel")

    def get_tensor_model_parallel_world_size(self) -> int:
        """TP size ``p``."""
        return self.grid.tensor_model_parallel_size

    def get_tensor_model_parallel_rank(self) -> int:
        """Index of this rank in its TP group."""
        return self._ranks("tensor_model_parallel").index(self.rank)

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 of this rank's TP group."""
        return self._ranks("tensor_model_parallel")[0]

    get_slice_parallel_group = get_tensor_model_parallel_group
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_rank = get_tensor_model_parallel_rank

    # Megatron aliases: "model parallel" rank / size mean TP; the group is TP x PP (one DP index).
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank

    def get_model_parallel_group(self) -> ProcessGroup:
        """The TP x PP group sharing this rank's DP index (DeepSpeed reduces grad norms over it)."""
        return self._group("model_parallel")

    # pipeline model parallel (DeepSpeed's "pipe")
    def get_pipeline_model_parallel_group(self) -> ProcessGroup:
        """The PP group (one rank per stage) of this rank."""
        return self._group("pipeline_model_parallel")

    def get_pipeline_model_parallel_world_size(self) -> int:
        """Number of pipeline stages."""
        return self.grid.pipeline_model_parallel_size

    def get_pipeline_model_parallel_rank(self) -> int:
        """Pipeline stage of this rank."""
        return self._ranks("pipeline_model_parallel").index(self.rank)

    def get_pipeline_model_parallel_first_rank(self) -> int:
        """Global rank of stage 0 in this rank's PP group."""
        return self._ranks("pipeline_model_parallel")[0]

    def get_pipeline_model_parallel_last_rank(self) -> int:
        """Global rank of the last stage in this rank's PP group."""
        return self._ranks("pipeline_model_parallel")[-1]

    def get_pipeline_model_parallel_next_rank(self) -> int:
        """Global rank of the next stage (wraps around)."""
        ranks = self._ranks("pipeline_model_parallel")
        return ranks[(ranks.index(self.rank) + 1) % len(ranks)]

    def get_pipeline_model_parallel_prev_rank(self) -> int:
        """Global rank of the previous stage (wraps around)."""
        ranks = self._ranks("pipeline_model_parallel")
        return ranks[(ranks.index(self.rank) - 1) % len(ranks)]

    def is_pipeline_first_stage(self) -> bool:
        """True on pipeline stage 0."""
        return self.get_pipeline_model_parallel_rank() == 0

    def is_pipeline_last_stage(self) -> bool:
        """True on the last pipeline stage."""
        return self.get_pipeline_model_parallel_rank() == self.grid.pipeline_model_parallel_size - 1

    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank

    # data parallel
    def get_data_parallel_group(self) -> ProcessGroup:
        """The DP group (same TP rank and stage, every DP index) of this rank."""
        return self._group("data_parallel")

    def get_data_parallel_world_size(self) -> int:
        """DP size ``W / (p * pp)``."""
        return self.grid.data_parallel_size

    def get_data_parallel_rank(self) -> int:
        """Index of this rank in its DP group."""
        return self._ranks("data_parallel").index(self.rank)

    def get_data_parallel_src_rank(self) -> int:
        """Global rank of DP rank 0 of this rank's DP group."""
        return self._ranks("data_parallel")[0]

    def get_data_parallel_group_ranks(self) -> list[int]:
        """Global ranks of this rank's DP group (DeepSpeed checkpointing asks for them)."""
        return list(self._ranks("data_parallel"))

    # embedding groups (tied input/output embeddings across the first and last stage)
    def is_rank_in_embedding_group(self) -> bool:
        """True on the first and last pipeline stage."""
        return self.grid.group_of("embedding", self.rank) is not None

    def get_embedding_group(self) -> ProcessGroup:
        """First + last stage of this rank's PP group (raises on middle stages)."""
        return self._group("embedding")

    def get_position_embedding_group(self) -> ProcessGroup:
        """First stage of this rank's PP group (raises on other stages)."""
        return self._group("position_embedding")

    # DeepSpeed-Ulysses sequence parallelism (DeepSpeed's engine and ZeRO read these through ``mpu``).
    def get_sequence_parallel_group(self) -> ProcessGroup:
        """The Ulysses group of this rank (same stage, DP index and TP rank; only this rank at size 1)."""
        return self._group("sequence_parallel")

    def get_sequence_parallel_world_size(self) -> int:
        """Ulysses degree ``sp`` (``--ds-sequence-parallel-size``)."""
        return self.grid.sequence_parallel_size

    def get_sequence_parallel_rank(self) -> int:
        """Index of this rank in its Ulysses group: which ``s/sp`` slice of the sequence it holds."""
        return self._ranks("sequence_parallel").index(self.rank)

    def get_sequence_data_parallel_group(self) -> ProcessGroup:
        """DP x CP x SP ranks of this stage and TP rank (the DP group at cp = sp = 1): dense gradients are reduced
        and ZeRO states sharded over it."""
        return self._group("sequence_data_parallel")

    def get_sequence_data_parallel_world_size(self) -> int:
        """``dp * cp * sp``."""
        g = self.grid
        return g.data_parallel_size * g.context_parallel_size * g.sequence_parallel_size

    def get_sequence_data_parallel_rank(self) -> int:
        """Index of this rank in its sequence-data-parallel group."""
        return self._ranks("sequence_data_parallel").index(self.rank)

    # context parallelism (``--context-parallel-size``; Megatron-LM's names)
    def get_context_parallel_group(self) -> ProcessGroup:
        """The CP group of this rank (same stage, DP index, Ulysses rank and TP rank; only this rank at cp = 1)."""
        return self._group("context_parallel")

    def get_context_parallel_world_size(self) -> int:
        """CP degree ``cp`` (``--context-parallel-size``)."""
        return self.grid.context_parallel_size

    def get_context_parallel_rank(self) -> int:
        """Index of this rank in its CP group: it holds chunks ``r`` and ``2cp-1-r`` of every sequence."""
        return self._ranks("context_parallel").index(self.rank)

    def get_context_parallel_global_ranks(self) -> list[int]:
        """Global ranks of this rank's CP group, in CP-rank order."""
        return list(self._ranks("context_parallel"))

    def get_context_sequence_parallel_group(self) -> ProcessGroup:
        """CP x Ulysses SP ranks of this stage, DP index and TP rank: the ranks splitting one sequence (the loss
        sums its tokens and their count over it)."""
        return self._group("context_sequence_parallel")

    def get_context_sequence_parallel_world_size(self) -> int:
        """``cp * sp``: the ranks one sequence is split over."""
        return self.grid.context_parallel_size * self.grid.sequence_parallel_size


_STATE: ParallelState | None = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    *,
    ds_sequence_parallel_size: int = 1,
    context_parallel_size: int = 1,
    timeout: timedelta | None = None,
) -> ParallelState:
    """Build every TP / PP / DP / model / embedding group on every rank and keep them as the default.

    Preconditions: ``torch.distributed`` is initialized; every rank calls this with the same arguments.

    Args:
        tensor_model_parallel_size: TP degree p.
        pipeline_model_parallel_size: PP degree.
        ds_sequence_parallel_size: DeepSpeed-Ulysses degree (``--ds-sequence-parallel-size``).
        context_parallel_size: context-parallel degree (``--context-parallel-size``).
        timeout: the timeout of every collective on every group built here (--distributed-timeout-minutes);
            None: torch's default for new groups (30 minutes on gloo), which the default group's timeout does
            NOT change, so a stalled rank would block TP/PP/DP collectives that long.

    Raises:
        RuntimeError: torch.distributed not initialized, or already initialized here (destroy first).
        ValueError: impossible degrees (see :func:`validate_degrees`); raised on every rank before any group
            is created, so no rank hangs.
    """
    global _STATE
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "initialize_model_parallel needs torch.distributed; call torch.distributed.init_process_group "
            "(or deepspeed.init_distributed) first"
        )
    if _STATE is not None:
        raise RuntimeError(
            "model parallel is already initialized; call destroy_model_parallel() before initializing again"
        )
    grid = rank_grid(
        dist.get_world_size(),
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        ds_sequence_parallel_size=ds_sequence_parallel_size,
        context_parallel_size=context_parallel_size,
    )
    rank = dist.get_rank()
    made: dict[tuple[int, ...], ProcessGroup] = {}
    groups: dict[str, ProcessGroup | None] = {}
    kinds = (
        "tensor_model_parallel",
        "data_parallel",
        "pipeline_model_parallel",
        "model_parallel",
        "embedding",
        "position_embedding",
        "sequence_parallel",
        "sequence_data_parallel",
        "context_parallel",
        "context_sequence_parallel",
    )
    for kind in kinds:
        groups[kind] = None
        for ranks in getattr(grid, kind):
            key = tuple(ranks)
            if key not in made:  # same call order on every rank: new_group is collective
                made[key] = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                groups[kind] = made[key]
    _STATE = ParallelState(grid=grid, rank=rank, groups=groups)
    return _STATE


def model_parallel_is_initialized() -> bool:
    """True between :func:`initialize_model_parallel` and :func:`destroy_model_parallel`."""
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Forget the default state (the process groups themselves die with the default group)."""
    global _STATE
    _STATE = None


def get_parallel_state() -> ParallelState:
    """The default :class:`ParallelState` (raises RuntimeError when not initialized)."""
    if _STATE is None:
        raise RuntimeError(_NOT_INITIALIZED)
    return _STATE


def _getter(name: str) -> Callable[[], Any]:
    """A module-level function calling ``ParallelState.<name>`` on the default state."""
    method = getattr(ParallelState, name)

    def get() -> Any:
        return method(get_parallel_state())

    get.__name__ = get.__qualname__ = name
    get.__doc__ = method.__doc__
    return get


# Module-level getters: each delegates to the default ParallelState (DeepSpeed calls these on the module).
get_tensor_model_parallel_group = _getter("get_tensor_model_parallel_group")
get_tensor_model_parallel_world_size = _getter("get_tensor_model_parallel_world_size")
get_tensor_model_parallel_rank = _getter("get_tensor_model_parallel_rank")
get_tensor_model_parallel_src_rank = _getter("get_tensor_model_parallel_src_rank")
get_slice_parallel_group = _getter("get_slice_parallel_group")
get_slice_parallel_world_size = _getter("get_slice_parallel_world_size")
get_slice_parallel_rank = _getter("get_slice_parallel_rank")
get_model_parallel_group = _getter("get_model_parallel_group")
get_model_parallel_world_size = _getter("get_model_parallel_world_size")
get_model_parallel_rank = _getter("get_model_parallel_rank")
get_pipeline_model_parallel_group = _getter("get_pipeline_model_parallel_group")
get_pipeline_model_parallel_world_size = _getter("get_pipeline_model_parallel_world_size")
get_pipeline_model_parallel_rank = _getter("get_pipeline_model_parallel_rank")
get_pipeline_model_parallel_first_rank = _getter("get_pipeline_model_parallel_first_rank")
get_pipeline_model_parallel_last_rank = _getter("get_pipeline_model_parallel_last_rank")
get_pipeline_model_parallel_next_rank = _getter("get_pipeline_model_parallel_next_rank")
get_pipeline_model_parallel_prev_rank = _getter("get_pipeline_model_parallel_prev_rank")
get_pipe_parallel_group = _getter("get_pipe_parallel_group")
get_pipe_parallel_world_size = _getter("get_pipe_parallel_world_size")
get_pipe_parallel_rank = _getter("get_pipe_parallel_rank")
is_pipeline_first_stage = _getter("is_pipeline_first_stage")
is_pipeline_last_stage = _getter("is_pipeline_last_stage")
get_data_parallel_group = _getter("get_data_parallel_group")
get_data_parallel_world_size = _getter("get_data_parallel_world_size")
get_data_parallel_rank = _getter("get_data_parallel_rank")
get_data_parallel_src_rank = _getter("get_data_parallel_src_rank")
get_data_parallel_group_ranks = _getter("get_data_parallel_group_ranks")
is_rank_in_embedding_group = _getter("is_rank_in_embedding_group")
get_embedding_group = _getter("get_embedding_group")
get_position_embedding_group = _getter("get_position_embedding_group")
get_sequence_parallel_group = _getter("get_sequence_parallel_group")
get_sequence_parallel_world_size = _getter("get_sequence_parallel_world_size")
get_sequence_parallel_rank = _getter("get_sequence_parallel_rank")
get_sequence_data_parallel_group = _getter("get_sequence_data_parallel_group")
get_sequence_data_parallel_world_size = _getter("get_sequence_data_parallel_world_size")
get_sequence_data_parallel_rank = _getter("get_sequence_data_parallel_rank")
get_context_parallel_group = _getter("get_context_parallel_group")
get_context_parallel_world_size = _getter("get_context_parallel_world_size")
get_context_parallel_rank = _getter("get_context_parallel_rank")
get_context_parallel_global_ranks = _getter("get_context_parallel_global_ranks")
get_context_sequence_parallel_group = _getter("get_context_sequence_parallel_group")
get_context_sequence_parallel_world_size = _getter("get_context_sequence_parallel_world_size")


def resolve_group(group: ProcessGroup | None) -> ProcessGroup | None:
    """The process group a TP layer or mapping works on.

    An explicit ``group`` is returned as is; ``None`` means the default TP group when torch.distributed is
    initialized, and a world of one process (returned as ``None``) when it is not.

    Raises:
        RuntimeError: ``group`` is None, torch.distributed is initialized but model parallel is not.
    """
    if group is not None:
        return group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return get_tensor_model_parallel_group()


def group_world_size(group: ProcessGroup | None) -> int:
    """Size of a group from :func:`resolve_group` (``None``: the single-process world, 1)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's index in a group from :func:`resolve_group` (``None``: 0)."""
    return 0 if group is None else dist.get_rank(group)
