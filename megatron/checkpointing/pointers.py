"""Which checkpoint a run resumes from: the ``latest`` pointers, complete tags, and their crash-safe updates.

Layout of ``--save DIR`` (DeepSpeed's, plus Megatron's iteration file)::

    DIR/latest                              tag of the newest COMPLETE checkpoint (DeepSpeed reads it)
    DIR/latest_checkpointed_iteration.txt   its iteration (Megatron's file; may lag 'latest' by one save after a crash)
    DIR/latest_universal                    tag of the newest universal checkpoint (tools/checkpoint/to_universal)
    DIR/global_step{N}/                     one checkpoint; complete once its ``trident_meta.json`` exists

Pointers move only by temp file + ``os.replace`` after every rank's files and the meta are written, so a process
killed at any point leaves them at a complete checkpoint. Relaunching the same command (``--save D --load D``)
resumes from ``latest``: auto-resume.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path

from megatron.checkpointing.meta import META_FILE, read_meta
from megatron.config import CheckpointConfig, ParallelConfig
from megatron.log import global_rank

logger = logging.getLogger(__name__)

LATEST_FILE = "latest"
ITERATION_FILE = "latest_checkpointed_iteration.txt"
LATEST_UNIVERSAL_FILE = "latest_universal"


def tag_for_iteration(iteration: int) -> str:
    """DeepSpeed's tag name for ``iteration``."""
    return f"global_step{iteration}"


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file and ``os.replace`` (readers see the old or the new file)."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_tag(tag: str, source: str) -> str:
    """``tag`` if it is one path component (a directory name inside the checkpoint directory), else an error.

    Every tag that reaches a path goes through here: --load-tag, the tools' --tag, and the contents of ``latest`` /
    ``latest_universal``. A tag like ``../other/global_step4`` or ``/abs/path`` would make the run (and DeepSpeed's
    unpickler) read a checkpoint outside the directory the user named.

    Args:
        tag: the tag as given.
        source: where it came from, for the message (``--load-tag``, ``DIR/latest``, ...).

    Raises:
        ValueError: one line naming ``source``, the tag and the rule.
    """
    bad = (
        not tag
        or tag in (".", "..")
        or any(c in tag for c in ("/", "\\", "\0"))
        or Path(tag).is_absolute()
        or Path(tag).name != tag
    )
    if bad:
        raise ValueError(
            f"{source}: tag {tag!r} is not a plain directory name; a tag names one checkpoint directory inside "
            "the checkpoint directory (e.g. global_step1000), without '/', '..' or an absolute path."
        )
    return tag


def check_tag_inside(root: Path, tag: str, source: str) -> None:
    """``root/tag`` stays inside ``root`` once symlinks are resolved: a tag that is a symlink to a directory
    elsewhere would make the run (and DeepSpeed's unpickler) read a checkpoint outside the directory the user named.
    A symlink to another tag of ``root`` is fine.

    Raises:
        ValueError: one line naming ``source``, the tag, where it leads and the fix.
    """
    path = root / tag
    real, real_root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    if real_root not in real.parents:
        raise ValueError(
            f"{source}: tag {tag!r}: {path} is a symlink to {real}, outside the checkpoint directory {root}; a "
            "tag must be a checkpoint inside it. Point --load at the directory that holds that checkpoint, or "
            f"copy it into {root} in place of the link."
        )


def _read_pointer(pointer: Path) -> str:
    """The tag ``pointer`` (``latest``, ``latest_universal``) holds, checked by :func:`check_tag`."""
    return check_tag(pointer.read_text(encoding="utf-8").strip(), str(pointer))


def is_complete(load_dir: str | Path, tag: str) -> bool:
    """True when ``load_dir/tag`` was fully written (its ``trident_meta.json`` exists)."""
    return (Path(load_dir) / tag / META_FILE).is_file()


def find_checkpoint(
    load_dir: str, load_tag: str | None = None, *, universal: bool = False
) -> str | None:
    """The tag to resume from in ``load_dir``: ``load_tag`` if given, else the ``latest`` pointer; None = no checkpoint.

    Raises:
        FileNotFoundError: --load-tag names a tag that is missing or incomplete.
        ValueError: ``latest`` points to an incomplete or missing tag (the directory was tampered with).
    """
    root = Path(load_dir)
    if load_tag is not None:
        check_tag(load_tag, "--load-tag")
        check_tag_inside(root, load_tag, "--load-tag")
        if not is_complete(root, load_tag):
            raise FileNotFoundError(
                f"--load-tag {load_tag}: {root / load_tag} is not a complete checkpoint "
                f"(no {META_FILE}); pick a tag listed in {root} or drop --load-tag to use 'latest'."
            )
        return load_tag
    latest = root / (LATEST_UNIVERSAL_FILE if universal else LATEST_FILE)
    if not latest.is_file():
        if universal and (root / LATEST_FILE).is_file():
            raise FileNotFoundError(
                f"--universal-checkpoint: {root} has no {LATEST_UNIVERSAL_FILE}; convert it first with "
                f"python -m tools.checkpoint.to_universal --load {load_dir}"
            )
        return None
    tag = _read_pointer(latest)
    check_tag_inside(root, tag, str(latest))
    if not is_complete(root, tag):
        raise ValueError(
            f"--load {load_dir}: '{latest.name}' points to {tag!r}, which is not a complete checkpoint "
            f"(no {root / tag / META_FILE}); fix 'latest' or pass --load-tag with a complete tag."
        )
    if universal:
        _refuse_stale_universal(root, tag)
    return tag


