"""Resume at a new layout in one step: ``--load`` of a regular checkpoint saved at another TP / PP / DP size or ZeRO
stage converts it on the way in (``megatron/checkpointing/relayout.py``): the next losses match the run continuing
at its old layout and the offline universal-checkpoint path (``tools/checkpoint/to_universal`` +
``--universal-checkpoint``); the conversion is logged; the source checkpoint is unchanged and the temporary copy
gone.

Default suite: one process, ZeRO-1 -> ZeRO-3 (a relayout at world size 1). Slow: the acceptance matrix of issue #34,
TP2 x PP2 (ZeRO-1) -> TP1 x PP2 x DP2 on 4 ranks, and ZeRO-1 -> ZeRO-3 at DP 2. Dropout is 0: a conversion starts
fresh RNG states where the layout changes (as the universal path does), and the runs compare fp32 losses that
differ only in reduction order.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
from test_ckpt_resume import TINY

from megatron.testing import run_distributed

SAVED_AT = 2
ITERS = 4
TOL = 1e-5

FLAGS = [
    *TINY, "--train-iters", str(ITERS), "--attention-dropout", "0", "--hidden-dropout", "0",
    "--eval-interval", "100",
]  # fmt: skip
TAG = f"global_step{SAVED_AT}"


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _reference(ck: str, layout: list[str]) -> list[float]:
    """The run at its old layout, saving at SAVED_AT and going on to ITERS: the losses a resume must repeat."""
    from megatron.config import parse_args
    from megatron.training import pretrain

    argv = [*FLAGS, *layout, "--save", ck, "--save-interval", str(SAVED_AT)]
    return pretrain(parse_args(argv)).losses[SAVED_AT:]


def _converted(ck: str, layout: list[str], universal_tag: str | None) -> dict[str, object]:
    """The next losses at ``layout``: converted on load (no flag), and (``universal_tag``) through the offline
    universal checkpoint."""
    from megatron.config import parse_args
    from megatron.training import pretrain

    lines = _Lines()
    logger = logging.getLogger("megatron.checkpointing.engine")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    before = _tree_digest(Path(ck) / TAG)
    converted = pretrain(parse_args([*FLAGS, *layout, "--load", ck, "--load-tag", TAG]))
    out: dict[str, object] = {
        "converted": (converted.iteration, converted.losses),
        "source_unchanged": before == _tree_digest(Path(ck) / TAG),
        "leftovers": sorted(p.name for p in Path(ck).glob(".relayout-*")),
        "log": [line for line in lines.lines if "convert" in line],
    }
    if universal_tag is not None:
        uni = [*FLAGS, *layout, "--load", ck, "--universal-checkpoint", "--load-tag", universal_tag]
        universal = pretrain(parse_args(uni))
        out["universal"] = (universal.iteration, universal.losses)
    return out


def _worst(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == ITERS - SAVED_AT, (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def _check(
    result: dict[str, object], reference: list[float], saved: str, run: str
) -> dict[str, float]:
    it, losses = result["converted"]  # type: ignore[misc]
    assert it == ITERS, result
    worst = {"reference": _worst(losses, reference)}
    if "universal" in result:
        it_u, uni = result["universal"]  # type: ignore[misc]
        assert it_u == ITERS
        worst["universal"] = _worst(losses, uni)
    assert max(worst.values()) <= TOL, (worst, result, reference)
    assert result["source_unchanged"] and result["leftovers"] == [], result
    log = result["log"]
    assert any(f"from {saved} to {run}" in line and "source unchanged" in line for line in log), log  # type: ignore[attr-defined]
    return worst


def _one_rank(ck: str) -> tuple[list[float], dict[str, object]]:
    ref = _reference(ck, ["--zero-stage", "1"])
    return ref, _converted(ck, ["--zero-stage", "3"], None)


@pytest.mark.slow
def test_load_converts_zero1_to_zero3_on_one_rank(tmp_path: Path) -> None:
    ref, result = run_distributed(_one_rank, 1, str(tmp_path / "ck"), init_process_group=False)[0]
    worst = _check(result, ref, "TP1 PP1 DP1 ZeRO-1", "TP1 PP1 DP1 ZeRO-3")
    print(f"ZeRO-1 -> ZeRO-3 (1 rank): worst |loss difference| {worst}")


def _offline_universal(ck: str) -> str:
    from tools.checkpoint import to_universal

    assert to_universal.main(["--load", ck, "--tag", TAG]) == 0
    return f"{TAG}_universal"


def _matrix_case(
    tmp_path: Path, world: int, saved: list[str], run: list[str], words: tuple[str, str]
) -> dict[str, float]:
    ck = str(tmp_path / "ck")
    ref = run_distributed(_reference, world, ck, saved, init_process_group=False, timeout=600)[0]
    tag = _offline_universal(ck)
    result = run_distributed(_converted, world, ck, run, tag, init_process_group=False, timeout=900)
    return _check(result[0], ref, *words)


@pytest.mark.slow
def test_load_converts_tp2pp2_to_tp1pp2dp2(tmp_path: Path) -> None:
    saved = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    run = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]
    words = ("TP2 PP2 DP1 ZeRO-1", "TP1 PP2 DP2 ZeRO-1")
    worst = _matrix_case(
        tmp_path, 4, [*saved, "--zero-stage", "1"], [*run, "--zero-stage", "1"], words
    )
    print(f"TP2 x PP2 -> TP1 x PP2 x DP2: worst |loss difference| {worst}")


@pytest.mark.slow
def test_load_converts_zero1_to_zero3_at_dp2(tmp_path: Path) -> None:
    words = ("TP1 PP1 DP2 ZeRO-1", "TP1 PP1 DP2 ZeRO-3")
    worst = _matrix_case(tmp_path, 2, ["--zero-stage", "1"], ["--zero-stage", "3"], words)
    print(f"ZeRO-1 -> ZeRO-3 (DP 2): worst |loss difference| {worst}")
