"""--no-load-lr-state and --reset-iteration (Megatron-DeepSpeed's flags): what a resume keeps and what it restarts.

One single-process scenario: a run saves at iteration 2, then three relaunches from that checkpoint train up to
--train-iters 3 and report the first iteration they log (iteration, consumed samples, LR) and where they end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.testing import run_distributed
from tests.checkpointing.test_ckpt_resume import TINY

GBS, SEQ = 4, 16  # TINY's --global-batch-size and --seq-length


def _scenario(tmp: str) -> dict:
    from megatron.config import parse_args
    from megatron.training import pretrain

    tmp_path = Path(tmp)
    ck = str(tmp_path / "ckpt")
    pretrain(parse_args([*TINY, "--train-iters", "2", "--save", ck, "--save-interval", "100"]))
    out = {}
    for name, extra in (
        ("plain", ()),
        ("no_lr", ("--no-load-lr-state",)),
        ("reset", ("--reset-iteration",)),
        ("no_lr_new_lr", ("--no-load-lr-state", "--lr", "1e-3")),
    ):
        metrics = tmp_path / f"{name}.jsonl"
        res = pretrain(
            parse_args(
                [*TINY, "--load", ck, "--train-iters", "3", "--metrics-file", str(metrics), *extra]
            )
        )
        rec = [json.loads(x) for x in metrics.read_text().splitlines() if '"lm_loss"' in x]
        out[name] = (res.iteration, res.consumed_train_samples, res.consumed_train_tokens, rec[0])
    return out


def _lr(samples: int) -> float:
    """TINY's cosine schedule at ``samples`` (warmup 2 iterations; run length given by --train-iters)."""
    return 2e-3 * samples / (2 * GBS)


def test_no_load_lr_state_and_reset_iteration(tmp_path: Path) -> None:
    r = run_distributed(_scenario, 1, str(tmp_path), init_process_group=False, timeout=300)[0]
    # Plain resume: iteration 3 trains at the end of warmup (the LR of 8 consumed samples).
    assert r["plain"][:3] == (3, 3 * GBS, 3 * GBS * SEQ)
    assert r["plain"][3]["iteration"] == 3 and r["plain"][3]["lr"] == _lr(2 * GBS)
    # --no-load-lr-state: progress kept, the schedule restarts from sample 0 (warmup again).
    assert r["no_lr"][:3] == (3, 3 * GBS, 3 * GBS * SEQ)
    assert r["no_lr"][3]["lr"] == 0.0
    # The schedule is not loaded: a different --lr is no mismatch to refuse.
    assert r["no_lr_new_lr"][0] == 3
    # --reset-iteration: iteration and consumed samples/tokens from 0 (data from its start), LR state kept.
    assert r["reset"][:3] == (3, 3 * GBS, 3 * GBS * SEQ)  # trained 3 iterations again
    assert r["reset"][3]["iteration"] == 1 and r["reset"][3]["consumed_samples"] == GBS
    assert r["reset"][3]["lr"] == _lr(2 * GBS)
    # --reset-iteration into the --save it loads: every relaunch would restart over its checkpoints. Refused.
    from megatron.checkpointing.rules import check_checkpoint_dirs
    from megatron.config import parse_args

    ck = str(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="--reset-iteration with --load = --save"):
        check_checkpoint_dirs(parse_args([*TINY, "--load", ck, "--save", ck, "--reset-iteration"]))


def test_flags_need_load() -> None:
    """Without --load there is nothing to reset or to skip: refused, not ignored."""
    from megatron.checkpointing.rules import check_checkpoint_dirs
    from megatron.config import parse_args

    for flag in ("--no-load-lr-state", "--reset-iteration"):
        with pytest.raises(ValueError, match=f"{flag} was given without --load"):
            check_checkpoint_dirs(parse_args([*TINY, flag]))
