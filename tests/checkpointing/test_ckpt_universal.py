"""Resume at another layout through a DeepSpeed universal checkpoint (weights + Adam state + schedule + position).

Reference: 12 iterations at (TP=2, PP=1, DP=1) with ZeRO-1, and the same run stopped and saved at iteration 2. That
checkpoint is
converted with ``tools/checkpoint/to_universal.py`` and training resumes from it at (TP=1, PP=1, DP=2) and at
(TP=1, PP=2, DP=1) (GPTModel names -> pipeline names); the next 10 losses must match the reference within 1e-4
relative (dropout 0: masks differ by layout; layouts differ only in reduction order).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_ckpt_resume import TINY

from megatron.testing import run_distributed
from tools.checkpoint import to_universal

ITERS = 12
SAVED_AT = 2
RTOL = 1e-4

FLAGS = [
    *TINY, "--train-iters", str(ITERS), "--attention-dropout", "0", "--hidden-dropout", "0",
    "--zero-stage", "1",
]  # fmt: skip


def _layout(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def _reference(ck: str) -> list[float]:
    from megatron.config import parse_args
    from megatron.training import pretrain

    r = pretrain(parse_args([*FLAGS, *_layout(2, 1)]))
    assert r.iteration == ITERS
    # The same run stopped (and saved) at SAVED_AT: exact resume makes it the reference's state there.
    argv = [*FLAGS, *_layout(2, 1), "--save", ck, "--exit-interval", str(SAVED_AT)]
    part = pretrain(parse_args(argv))
    assert part.iteration == SAVED_AT and part.losses == r.losses[:SAVED_AT]
    return r.losses


def _resume(ck: str, layouts: list[tuple[int, int]]) -> list[tuple[int, list[float]]]:
    from megatron.config import parse_args
    from megatron.training import pretrain

    out = []
    for tp, pp in layouts:
        argv = [*FLAGS, *_layout(tp, pp), "--load", ck, "--universal-checkpoint"]
        r = pretrain(parse_args(argv))
        out.append((r.iteration, r.losses))
    # Without --universal-checkpoint the universal tag is not picked; with it but no conversion: clear errors.
    try:
        pretrain(
            parse_args(
                [*FLAGS, *_layout(1, 1), "--load", ck, "--load-tag", "global_step2_universal"]
            )
        )
        err = None
    except ValueError as e:
        err = str(e)
    out.append((-1, [err]))  # type: ignore[list-item]
    # Resume at a new layout once more, saving; relaunching the same command (--universal-checkpoint still on)
    # then resumes the newer regular checkpoint it saved, as a requeued job must.
    argv = [*FLAGS, *_layout(1, 1), "--load", ck, "--universal-checkpoint", "--save", ck]
    pretrain(parse_args([*argv, "--train-iters", str(SAVED_AT + 1)]))
    again = pretrain(parse_args(argv))
    out.append((again.iteration, again.losses))
    return out


def test_universal_resume_other_layouts(tmp_path: Path, capsys) -> None:
    ck = str(tmp_path / "ckpt")
    ref = run_distributed(_reference, 2, ck, init_process_group=False, timeout=300)[0]
    assert to_universal.main(["--load", ck, "--tag", f"global_step{SAVED_AT}"]) == 0
    assert "global_step2_universal" in capsys.readouterr().out
    assert "(global_step2_universal)" in (tmp_path / "ckpt" / "model_args.sh").read_text()
    results = run_distributed(
        _resume, 2, ck, [(1, 1), (1, 2)], init_process_group=False, timeout=600
    )
    r = results[0]
    assert results[1] == r
    worst = 0.0
    for it, losses in r[:2]:
        assert it == ITERS and len(losses) == ITERS - SAVED_AT
        rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref[SAVED_AT:])]
        worst = max(worst, *rel)
    assert worst <= RTOL, (worst, r, ref)
    print(
        f"universal resume: worst relative loss difference {worst:.2e} over {ITERS - SAVED_AT} iterations"
    )
    assert "this is a universal checkpoint; add --universal-checkpoint" in r[2][1][0]
    it, losses = r[3]
    assert it == ITERS and len(losses) == ITERS - SAVED_AT - 1
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref[SAVED_AT + 1 :])]
    assert max(rel) <= RTOL, (rel, losses, ref)


@pytest.mark.parametrize("bad", ["no_latest_universal"])
def test_universal_flag_without_conversion(tmp_path: Path, bad: str) -> None:
    from megatron.checkpointing.pointers import find_checkpoint

    (tmp_path / "latest").write_text("global_step2")
    with pytest.raises(FileNotFoundError, match="python -m tools.checkpoint.to_universal"):
        find_checkpoint(str(tmp_path), universal=True)
