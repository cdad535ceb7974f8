"""Numeric flags out of range are refused by validate() with the flag, the value and the range (issue 35, items 5,
16 and 17): before, ``--kv-channels 0`` trained like the default, ``--adam-beta1 1.5`` / ``--ffn-hidden-size 0`` /
``--init-method-std -1`` crashed later with tracebacks, and ``--train-iters 2**63-1`` overflowed in the data
pipeline."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from megatron.config import TridentConfig, parse_args, validate
from megatron.config.arguments import SECTIONS, _unwrap_optional
from megatron.config.flags import NOT_FLAGS
from megatron.config.moe import MoEConfig
from megatron.config.ranges import (
    ABOVE_ONE,
    BOUNDS,
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_INT,
    SEED,
    UNIT_OPEN,
)

BASE = (
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--train-iters", "10", "--eval-iters", "0",
)  # fmt: skip

BAD = {
    POSITIVE_INT: "0",
    NON_NEGATIVE: "-1",
    POSITIVE: "0",
    UNIT_OPEN: "1",
    SEED: "-1",
    ABOVE_ONE: "1",
}
"""An out-of-range value of each rule (the edge just outside it)."""


def _validated(*extra: str) -> TridentConfig:
    cfg = parse_args([*BASE, *extra])
    validate(cfg, world_size=1)
    return cfg


@pytest.mark.parametrize("bound", BOUNDS, ids=[b.flag for b in BOUNDS])
def test_every_bound_refuses_the_edge_outside_its_range(bound) -> None:
    value = BAD[bound.rule]
    with pytest.raises(ValueError, match=re.escape(f"{bound.flag} (") + r"\S+\) must be "):
        _validated(f"{bound.flag}={value}")


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        (
            "--kv-channels",
            "0",
            r"--kv-channels \(0\) must be a positive integer; leave the flag out",
        ),
        ("--adam-beta1", "1.5", r"--adam-beta1 \(1.5\) must be in \[0, 1\); e.g. 0.9"),
        ("--adam-beta2", "1", r"--adam-beta2 \(1.0\) must be in \[0, 1\)"),
        ("--ffn-hidden-size", "0", r"--ffn-hidden-size \(0\) must be a positive integer"),
        ("--init-method-std", "-1", r"--init-method-std \(-1.0\) must be > 0; e.g. 0.02"),
        ("--adam-eps", "0", r"--adam-eps \(0.0\) must be > 0"),
        ("--weight-decay", "-0.1", r"--weight-decay \(-0.1\) must be >= 0"),
        ("--num-key-value-heads", "0", r"--num-key-value-heads \(0\) must be a positive integer"),
        ("--max-position-embeddings", "0", r"--max-position-embeddings \(0\) must be a positive"),
        ("--lr-decay-iters", "0", r"--lr-decay-iters \(0\) must be a positive integer"),
        ("--loss-scale", "0", r"--loss-scale \(0.0\) must be > 0; leave it out for dynamic"),
        ("--save-interval", "0", r"--save-interval \(0\) must be a positive integer"),
        ("--seed", str(2**32), r"--seed \(4294967296\) must be in \[0, 2\*\*32 - 1\]"),
    ],
)
def test_the_reported_values_are_refused_with_the_range(flag, value, message) -> None:
    with pytest.raises(ValueError, match=message):
        _validated(f"{flag}={value}")


def test_values_inside_the_ranges_still_pass() -> None:
    cfg = _validated(
        "--kv-channels", "8", "--ffn-hidden-size", "1", "--adam-beta1", "0", "--adam-beta2", "0.95",
        "--init-method-std", "1e-6", "--weight-decay", "0", "--lr-warmup-iters", "0", "--seed", "0",
        "--sgd-momentum", "0", "--moe-loss-coeff", "0", "--save-interval", "1", "--seed", str(2**32 - 1),
    )  # fmt: skip
    assert cfg.model.head_dim == 8 and cfg.training.seed == 2**32 - 1


def test_run_length_beyond_a_64_bit_count_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"--train-iters \(9223372036854775807\) x --global-batch"):
        validate(parse_args([*BASE, "--train-iters", str(2**63 - 1)]), world_size=1)
    with pytest.raises(ValueError, match=r"--train-samples \(9223372036854775807\) x --seq-length"):
        validate(
            parse_args([*BASE[:-4], "--train-samples", str(2**63 - 1), "--eval-iters", "0"]),
            world_size=1,
        )
    with pytest.raises(
        ValueError, match=r"--eval-iters \(1000000000\) every --eval-interval \(1\)"
    ):
        _validated(
            "--train-iters", str(2**40), "--eval-interval", "1", "--eval-iters", "1000000000"
        )
    _validated("--train-iters", str(2**40))  # long, but countable


# Numeric fields whose range is checked elsewhere in validate() (or that have none, with the reason).
CHECKED_ELSEWHERE = {
    "num_layers", "hidden_size", "num_attention_heads", "seq_length", "make_vocab_size_divisible_by",
    "micro_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "log_interval",
    "eval_interval", "eval_iters", "attention_dropout", "hidden_dropout", "recompute_num_layers",
    "rotary_percent", "ds_sequence_parallel_size", "zero_stage", "distributed_timeout_minutes",
    "moe_expert_parallel_size", "global_batch_size", "train_iters", "train_samples", "train_tokens",
    "lr", "min_lr", "lr_decay_tokens", "lr_warmup_fraction", "lr_warmup_tokens", "clip_grad",
    "exit_interval", "hang_timeout_minutes", "hang_timeout_factor", "num_workers",
    "tensorboard_log_interval", "tensorboard_queue_size", "num_experts", "expert_interval",
    "moe_train_capacity_factor", "moe_eval_capacity_factor", "moe_min_capacity", "num_experts_switch",
    "local_rank",  # set by the launcher, not by the user
    "window_size",  # config/features.py
}  # fmt: skip


def test_every_numeric_flag_has_a_range() -> None:
    """A new int/float flag must get a row in BOUNDS (or a rule of its own, listed above)."""
    bounded = {b.field.rsplit(".", 1)[1] for b in BOUNDS}
    missing = []
    for cls in [c for _, _, c in SECTIONS] + [MoEConfig]:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            base = _unwrap_optional(hints[f.name])
            numeric = (
                base in (int, float)
                or typing.get_origin(base) is tuple
                and int in typing.get_args(base)
            )
            known = f.name in bounded | CHECKED_ELSEWHERE
            if numeric and (cls.__name__, f.name) not in NOT_FLAGS and not known:
                missing.append(f"{cls.__name__}.{f.name}")
    assert not missing, f"numeric flags with no range check: {missing}"
