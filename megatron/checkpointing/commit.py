"""The two ends of a save's crash-safe protocol, shared by the synchronous save and --async-save (``engine.py``).

Before any file is written (:func:`prepare_tag`): rank 0 moves 'latest' off a tag that is being re-saved and
removes its marker, then a barrier. After every rank's files are on disk (:func:`commit`): rank 0 writes
``trident_meta.json`` (the completion marker, with the merged checksums) and moves both pointers, each by temp file
+ ``os.replace``, then a barrier. A process killed anywhere in between leaves the pointers at the previous complete
checkpoint (``pointers.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron.checkpointing.checksums import CHECKSUMS_KEY, merge_sidecars, remove_sidecars
from megatron.checkpointing.meta import META_FILE
from megatron.checkpointing.pointers import (
    ITERATION_FILE,
    LATEST_FILE,
    atomic_write,
    retreat_latest,
    tag_for_iteration,
)
from megatron.log import global_rank
from megatron.mpu.mappings import all_reduce_max_, communication_device


@dataclass
class SaveCommit:
    """What moving the pointers to a written checkpoint needs: its directory, iteration and meta record."""

    tag_dir: Path
    iteration: int
    meta: dict[str, Any]
    """``trident_meta.json`` less the checksums (built when the save started)."""
    hashed: bool = False
    """The files were written through the checksum recorder (the meta gets the merged sidecars)."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint file could not be written; 'latest' still names the last complete checkpoint."""


def prepare_tag(save_dir: Path, tag: str) -> Path:
    """Create ``save_dir/tag``; rank 0 moves 'latest' off it and removes its marker and sidecars (a re-save)."""
    tag_dir = save_dir / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    marker = tag_dir / META_FILE
    if global_rank() == 0:
        retreat_latest(save_dir, tag)
        if marker.exists():
            marker.unlink()  # re-saving an iteration: incomplete until this save finishes
        remove_sidecars(tag_dir)  # records of an earlier, failed save of this tag
    wait_for_all_ranks()  # no rank overwrites files of the tag before 'latest' left it
    return tag_dir


def commit(save: SaveCommit) -> None:
    """Every rank's files are on disk: rank 0 writes the marker (with the merged checksums) and moves both
    pointers; a barrier, so nobody reads the pointers (e.g. a relaunch's preflight) before they moved."""
    if global_rank() == 0:
        tag_dir = save.tag_dir
        checksums = {CHECKSUMS_KEY: merge_sidecars(tag_dir)} if save.hashed else {}
        meta = {**save.meta, **checksums}
        atomic_write(tag_dir / META_FILE, json.dumps(meta, indent=1, sort_keys=True) + "\n")
        remove_sidecars(tag_dir)
        atomic_write(tag_dir.parent / LATEST_FILE, tag_dir.name)
        atomic_write(tag_dir.parent / ITERATION_FILE, f"{save.iteration}\n")
    wait_for_all_ranks()


def save_failed_message(save_dir: Path, iteration: int, err: BaseException) -> str:
    """One line: which file of which save failed, why, and where 'latest' points (it was never moved)."""
    latest = save_dir / LATEST_FILE
    good = latest.read_text(encoding="utf-8").strip() if latest.is_file() else None
    where = (
        f"'latest' still points to {good}, the last good checkpoint"
        if good
        else f"{save_dir} has no complete checkpoint ('latest' was never written)"
    )
    what = getattr(err, "filename", None)
    reason = getattr(err, "strerror", None) or str(err).splitlines()[0]
    return (
        f"saving checkpoint {tag_for_iteration(iteration)} to --save {save_dir} failed"
        f"{f' writing {what}' if what else ''}: {reason}; {where}. Free space (or fix the directory) and "
        "relaunch to resume from it."
    )


def is_write_error(err: BaseException) -> bool:
    """A failed file write: an ``OSError``, or the ``RuntimeError`` torch.save wraps one in."""
    return isinstance(err, OSError) or (
        isinstance(err, RuntimeError) and "write" in str(err).lower()
    )


def background_failure(
    save: SaveCommit, err: BaseException | None, failed_rank: int
) -> BaseException:
    """What every rank raises when a background write (--async-save) failed: on the failing rank its own error
    (a write error as one line), on the others one line naming that rank."""
    save_dir = save.tag_dir.parent
    if err is None:
        other = OSError(
            f"the background write on rank {failed_rank} failed (its log names the file)"
        )
        return CheckpointSaveError(save_failed_message(save_dir, save.iteration, other))
    if is_write_error(err):
        return CheckpointSaveError(save_failed_message(save_dir, save.iteration, err))
    return err


def any_rank_max(values: list[float]) -> list[float]:
    """Element-wise max of ``values`` over every rank (one all-reduce through ``mpu.mappings``)."""
    local = torch.tensor(values, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        world = dist.group.WORLD
        local = all_reduce_max_(local.to(communication_device(world)), group=world).cpu()
    return [float(v) for v in local.tolist()]


def wait_for_all_ranks() -> None:
    """A barrier over every rank (an all-reduce of one element through ``mpu.mappings``)."""
    any_rank_max([0.0])
