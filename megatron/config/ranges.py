"""The valid range of every numeric flag that has one and no cross-check of its own: a table, checked in one loop.

Each row names the flag, the config field it sets and the rule; ``validate()`` runs :func:`check_ranges` before
any cross-check, so a value out of range is one line naming the flag, the value and the range, never a traceback
later (``--adam-beta1 1.5`` in the optimizer, ``--init-method-std -1`` in ``normal_``) nor a silent default: a
field whose code reads ``value or default`` (``--kv-channels 0``, ``--num-key-value-heads 0``,
``--max-position-embeddings 0``, ``--lr-decay-iters 0``, ``--loss-scale 0``) would treat 0 as "not given" and
record the 0 in the checkpoint's metadata. A flag left out (``None``) is never checked.

:func:`check_run_length` bounds the samples and tokens a run asks for by what a 64-bit index can count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron.config.arguments import TridentConfig

INT64_MAX = 2**63 - 1
"""The largest sample or token count a dataset index (int64) and ``len()`` can hold."""


@dataclass(frozen=True)
class Rule:
    """A range: the test and how a message states it."""

    ok: Callable[[Any], bool]
    words: str


POSITIVE_INT = Rule(lambda v: v >= 1, "a positive integer")
NON_NEGATIVE = Rule(lambda v: v >= 0, ">= 0")
POSITIVE = Rule(lambda v: v > 0, "> 0")
ABOVE_ONE = Rule(lambda v: v > 1, "> 1")
UNIT_OPEN = Rule(lambda v: 0 <= v < 1, "in [0, 1)")
SEED = Rule(lambda v: 0 <= v <= 2**32 - 1, "in [0, 2**32 - 1] (NumPy's seed range)")


@dataclass(frozen=True)
class Bound:
    """One numeric flag's range."""

    flag: str
    field: str
    """``section.field`` of ``TridentConfig`` (``model.kv_channels``; ``model.moe.…`` for MoE)."""
    rule: Rule
    fix: str = ""
    """What to do instead, when "give a value in range" is not the whole answer."""


_DEFAULT = "leave the flag out for the default"

BOUNDS: tuple[Bound, ...] = (
    Bound("--kv-channels", "model.kv_channels", POSITIVE_INT, f"{_DEFAULT} (hidden size / heads)"),
    Bound("--ffn-hidden-size", "model.ffn_hidden_size", POSITIVE_INT, f"{_DEFAULT} (4 x hidden)"),
    Bound("--num-key-value-heads", "model.num_key_value_heads", POSITIVE_INT, f"{_DEFAULT} (MHA)"),
    Bound(
        "--max-position-embeddings",
        "model.max_position_embeddings",
        POSITIVE_INT,
        f"{_DEFAULT} (--seq-length)",
    ),
    Bound("--layernorm-epsilon", "model.layernorm_epsilon", POSITIVE, "e.g. 1e-5"),
    Bound("--rotary-position-embeddings-theta", "model.rotary_position_embeddings_theta", POSITIVE),
    Bound("--rope-scaling-factor", "model.rope_scaling_factor", POSITIVE, "Llama 3.1 uses 8"),
    Bound(
        "--rope-scaling-low-freq-factor",
        "model.rope_scaling_low_freq_factor",
        POSITIVE,
        "Llama 3.1 uses 1",
    ),
    Bound(
        "--rope-scaling-high-freq-factor",
        "model.rope_scaling_high_freq_factor",
        POSITIVE,
        "Llama 3.1 uses 4",
    ),
    Bound(
        "--rope-scaling-original-max-position-embeddings",
        "model.rope_scaling_original_max_position_embeddings",
        POSITIVE_INT,
        "Llama 3.1 uses 8192",
    ),
    Bound(
        "--rotary-seq-len-interpolation-factor",
        "model.rotary_seq_len_interpolation_factor",
        POSITIVE,
        "e.g. 2 to stretch the trained context twofold",
    ),
    Bound("--init-method-std", "model.init_method_std", POSITIVE, "e.g. 0.02"),
    Bound("--moe-loss-coeff", "model.moe.moe_loss_coeff", NON_NEGATIVE, "0 turns the loss off"),
    Bound("--lora-rank", "model.lora.lora_rank", NON_NEGATIVE, "0 turns LoRA off"),
    Bound("--lora-alpha", "model.lora.lora_alpha", POSITIVE, "e.g. 32 (scaling = alpha / rank)"),
    Bound("--lora-dropout", "model.lora.lora_dropout", UNIT_OPEN, "0 turns it off"),
    Bound("--seed", "training.seed", SEED),
    Bound(
        "--context-parallel-size",
        "parallel.context_parallel_size",
        POSITIVE_INT,
        "1 turns context parallelism off",
    ),
    Bound(
        "--lr-decay-iters", "training.lr_decay_iters", POSITIVE_INT, f"{_DEFAULT} (--train-iters)"
    ),
    Bound(
        "--lr-decay-samples",
        "training.lr_decay_samples",
        POSITIVE_INT,
        f"{_DEFAULT} (--train-samples)",
    ),
    Bound("--lr-warmup-iters", "training.lr_warmup_iters", NON_NEGATIVE, "0 means no warmup"),
    Bound("--lr-warmup-samples", "training.lr_warmup_samples", NON_NEGATIVE, "0 means no warmup"),
    Bound("--weight-decay", "training.weight_decay", NON_NEGATIVE, "0 turns it off"),
    Bound("--adam-beta1", "training.adam_beta1", UNIT_OPEN, "e.g. 0.9"),
    Bound("--adam-beta2", "training.adam_beta2", UNIT_OPEN, "e.g. 0.999 or 0.95"),
    Bound("--adam-eps", "training.adam_eps", POSITIVE, "e.g. 1e-8"),
    Bound("--sgd-momentum", "training.sgd_momentum", UNIT_OPEN, "0 turns momentum off"),
    Bound("--loss-scale", "training.loss_scale", POSITIVE, "leave it out for dynamic loss scaling"),
    Bound("--initial-loss-scale", "training.initial_loss_scale", POSITIVE),
    Bound("--min-loss-scale", "training.min_loss_scale", POSITIVE),
    Bound("--loss-scale-window", "training.loss_scale_window", POSITIVE_INT),
    Bound("--eval-harness-interval", "training.eval_harness_interval", POSITIVE_INT),
    Bound(
        "--eval-harness-limit", "training.eval_harness_limit", POSITIVE_INT, "leave it out for all"
    ),
    Bound("--eval-harness-num-fewshot", "training.eval_harness_num_fewshot", NON_NEGATIVE),
    Bound("--hysteresis", "training.hysteresis", POSITIVE_INT),
    Bound(
        "--exit-duration-in-mins",
        "training.exit_duration_in_mins",
        POSITIVE,
        _DEFAULT + " (no limit)",
    ),
    Bound(
        "--peak-tflops", "training.peak_tflops", POSITIVE, f"{_DEFAULT} (looked up for known GPUs)"
    ),
    Bound(
        "--straggler-threshold",
        "logging.straggler_threshold",
        ABOVE_ONE,
        "e.g. 1.5 (a rank 50% slower than its peers' median is named)",
    ),
    Bound("--vocab-size", "data.vocab_size", POSITIVE_INT),
    Bound("--train-data-exact-num-epochs", "data.train_data_exact_num_epochs", POSITIVE_INT),
    Bound(
        "--save-interval", "checkpoint.save_interval", POSITIVE_INT, _DEFAULT + " (save at the end)"
    ),
)
"""Every range checked by :func:`check_ranges` (the other numeric flags have rules in ``validate.py`` and its
helpers: sizes and degrees, dropout, --clip-grad, --lr, the MoE capacities, the timeouts)."""


