"""``--rampup-batch-size START INCR SAMPLES`` (Megatron's global-batch ramp-up): the schedule, its flag checks, and
one 2-rank spawn of real ``pretrain`` runs: the batch grows at the right iterations, consumed samples and the
sample-counted LR follow it, a stop in the middle of the ramp resumes onto the straight run's losses and LRs, and
DP=2, TP=2 and PP=2 train on the same loss curve."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron.config import parse_args, validate
from megatron.config.batch_rampup import BatchRampup
from megatron.config.plan import train_samples_and_iters
from megatron.testing import run_distributed

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "1", "--global-batch-size", "6", "--train-samples", "32",
    "--rampup-batch-size", "2", "2", "8",
    "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "linear",
    "--lr-warmup-samples", "4", "--lr-decay-samples", "32",
    "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234",
    "--mock-data", "--vocab-size", "299", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--eval-iters", "0", "--log-interval", "1", "--log-level", "WARNING",
]  # fmt: skip
"""Ramp 2 -> 6 in steps of 2, one step per 4 samples: batches 2, 2, 4, 6, 6, 6, 6 (7 iterations, 32 samples)."""
BATCHES = [2, 2, 4, 6, 6, 6, 6]


def test_schedule_is_megatrons() -> None:
    ramp = BatchRampup.parse(("16", "8", "300"), 64)  # 6 increments, one per 50 samples
    assert [ramp.global_batch_at(c) for c in (0, 49, 50, 100, 299, 300, 301)] == [
        16, 16, 24, 32, 56, 64, 64
    ]  # fmt: skip
    # Megatron's update_train_iters, by hand: 16x4 (64), 24x2 (112), 32x2 (176), 40 (216), 48 (264),
    # 56 (320 > 300: the ramp is over), then (1000 - 320) // 64 = 10 whole batches.
    assert ramp.train_iters(1000) == 11 + 10
    t = parse_args(TINY).training
    assert train_samples_and_iters(t, 6) == (32, len(BATCHES))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rampup-batch-size", "2", "2"], "give three integers START INCR SAMPLES"),
        (["--rampup-batch-size"], "give three integers START INCR SAMPLES"),  # given, no values
        (["--rampup-batch-size", "2", "3", "8"], "minus START (2) = 4 must be a non-negative multiple of INCR (3)"),
        (["--rampup-batch-size", "1", "1", "8"], "START (1) and INCR (1) must be multiples of --micro-batch-size (1) x data-parallel size (2) = 2"),
        (["--train-iters", "5"], "needs a sample-based run: give --train-samples"),
        (["--dataloader-type", "cyclic"], "works with --dataloader-type single"),
    ],
)  # fmt: skip
def test_bad_rampup_flags(flags: list[str], message: str) -> None:
    argv = [*TINY, *flags]
    if "--train-iters" in flags:  # an iteration-based run instead of --train-samples
        for flag in ("--train-samples", "--lr-warmup-samples", "--lr-decay-samples"):
            i = argv.index(flag)
            del argv[i : i + 2]
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(parse_args(argv), world_size=2)


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if '"lm_loss"' in x]


def _scenario(tmp: str) -> dict:
    from megatron.training import pretrain

    tmp_path = Path(tmp)
    out = {}
    for name, layout in (
        ("dp2", []),
        ("tp2", ["--tensor-model-parallel-size", "2"]),
        ("pp2", ["--pipeline-model-parallel-size", "2"]),
    ):
        r = pretrain(
            parse_args([*TINY, *layout, "--metrics-file", str(tmp_path / f"{name}.jsonl")])
        )
        out[name] = (r.exit_code, r.iteration, r.consumed_train_samples)
    ck = str(tmp_path / "ckpt")
    resumable = [*TINY, "--save", ck, "--load", ck, "--save-interval", "100"]
    resumable += ["--metrics-file", str(tmp_path / "resumed.jsonl")]
    first = pretrain(
        parse_args([*resumable, "--exit-interval", "2"])
    )  # stops at 4 samples: mid-ramp
    second = pretrain(parse_args(resumable))
    out["first"] = (first.exit_code, first.iteration, first.consumed_train_samples)
    out["second"] = (second.exit_code, second.iteration, second.consumed_train_samples)
    return out


def test_rampup_run_grows_resumes_and_is_layout_independent(tmp_path: Path) -> None:
    results = run_distributed(_scenario, 2, str(tmp_path), timeout=400)
    r = results[0]
    for name in ("dp2", "tp2", "pp2"):
        assert r[name] == (0, len(BATCHES), sum(BATCHES)), name
    assert r["first"] == (3, 2, 4) and r["second"] == (0, len(BATCHES), sum(BATCHES))
    rows = _rows(tmp_path / "dp2.jsonl")
    consumed = [row["consumed_samples"] for row in rows]
    assert [b - a for a, b in zip([0, *consumed], consumed)] == BATCHES
    # The LR counts samples: warmup over 4 samples, then linear decay to --min-lr at 32, read before each step.
    before = [0, *consumed[:-1]]
    hand = [
        2e-3 * c / 4 if c < 4 else 2e-4 + (2e-3 - 2e-4) * (1 - (c - 4) / (32 - 4)) for c in before
    ]
    assert [row["lr"] for row in rows] == pytest.approx(hand)
    losses = [row["lm_loss"] for row in rows]
    resumed = _rows(tmp_path / "resumed.jsonl")
    assert [x["lm_loss"] for x in resumed] == losses  # bit-exact across the mid-ramp stop
    assert [x["lr"] for x in resumed] == [row["lr"] for row in rows]
    # Same samples in the same steps on every layout: the same curve (to reduction-order rounding).
    for name in ("tp2", "pp2"):
        other = [x["lm_loss"] for x in _rows(tmp_path / f"{name}.jsonl")]
        assert other == pytest.approx(losses, rel=2e-5, abs=1e-6), name
