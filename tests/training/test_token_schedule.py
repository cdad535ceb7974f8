"""Megatron-DeepSpeed's token-based schedule: --train-tokens, --lr-warmup-tokens, --lr-decay-tokens.

LR values against hand-computed ones, the flag checks of ``validate()``, the resume comparison of the token
constants, and one real single-rank ``pretrain`` run: --train-tokens stops at the right iteration and a stop/resume
reproduces the straight run's losses and LRs.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from megatron.config import parse_args, validate
from megatron.launch.exit_codes import ConfigError
from megatron.testing import run_distributed
from megatron.training.lr_scheduler import build_lr_scheduler

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "100",
    "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "linear",
    "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234",
    "--mock-data", "--vocab-size", "299", "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
    "--eval-iters", "0", "--log-interval", "1", "--log-level", "WARNING",
]  # fmt: skip
"""64 tokens per iteration (global batch 4 x seq 16)."""


def _training(*flags: str):
    return parse_args(["--train-iters", "100", "--lr", "1.0", "--min-lr", "0.1", *flags]).training


def test_token_warmup_and_decay_lr_values() -> None:
    for style in ("linear", "cosine"):
        t = _training(
            "--lr-warmup-tokens", "100", "--lr-decay-tokens", "1000", "--lr-decay-style", style
        )
        s = build_lr_scheduler(t, global_batch=8, optimizer=None)
        assert s.get_lr() == 0.0
        s.step(8, tokens=50)
        assert s.get_lr() == pytest.approx(0.5)  # warmup: 1.0 x 50 / 100
        s.step(8, tokens=100)
        assert s.get_lr() == pytest.approx(1.0)
        s.step(8, tokens=325)  # decay ratio (325 - 100) / (1000 - 100) = 0.25
        coeff = 0.75 if style == "linear" else 0.5 * (math.cos(math.pi * 0.25) + 1.0)
        assert s.get_lr() == pytest.approx(0.1 + 0.9 * coeff)
        s.step(8, tokens=1000)
        assert s.get_lr() == pytest.approx(0.1)
        s.step(8, tokens=1001)
        assert s.get_lr() == 0.1  # past --lr-decay-tokens: --min-lr
        # The decay counts tokens, not samples: 40 samples are far inside the 800-sample iteration decay.
        assert s.num_steps == 40
    # Iteration warmup + token decay (two of Megatron-DeepSpeed's scripts): the decay starts at the tokens
    # consumed when the warmup ends (2 iterations x 8 samples, here 200 tokens).
    t = _training("--lr-warmup-iters", "2", "--lr-decay-tokens", "1200")
    s = build_lr_scheduler(t, global_batch=8, optimizer=None)
    s.step(8, tokens=100)
    assert s.get_lr() == pytest.approx(0.5)
    s.step(8, tokens=200)
    assert s.get_lr() == pytest.approx(1.0)
    s.step(8, tokens=700)  # ratio (700 - 200) / (1200 - 200) = 0.5
    assert s.get_lr() == pytest.approx(0.1 + 0.9 * 0.5)
    # ... and a checkpoint of it resumes on the same curve.
    s2 = build_lr_scheduler(t, global_batch=8, optimizer=None)
    s2.load_state_dict(s.state_dict())
    assert s2.get_lr() == s.get_lr() and s2.num_tokens == 700


def test_token_constants_compared_on_resume() -> None:
    t = _training("--lr-warmup-tokens", "100", "--lr-decay-tokens", "1000")
    s = build_lr_scheduler(t, global_batch=8, optimizer=None)
    s.step(8, tokens=550)
    state = s.state_dict()
    other = _training("--lr-warmup-tokens", "100", "--lr-decay-tokens", "2000")
    with pytest.raises(ConfigError, match="--lr-decay-tokens.*--override-opt_param-scheduler"):
        build_lr_scheduler(other, global_batch=8, optimizer=None).load_state_dict(state)
    longer = ("--lr-warmup-tokens", "100", "--lr-decay-tokens", "2000")
    flags = build_lr_scheduler(
        _training(*longer, "--override-opt_param-scheduler"), global_batch=8, optimizer=None
    )
    flags.load_state_dict(state)
    assert (flags.lr_decay_tokens, flags.num_tokens) == (2000, 550)
    ckpt = build_lr_scheduler(
        _training(*longer, "--use-checkpoint-opt_param-scheduler"), global_batch=8, optimizer=None
    )
    ckpt.load_state_dict(state)
    assert ckpt.lr_decay_tokens == 1000 and ckpt.get_lr() == pytest.approx(s.get_lr())
    # A checkpoint from before the token schedule (no token keys) still loads: the flags' values.
    old = {k: v for k, v in state.items() if "token" not in k}
    fresh = build_lr_scheduler(t, global_batch=8, optimizer=None)
    fresh.load_state_dict(old)
    assert fresh.lr_decay_tokens == 1000 and fresh.num_steps == 8


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--train-tokens", "0"], "--train-tokens (0) must be a positive integer"),
        (["--lr-decay-tokens", "-5"], "--lr-decay-tokens (-5) must be a positive integer"),
        (
            ["--lr-warmup-tokens", "-1", "--lr-decay-tokens", "10"],
            "--lr-warmup-tokens (-1) must be >= 0",
        ),
        (["--lr-warmup-tokens", "10"], "--lr-warmup-tokens (10) needs --lr-decay-tokens"),
        (
            ["--lr-warmup-tokens", "20", "--lr-decay-tokens", "10"],
            "--lr-warmup-tokens (20) exceeds",
        ),
        (
            ["--lr-warmup-tokens", "5", "--lr-warmup-iters", "2", "--lr-decay-tokens", "10"],
            "--lr-warmup-tokens is exclusive with --lr-warmup-iters",
        ),
    ],
)
def test_validate_token_flags(flags: list[str], message: str) -> None:
    cfg = parse_args([*TINY, *flags])
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(cfg, world_size=1)


def _lrs_losses(path: Path) -> tuple[list[float], list[float]]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if '"lm_loss"' in x]
    return [r["lr"] for r in rows], [r["lm_loss"] for r in rows]


def _train_tokens_scenario(tmp: str) -> dict:
    from megatron.training import pretrain

    tmp_path = Path(tmp)
    # 300 tokens at 64 per iteration: iteration 5 (320 tokens) is the first to reach them, before --train-iters 100.
    base = [*TINY, "--train-tokens", "300", "--lr-warmup-tokens", "128", "--lr-decay-tokens", "320"]
    straight = pretrain(parse_args([*base, "--metrics-file", str(tmp_path / "straight.jsonl")]))
    ck = str(tmp_path / "ckpt")
    metrics = str(tmp_path / "a.jsonl")
    resumable = [
        *base,
        "--save",
        ck,
        "--load",
        ck,
        "--save-interval",
        "100",
        "--metrics-file",
        metrics,
    ]
    first = pretrain(parse_args([*resumable, "--exit-interval", "2"]))
    second = pretrain(parse_args(resumable))
    return {
        "straight": (straight.exit_code, straight.iteration, straight.consumed_train_tokens),
        "first": (first.exit_code, first.iteration),
        "second": (second.exit_code, second.iteration, second.consumed_train_tokens),
        "latest": (Path(ck) / "latest").read_text().strip(),
    }


def test_train_tokens_stops_and_resumes_exactly(tmp_path: Path) -> None:
    r = run_distributed(_train_tokens_scenario, 1, str(tmp_path), timeout=240)[0]
    assert r["straight"] == (0, 5, 320)
    assert r["first"] == (3, 2)  # --exit-interval 2
    # Finished by --train-tokens: exit 0 and the final save, like reaching --train-iters.
    assert r["second"] == (0, 5, 320)
    assert r["latest"].endswith("5")
    lrs, losses = _lrs_losses(tmp_path / "straight.jsonl")
    # Linear warmup over 128 tokens, then linear decay to --min-lr over tokens 128..320 (64 tokens per iteration;
    # the LR of an iteration is the schedule at the tokens consumed before it).
    hand = [0.0, 2e-3 * 64 / 128, 2e-3]
    hand += [2e-4 + (2e-3 - 2e-4) * (1 - (tok - 128) / (320 - 128)) for tok in (192, 256)]
    assert lrs == pytest.approx(hand)
    resumed_lrs, resumed_losses = _lrs_losses(tmp_path / "a.jsonl")
    assert resumed_lrs == lrs and resumed_losses == losses
