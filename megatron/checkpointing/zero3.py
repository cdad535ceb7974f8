"""Full parameters of a ZeRO-3 checkpoint, rebuilt from DeepSpeed's fp32 partitions (offline, no process group).

Under ZeRO stage 3 the module weights in ``*_model_states.pt`` are empty placeholders. Each data-parallel rank
``d`` of TP rank ``t`` writes ``[bf16_]zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt`` whose
``optimizer_state_dict.fp32_flat_groups`` is a list of flat fp32 tensors (DeepSpeed's sub-groups); the model-state
file lists the parameters in the same order (``param_shapes``, TP-local shapes, one dict per group). With ``D``
data-parallel ranks (``partition_count``), a parameter of ``numel`` elements is split into ``D`` equal pieces of
``c = ceil(numel / D)`` elements (the last one zero-padded). Read as one stream (the flat groups concatenated),
rank ``d``'s stream is its piece of every parameter, in order, with nothing else::

    rank d stream:  [ p0[d*c0:(d+1)*c0] | p1[d*c1:(d+1)*c1] | ... ]        c_i = ceil(numel_i / D)
    parameter i  =  cat_d(rank d piece i)[:numel_i].view(shape_i)

so the pieces must use every element of each stream exactly (DeepSpeed's ``zero_to_fp32`` checks the same).

The optimizer files hold three DeepSpeed classes besides tensors and plain containers (the ZeRO stage enum and the
loss scalers); they are read with ``torch.load(weights_only=True)`` allowing exactly those classes, so no other
pickled code can run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.safe_load import load_state_dict_of
from megatron.deepspeed_internals import zero_checkpoint_classes

_MODEL_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def zero3_model_files(tag_dir: Path, tp_rank: int) -> list[Path]:
    """The ``zero_pp_rank_{d}_mp_rank_{tp_rank:02d}_model_states.pt`` files of one TP rank, ordered by DP rank."""
    found: dict[int, Path] = {}
    for path in tag_dir.glob(f"zero_pp_rank_*_mp_rank_{tp_rank:02d}_model_states.pt"):
        m = _MODEL_FILE.search(path.name)
        if m is not None:
            found[int(m.group(1))] = path
    missing = sorted(set(range(max(found, default=-1) + 1)) - set(found))
    if missing:
        raise FileNotFoundError(
            f"{tag_dir}: the ZeRO files of data-parallel rank(s) {missing} (TP rank {tp_rank}) are missing; "
            "copy the whole checkpoint directory."
        )
    return [found[d] for d in sorted(found)]


def optim_file_for(model_file: Path) -> Path:
    """The optimizer-state file beside a ZeRO model-state file (``bf16_`` prefixed when the run used bf16).

    Raises:
        FileNotFoundError: none, or more than one candidate.
    """
    name = model_file.name.replace("_model_states.pt", "_optim_states.pt")
    found = sorted(model_file.parent.glob(f"*{name}"))
    found = [p for p in found if p.name in (name, f"bf16_{name}")]
    if len(found) != 1:
        raise FileNotFoundError(
            f"{model_file.parent / name} is {'missing' if not found else 'ambiguous'}: a ZeRO-3 checkpoint "
            "keeps its weights in the optimizer files (one per data-parallel rank)."
        )
    return found[0]


def is_zero3_checkpoint(tag_dir: Path, meta: dict[str, Any] | None = None) -> bool:
    """True when ``tag_dir`` was saved with ZeRO stage 3: ``meta["zero_stage"]`` when recorded, else the presence
    of ZeRO-3 model-state files (checkpoints written before the stage was recorded)."""
    if meta is not None and "zero_stage" in meta:
        return int(meta["zero_stage"]) == 3
    return any(tag_dir.glob("zero_pp_rank_*_mp_rank_*_model_states.pt"))


def load_zero_file(path: Path) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of a DeepSpeed model/optimizer-state file (allowing DeepSpeed's enum and
    loss-scaler classes only; memory-mapped: only the tensors used are paged in, not the Adam moments beside).

    Raises:
        ValueError: the file is corrupt or holds other pickled objects (named in the message).
    """
    return load_state_dict_of(path, allowed=zero_checkpoint_classes(), mmap=True)


def _param_shapes(model_state: dict[str, Any], path: Path) -> list[dict[str, torch.Size]]:
    shapes = model_state.get("param_shapes")
    if not isinstance(shapes, list) or not shapes:
        raise ValueError(f"{path} has no 'param_shapes' (not a ZeRO-3 model-state file).")
    if model_state.get("frozen_param_shapes") or model_state.get("shared_params"):
        raise ValueError(
            f"{path} lists frozen or shared parameters, which Trident models do not have; "
            "was it written by another program?"
        )
    return shapes


