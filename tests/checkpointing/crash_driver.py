"""``pretrain_gpt.py`` that SIGKILLs itself at a named point of one save: the crash-safety tests' fault injection.

    TRIDENT_TEST_CRASH_AT=<point>:<iteration> python tests/checkpointing/crash_driver.py <pretrain_gpt.py flags>

Points, in the order of the save protocol (``megatron/checkpointing/engine.py``): ``before_engine_save`` (this
rank's RNG file written), ``after_engine_save`` (all DeepSpeed files written), ``after_meta`` (the completion marker
written, pointers not moved), ``after_latest`` (``latest`` moved, the iteration file not yet). The library knows
nothing of this: the driver wraps the functions the save calls, then runs ``pretrain_gpt.py`` as ``__main__``.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

CRASH_ENV = "TRIDENT_TEST_CRASH_AT"
ROOT = Path(__file__).resolve().parents[2]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str, iteration: int) -> None:
    """Wrap the save step named ``point`` so that the save of ``iteration`` dies right after it."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from megatron.checkpointing import commit, engine
    from megatron.checkpointing.meta import META_FILE
    from megatron.checkpointing.pointers import LATEST_FILE, tag_for_iteration

    tag = tag_for_iteration(iteration)
    if point == "before_engine_save":
        write_rng = engine.write_rng_file

        def write_rng_then_die(path: Path, data: bytes, write: Any = None) -> None:
            write_rng(path, data, write)
            if path.parent.name == tag:
                _die()

        engine.write_rng_file = write_rng_then_die
    elif point == "after_engine_save":
        save = DeepSpeedEngine.save_checkpoint

        def save_then_die(self: Any, save_dir: str, *args: Any, **kwargs: Any) -> Any:
            out = save(self, save_dir, *args, **kwargs)
            if kwargs.get("tag") == tag:
                _die()
            return out

        DeepSpeedEngine.save_checkpoint = save_then_die
    elif point in ("after_meta", "after_latest"):
        write = commit.atomic_write

        def write_then_die(path: Path, text: str) -> None:
            write(path, text)
            meta = point == "after_meta" and path.name == META_FILE and path.parent.name == tag
            if meta or (point == "after_latest" and path.name == LATEST_FILE and text == tag):
                _die()

        commit.atomic_write = write_then_die
    else:
        raise ValueError(f"{CRASH_ENV}: unknown crash point {point!r}")


if __name__ == "__main__":
    where, _, at = os.environ[CRASH_ENV].partition(":")
    install(where, int(at))
    sys.argv = [str(ROOT / "pretrain_gpt.py"), *sys.argv[1:]]
    runpy.run_path(str(ROOT / "pretrain_gpt.py"), run_name="__main__")