def _refuse_stale_universal(root: Path, universal_tag: str) -> None:
    """--universal-checkpoint is for the first resume only: refuse it once training saved past the conversion."""
    regular = root / LATEST_FILE
    if not regular.is_file():
        return
    newest = _read_pointer(regular)
    if not is_complete(root, newest):
        return
    done = int(read_meta(root, newest).get("iteration", 0))
    converted = int(read_meta(root, universal_tag).get("iteration", 0))
    if done > converted:
        raise ValueError(
            f"--universal-checkpoint: {root} holds a newer regular checkpoint ({newest}, iteration {done}) than "
            f"'{LATEST_UNIVERSAL_FILE}' ({universal_tag}, iteration {converted}); drop --universal-checkpoint "
            "to resume from it (the flag is for the first resume after a layout change)."
        )


def find_tag(
    ckpt_dir: str | Path, tag: str | None = None, *, tag_flag: str = "--tag"
) -> str | None:
    """The tag a tool reads in ``ckpt_dir``: ``tag`` if complete, else the ``latest`` pointer (None: none there).

    :func:`find_checkpoint` words its errors for training (--load-tag); the tools name their own flag
    (``tag_flag``) and list the complete tags to pick from.

    Raises:
        FileNotFoundError: ``tag`` is missing or incomplete.
        ValueError: ``latest`` points to an incomplete or missing tag.
    """
    root = Path(ckpt_dir)
    if tag is None:
        try:
            return find_checkpoint(str(root), None)
        except ValueError as err:
            raise ValueError(str(err).replace("--load-tag", tag_flag)) from None
    check_tag(tag, tag_flag)
    check_tag_inside(root, tag, tag_flag)
    if is_complete(root, tag):
        return tag
    complete = (
        [p.name for p in root.glob("*") if (p / META_FILE).is_file()] if root.is_dir() else []
    )
    complete.sort(key=lambda t: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", t)])
    shown = ("..., " if len(complete) > 8 else "") + ", ".join(complete[-8:])
    listing = f"complete tags there: {shown}" if complete else f"{root} holds no complete tag"
    raise FileNotFoundError(
        f"{tag_flag} {tag}: {root / tag} is not a complete checkpoint (no {META_FILE}); {listing}. "
        f"Pick one of them or drop {tag_flag} to use 'latest'."
    )


def complete_tags(root: Path) -> list[tuple[int, str]]:
    """``(iteration, tag)`` of every complete ``global_step{N}`` checkpoint in ``root``, ascending."""
    out = []
    for path in root.glob("global_step*"):
        m = re.fullmatch(r"global_step(\d+)", path.name)
        if m is not None and (path / META_FILE).is_file():
            out.append((int(m.group(1)), path.name))
    return sorted(out)


def retreat_latest(save_dir: Path, tag: str) -> None:
    """Before ``tag`` is overwritten in place, move 'latest' off it (to the newest other complete checkpoint, or
    remove it when there is none), so a crash during the re-save never leaves 'latest' on a half-written tag."""
    latest = save_dir / LATEST_FILE
    if not latest.is_file() or latest.read_text(encoding="utf-8").strip() != tag:
        return
    # Only an older tag: a newer complete one belongs to the branch the run left with --load-tag.
    m = re.fullmatch(r"global_step(\d+)", tag)
    resaved = int(m.group(1)) if m else None
    older = [
        (it, t)
        for it, t in complete_tags(save_dir)
        if t != tag and (resaved is None or it < resaved)
    ]
    if older:
        iteration, previous = older[-1]
        atomic_write(latest, previous)
        atomic_write(save_dir / ITERATION_FILE, f"{iteration}\n")
        logger.info("re-saving %s: 'latest' points to %s until the save completes", tag, previous)
    else:
        latest.unlink()
        (save_dir / ITERATION_FILE).unlink(missing_ok=True)
        logger.warning(
            "re-saving %s in place with no older complete checkpoint in %s: until this save completes, "
            "the directory has no 'latest' (a crash now would make the next launch start from scratch)",
            tag,
            save_dir,
        )


def resolve_universal_flag(
    ck: CheckpointConfig, parallel: ParallelConfig, world_size: int | None = None
) -> CheckpointConfig:
    """``ck`` with --universal-checkpoint dropped when --load holds a regular checkpoint newer than the universal
    conversion, saved at this run's layout (``parallel``'s TP and PP sizes, ``world_size``; the flag is for the
    first resume after a layout change; relaunching the same command afterwards must resume the newer regular
    checkpoint, with one log line). A newer regular checkpoint of ANOTHER layout keeps the flag (and its
    explanation of the conflict)."""
    if not (ck.universal_checkpoint and ck.load and ck.load_tag is None):
        return ck
    root = Path(ck.load)
    universal, regular = root / LATEST_UNIVERSAL_FILE, root / LATEST_FILE
    if not (universal.is_file() and regular.is_file()):
        return ck
    u_tag = _read_pointer(universal)
    r_tag = _read_pointer(regular)
    if not (is_complete(root, u_tag) and is_complete(root, r_tag)):
        return ck
    meta = read_meta(root, r_tag)
    done = int(meta.get("iteration", 0))
    if done <= int(read_meta(root, u_tag).get("iteration", 0)):
        return ck
    layout = (
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        world_size,
    )
    saved = (
        meta.get("tensor_model_parallel_size"),
        meta.get("pipeline_model_parallel_size"),
        meta.get("world_size") if world_size is not None else None,
    )
    if saved != layout:
        return ck
    if global_rank() == 0:
        logger.info(
            "--universal-checkpoint: %s holds a newer regular checkpoint (%s, iteration %d) than the universal "
            "one (%s); resuming the regular one",
            root,
            r_tag,
            done,
            u_tag,
        )
    return dataclasses.replace(ck, universal_checkpoint=False)