def merge_zero3_partitions(
    param_shapes: Sequence[dict[str, torch.Size]],
    flat_groups_per_rank: Sequence[Sequence[torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """Rebuild every parameter from the per-DP-rank fp32 flat groups (see the module docstring).

    Args:
        param_shapes: ``{name: shape}`` per group, in partition order (the groups are read as one sequence).
        flat_groups_per_rank: ``[d][g]`` rank ``d``'s flat fp32 tensor of group ``g`` (read as one stream).

    Returns:
        ``{name: fp32 tensor of its shape}`` (new tensors, not views of the flat groups).

    Raises:
        ValueError: the ranks' streams differ in length, or the parameters do not use them exactly.
    """
    dp = len(flat_groups_per_rank)
    streams = [
        torch.cat([g.reshape(-1).float() for g in groups]) for groups in flat_groups_per_rank
    ]
    avail = streams[0].numel()
    if any(s.numel() != avail for s in streams):
        raise ValueError(
            f"the data-parallel ranks hold {[s.numel() for s in streams]} fp32 elements; a ZeRO-3 checkpoint "
            "has the same number on every rank (mixed files from different saves?)."
        )
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in ((n, s) for group in param_shapes for n, s in group.items()):
        numel = math.prod(shape)
        piece = -(-numel // dp)  # ceil: every rank holds an equal, zero-padded piece
        if offset + piece > avail:
            raise ValueError(
                f"the ZeRO-3 partitions hold {avail} elements per rank, too few for parameter {name} "
                f"(needs {offset + piece}); the checkpoint is damaged or from another model."
            )
        pieces = [s.narrow(0, offset, piece) for s in streams]
        out[name] = torch.cat(pieces)[:numel].view(shape).clone()  # [dp * piece] -> shape
        offset += piece
    if offset != avail:
        raise ValueError(
            f"the parameters use {offset} of the {avail} elements each ZeRO-3 partition holds; the files do "
            "not belong to this model (or the data-parallel size is wrong)."
        )
    return out


def _partition_count(state: dict[str, Any], path: Path) -> int:
    count = state.get("partition_count")
    if isinstance(count, list | tuple) and count:
        count = max(count)
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"{path} records no partition_count (not a ZeRO optimizer file).")
    return count


def read_zero3_tp_shard(
    tag_dir: Path,
    tp_rank: int,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """The full fp32 parameters of TP rank ``tp_rank`` (TP-local shapes, Megatron names) of a ZeRO-3 checkpoint.

    Raises:
        FileNotFoundError: a model- or optimizer-state file is missing.
        ValueError: a file cannot be read safely, or the files disagree (data-parallel size, sizes).
    """
    model_files = zero3_model_files(tag_dir, tp_rank)
    if not model_files:
        raise FileNotFoundError(f"{tag_dir} has no ZeRO-3 model-state files for TP rank {tp_rank}.")
    shapes = _param_shapes(load_zero_file(model_files[0]), model_files[0])
    flat: list[list[torch.Tensor]] = []
    for d, model_file in enumerate(model_files):
        optim = optim_file_for(model_file)
        state = load_zero_file(optim).get("optimizer_state_dict", {})
        groups = state.get("fp32_flat_groups") if isinstance(state, dict) else None
        if not isinstance(groups, list) or not all(isinstance(t, torch.Tensor) for t in groups):
            raise ValueError(f"{optim} has no 'fp32_flat_groups' (not a ZeRO-3 optimizer file).")
        count = _partition_count(state, optim)
        if count != len(model_files):
            raise ValueError(
                f"{optim} was saved by {count} data-parallel ranks but {tag_dir} holds ZeRO files of "
                f"{len(model_files)} (TP rank {tp_rank}); files of another save are mixed in, or some are "
                "missing. Copy the checkpoint directory again."
            )
        flat.append(list(groups))
        if progress is not None:
            progress(f"reading ZeRO-3 partitions (TP rank {tp_rank})", d + 1, len(model_files))
    return merge_zero3_partitions(shapes, flat)


def read_zero3_client_state(tag_dir: Path, tp_rank: int) -> dict[str, Any]:
    """The state saved beside the weights of a ZeRO-3 checkpoint (iteration, consumed samples, LR scheduler, ...:
    the same in every rank's model-state file; read from data-parallel rank 0's of ``tp_rank``).

    Raises:
        FileNotFoundError: the TP rank has no model-state file.
        ValueError: the file cannot be read safely.
    """
    model_files = zero3_model_files(tag_dir, tp_rank)
    if not model_files:
        raise FileNotFoundError(f"{tag_dir} has no ZeRO-3 model-state files for TP rank {tp_rank}.")
    return load_zero_file(model_files[0])
