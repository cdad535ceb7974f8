"""Shared CLI pieces of the checkpoint tools: progress bar, verification report, exit codes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from megatron.conversion.rewrite import TargetLayout
from megatron.conversion.verify import LogitComparison, Verification

EXIT_OK = 0
EXIT_INPUT_ERROR = 2
EXIT_VERIFY_FAILED = 3
EXIT_INTERRUPTED = 130
DEFAULT_TOLERANCE = 1e-5


def add_verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-verify", action="store_true", help="skip the logit comparison")
    p.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="max |delta logit| allowed (fp32 default 1e-5); greedy decodes must also agree fully",
    )
    p.add_argument("--verify-steps", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_checksum_args(p: argparse.ArgumentParser) -> None:
    """``--no-verify-checkpoint-checksums``: training's flag, with the same meaning for a tool reading a checkpoint."""
    p.add_argument(
        "--no-verify-checkpoint-checksums",
        dest="verify_checkpoint_checksums",
        action="store_false",
        help="compare the checkpoint files' sizes with those recorded at save, but skip their SHA-256 (huge "
        "checkpoints on trusted storage)",
    )


def verification_from_args(a: argparse.Namespace) -> Verification | None:
    """The :class:`Verification` of the flags of :func:`add_verify_args` (None with ``--no-verify``)."""
    return None if a.no_verify else Verification(steps=a.verify_steps, tolerance=a.tolerance)


class Bar:
    """``progress(what, done, total)`` callback drawing a tqdm bar per stage on stderr."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bars: dict[str, Any] = {}

    def __call__(self, what: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        bar = self._bars.get(what)
        if bar is None:
            bar = self._bars[what] = tqdm(total=total, desc=what, file=sys.stderr, leave=True)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()


def report(result: LogitComparison | None, tolerance: float) -> int:
    """Print the verification numbers; the exit code (3 when over tolerance or decodes disagree)."""
    if result is None:
        print("verification skipped (--no-verify)")
        return EXIT_OK
    ok = result.max_abs_dlogit <= tolerance and result.greedy_agreement == 1.0
    print(
        f"verify: max |dlogit| = {result.max_abs_dlogit:.3e} (tolerance {tolerance:.1e}), "
        f"greedy agreement = {result.greedy_agreement:.3f} -> {'OK' if ok else 'FAILED'}"
    )
    return EXIT_OK if ok else EXIT_VERIFY_FAILED


def run_checkpoint_writer(
    convert: Callable[..., LogitComparison | None],
    a: argparse.Namespace,
    *args: Any,
    ep: int = 1,
    **kwargs: Any,
) -> int:
    """The body of a tool that writes a Trident checkpoint at ``--tp`` x ``--pp`` (x ``ep``) and verifies it: call
    ``convert(*args, layout=, verification=, progress=, say=, **kwargs)``, print one ``error:`` line for bad
    input (exit 2), else what was written and the verification report (exit 0, or 3 when it failed: then nothing
    was written to --save; ``convert`` said where the unverified checkpoint is)."""
    try:
        result = convert(
            *args,
            layout=TargetLayout(tp=a.tp, pp=a.pp, ep=ep),
            verification=verification_from_args(a),
            progress=Bar(not a.no_progress),
            say=print,
            **kwargs,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    except KeyboardInterrupt as e:
        print(
            f"interrupted ({e or 'SIGINT'}): nothing was written to {a.save} (the staging directory and the "
            "temporary full-model file beside it were removed); run the conversion again.",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    if result is None or result.passes(a.tolerance):
        shown_ep = f", EP={ep}" if ep != 1 else ""
        print(f"wrote Trident checkpoint {a.save} (TP={a.tp}, PP={a.pp}{shown_ep})")
    return report(result, a.tolerance)