def _value(cfg: Any, path: str) -> Any:
    for name in path.split("."):
        cfg = getattr(cfg, name)
    return cfg


def check_ranges(cfg: TridentConfig) -> None:
    """Every :data:`BOUNDS` row of the ``TridentConfig`` ``cfg`` that was given holds.

    Raises:
        ValueError: ``--adam-beta1 (1.5) must be in [0, 1); e.g. 0.9.``
    """
    for bound in BOUNDS:
        value = _value(cfg, bound.field)
        if value is not None and not bound.rule.ok(value):
            fix = f"; {bound.fix}" if bound.fix else ""
            raise ValueError(f"{bound.flag} ({value}) must be {bound.rule.words}{fix}.")


def check_run_length(cfg: TridentConfig, global_batch: int) -> None:
    """The samples (and tokens) the run reads fit a 64-bit count; past that the dataset index and ``len()``
    overflow deep inside the data pipeline.

    Raises:
        ValueError: naming the flags, the product and the limit.
    """
    t, seq = cfg.training, cfg.model.seq_length
    if t.train_samples is not None:
        samples, how = t.train_samples, f"--train-samples ({t.train_samples})"
    elif t.train_iters is not None:
        samples = t.train_iters * global_batch
        how = f"--train-iters ({t.train_iters}) x --global-batch-size ({global_batch}) = {samples} samples"
    else:
        return
    if samples * seq > INT64_MAX:
        raise ValueError(
            f"{how} x --seq-length ({seq}) = {samples * seq} tokens exceeds {INT64_MAX} (2**63 - 1), the most a "
            "dataset index can count; train for fewer iterations or samples."
        )
    if t.train_iters is not None and t.eval_iters:
        evals = (t.train_iters // t.eval_interval + 1) * t.eval_iters * global_batch
        if evals * seq > INT64_MAX:
            raise ValueError(
                f"--eval-iters ({t.eval_iters}) every --eval-interval ({t.eval_interval}) over --train-iters "
                f"({t.train_iters}) reads {evals} validation samples, more than a dataset index can count; "
                "raise --eval-interval or lower --eval-iters."
            )
