"""Full parameters of a ZeRO-3 checkpoint, rebuilt from DeepSpeed's fp32 partitions (offline, no process group).

Under ZeRO stage 3 the module weights in ``*_model_states.pt`` are empty placeholders; each data-parallel rank's
``zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt`` holds, per optimizer parameter group, one flat fp32 tensor
(``optimizer_state_dict.fp32_flat_groups``). The model-state file lists the group's parameters in order
(``param_shapes``, TP-local shapes). With ``D`` data-parallel ranks, a parameter of ``numel`` elements is split into
``D`` equal pieces of ``ceil(numel / D)`` elements (the last one zero-padded); rank ``d``'s flat group is its piece
of every parameter of the group, concatenated in order (plus alignment padding at the end)::

    rank d flat group g:  [ p0[d*c0:(d+1)*c0] | p1[d*c1:(d+1)*c1] | ... | pad ]      c_i = ceil(numel_i / D)
    parameter i        =  cat_d(rank d piece i)[:numel_i].view(shape_i)

The optimizer files hold two DeepSpeed classes besides tensors (the ZeRO stage enum and the loss scaler); they are
read with ``torch.load(weights_only=True)`` allowing exactly those classes, so no other pickled code can run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_MODEL_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def zero3_model_files(tag_dir: Path, tp_rank: int) -> list[Path]:
    """The ``zero_pp_rank_{d}_mp_rank_{tp_rank:02d}_model_states.pt`` files of one TP rank, ordered by DP rank."""
    found: dict[int, Path] = {}
    for path in tag_dir.glob(f"zero_pp_rank_*_mp_rank_{tp_rank:02d}_model_states.pt"):
        m = _MODEL_FILE.search(path.name)
        if m is not None:
            found[int(m.group(1))] = path
    missing = sorted(set(range(len(found))) - set(found))
    if missing:
        raise FileNotFoundError(
            f"{tag_dir}: the ZeRO files of data-parallel rank(s) {missing} (TP rank {tp_rank}) are missing; "
            "copy the whole checkpoint directory."
        )
    return [found[d] for d in sorted(found)]


def is_zero3_checkpoint(tag_dir: Path) -> bool:
    """True when ``tag_dir`` holds ZeRO-3 (partitioned-parameter) model-state files."""
    return any(tag_dir.glob("zero_pp_rank_*_mp_rank_*_model_states.pt"))


def _safe_globals() -> list[Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [ZeroStageEnum, LossScaler, DynamicLossScaler]


def load_zero_file(path: Path) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of a DeepSpeed model/optimizer-state file (allowing DeepSpeed's enum and
    loss-scaler classes only).

    Raises:
        ValueError: the file is corrupt or holds other pickled objects.
    """
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # refused global or corrupt file: one clear message
        first = str(err).splitlines()[0] if str(err) else ""
        raise ValueError(
            f"{path} cannot be read with torch.load(weights_only=True) ({type(err).__name__}: {first}); "
            "is it a DeepSpeed ZeRO checkpoint file from a trusted run?"
        ) from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a {type(obj).__name__}, not a DeepSpeed state dict.")
    return obj


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
    param_shapes: list[dict[str, torch.Size]], flat_groups_per_rank: list[list[torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Rebuild every parameter from the per-DP-rank fp32 flat groups (see the module docstring).

    Args:
        param_shapes: per optimizer group, ``{name: shape}`` in partition order.
        flat_groups_per_rank: ``[d][g]`` rank ``d``'s flat fp32 tensor of group ``g``.

    Returns:
        ``{name: fp32 tensor of its shape}`` (new tensors, not views of the flat groups).

    Raises:
        ValueError: the group counts disagree, or a flat group is shorter than its parameters need.
    """
    dp = len(flat_groups_per_rank)
    if any(len(groups) != len(param_shapes) for groups in flat_groups_per_rank):
        raise ValueError(
            f"the optimizer files hold {[len(x) for x in flat_groups_per_rank]} parameter groups per "
            f"rank; the model-state file lists {len(param_shapes)}."
        )
    out: dict[str, torch.Tensor] = {}
    for g, shapes in enumerate(param_shapes):
        avail = min(flat[g].numel() for flat in flat_groups_per_rank)
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            piece = -(-numel // dp)  # ceil: every rank holds an equal, zero-padded piece
            if offset + piece > avail:
                raise ValueError(
                    f"ZeRO-3 flat group {g} holds {avail} elements per rank, too short for parameter "
                    f"{name} (needs {offset + piece}); the checkpoint is damaged or from another model."
                )
            pieces = [flat[g].narrow(0, offset, piece) for flat in flat_groups_per_rank]
            out[name] = torch.cat(pieces)[:numel].view(shape).clone()  # [dp * piece] -> shape
            offset += piece
    return out


def read_zero3_tp_shard(
    tag_dir: Path,
    tp_rank: int,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """The full fp32 parameters of TP rank ``tp_rank`` (TP-local shapes, Megatron names) of a ZeRO-3 checkpoint.

    Raises:
        FileNotFoundError: a model- or optimizer-state file is missing.
        ValueError: a file cannot be read safely or its contents disagree.
    """
    model_files = zero3_model_files(tag_dir, tp_rank)
    if not model_files:
        raise FileNotFoundError(f"{tag_dir} has no ZeRO-3 model-state files for TP rank {tp_rank}.")
    shapes = _param_shapes(load_zero_file(model_files[0]), model_files[0])
    flat: list[list[torch.Tensor]] = []
    for d, model_file in enumerate(model_files):
        optim = model_file.with_name(
            model_file.name.replace("_model_states.pt", "_optim_states.pt")
        )
        if not optim.is_file():
            raise FileNotFoundError(
                f"{optim} is missing: a ZeRO-3 checkpoint keeps its weights in the optimizer files."
            )
        state = load_zero_file(optim).get("optimizer_state_dict", {})
        groups = state.get("fp32_flat_groups") if isinstance(state, dict) else None
        if not isinstance(groups, list) or not all(isinstance(t, torch.Tensor) for t in groups):
            raise ValueError(f"{optim} has no 'fp32_flat_groups' (not a ZeRO-3 optimizer file).")
        flat.append([t.float() for t in groups])
        if progress is not None:
            progress(f"reading ZeRO-3 partitions (TP rank {tp_rank})", d + 1, len(model_files))
    return merge_zero3_partitions(shapes, flat)
