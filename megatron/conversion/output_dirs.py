"""Where the offline tools write: an output directory that can be created, and a --save that holds no run.

Both checks run before anything is read or spawned, so a refused conversion changes nothing on disk.
"""

from __future__ import annotations

import os
from pathlib import Path


def check_output_dir_path(path: str | Path, flag: str) -> None:
    """``path`` is a directory or can be created as one: its nearest existing ancestor is a writable directory.

    Raises:
        ValueError: naming ``flag``, the file in the way (or the read-only directory) and the fix.
    """
    p = Path(path)
    for candidate in (p, *p.parents):
        if candidate.exists() or candidate.is_symlink():
            if not candidate.is_dir():
                where = "is a file" if candidate == p else f"is inside {candidate}, which is a file"
                raise ValueError(
                    f"{flag} {path} {where}; give a directory path (a new one is created)."
                )
            if not os.access(candidate, os.W_OK | os.X_OK):
                raise ValueError(
                    f"{flag} {path}: {candidate} is not writable; choose a directory you can write to."
                )
            return


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_output_not_input(
    output: str | Path, out_flag: str, source: str | Path, in_flag: str
) -> None:
    """An output directory must not be its input, nor lie inside it: compared by real path (symlinks resolved,
    ``os.path.realpath``) and by identity (``os.path.samefile``: bind mounts, case-insensitive file systems).

    Raises:
        ValueError: naming both flags, the real path and the fix.
    """
    out, src = Path(os.path.realpath(output)), Path(os.path.realpath(source))
    # The output may not exist yet: its nearest existing ancestor decides whether it lands inside the input.
    existing = next((p for p in (out, *out.parents) if p.exists()), out)
    inside = out == src or src in out.parents or _same_file(out, src)
    inside = inside or any(_same_file(p, src) for p in (existing, *existing.parents))
    if inside:
        raise ValueError(
            f"{out_flag} {output} is {'' if out == src else 'inside '}the {in_flag} directory ({src}, real path): "
            f"the conversion would write into its own input; choose a {out_flag} directory outside {in_flag}."
        )


def check_new_save_dir(
    save: str | Path, *, load: str | Path | None = None, load_flag: str = "--load"
) -> None:
    """--save of the conversion tools: a new or empty directory (not the source ``load`` given with ``load_flag``,
    not a file, no checkpoints in it).

    The tools write a weights-only ``global_step0`` and point ``latest`` at it; in a directory holding a
    training run that would make the next relaunch silently restart from iteration 0.

    Raises:
        ValueError: naming --save, what it holds and the fix.
    """
    check_output_dir_path(save, "--save")
    out = Path(save)
    fix = "write the converted checkpoint to a new or empty directory"
    if load is not None:
        check_output_not_input(save, "--save", load, load_flag)
    if not out.is_dir():
        return
    found = sorted(p.name for p in out.glob("global_step*")) + sorted(
        p.name for p in out.glob("latest*") if p.is_file()
    )
    if found:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise ValueError(
            f"--save {save} already holds checkpoints ({shown}): the converted weights-only global_step0 "
            f"would become its 'latest' and a training relaunch there would restart from iteration 0; {fix}."
        )
