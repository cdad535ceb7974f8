"""Learning-rate schedule with Megatron's ``OptimizerParamScheduler`` semantics, counted in samples.

Steps are samples: an iteration-based run uses ``warmup = --lr-warmup-iters x global batch`` (or
``--lr-warmup-fraction x decay``) and ``decay = --lr-decay-iters (default --train-iters) x global batch``; a
sample-based run uses ``--lr-warmup-samples`` and ``--lr-decay-samples`` (default --train-samples).

    lr(step) = max_lr * step / warmup                          step <= warmup (warmup > 0)
             = max_lr                                          constant
             = max(min_lr, max_lr * sqrt(warmup) / sqrt(step))  inverse-square-root (warmup >= 1)
             = min_lr                                          step > decay
             = min_lr + coeff * (max_lr - min_lr)              ratio = (step - warmup) / (decay - warmup)
                 linear: coeff = 1 - ratio;  cosine: coeff = 0.5 * (cos(pi * ratio) + 1)

The trainer drives it: before each optimizer step it writes :meth:`get_lr` into every param group (times the group's
``lr_mult``, default 1); after an applied step it calls :meth:`step` with the global batch. A step skipped by the
fp16 loss scaler does not advance the schedule (Megatron's behaviour).

On resume (:meth:`OptimizerParamScheduler.load_state_dict`) the sample count comes from the checkpoint; the constants
(--lr, --min-lr, --lr-decay-style, warmup and decay lengths) are compared with the flags' and a difference is an
error unless --override-opt_param-scheduler (the flags win) or --use-checkpoint-opt_param-scheduler (the checkpoint
wins) says which, as in Megatron. One exception, so that extending a run with a larger --train-iters/--train-samples
does not train at --min-lr: when --lr-decay-iters/--lr-decay-samples is not given, the decay length is derived from
the run length (Megatron's default) and follows the flags (with a log line), as does a --lr-warmup-fraction warmup;
--use-checkpoint-opt_param-scheduler keeps the checkpoint's there too.

Token-based schedule (Megatron-DeepSpeed's --lr-warmup-tokens / --lr-decay-tokens, ``OptimizerParamScheduler.get_lr``
of its ``megatron/optimizer_param_scheduler.py``): with --lr-decay-tokens the same formulas run on ``tokens``, the
tokens consumed so far (global batch x --seq-length per iteration, skipped iterations included), with
``warmup = --lr-warmup-tokens`` and ``decay = --lr-decay-tokens``; past the decay every style but constant gives
--min-lr. An iteration/sample warmup followed by a token decay (--lr-warmup-iters with --lr-decay-tokens) warms up
by samples and decays from the tokens consumed when that warmup ended. The trainer passes the token count with each
:meth:`step`; one difference from Megatron-DeepSpeed: its engine steps the schedule before the loop adds the
iteration's tokens, so its token count lags one iteration behind its sample count; here both include the iteration
just trained. The token constants are compared on resume like the others; the token count is restored.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from megatron.config import RunPlan, TrainingConfig
from megatron.config.plan import train_samples_and_iters
from megatron.launch.exit_codes import ConfigError

DecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root"]
ResumePolicy = Literal["error", "override", "checkpoint"]
"""What a resume does with schedule constants that differ from the checkpoint's: refuse, or take the flags'
(--override-opt_param-scheduler), or the checkpoint's (--use-checkpoint-opt_param-scheduler)."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LRSchedule:
    """The constants of a schedule (Megatron's ``OptimizerParamScheduler`` arguments), in samples.

    A value of its own instead of ten constructor arguments: the preflight checks it (:meth:`check`) without
    building a scheduler, and :class:`OptimizerParamScheduler` is built from it.
    """

    max_lr: float
    """--lr."""
    min_lr: float
    """--min-lr."""
    lr_warmup_steps: int
    """Warmup length in samples."""
    lr_decay_steps: int
    """Decay length in samples."""
    lr_decay_style: DecayStyle
    on_resume: ResumePolicy = "error"
    from_run_length: frozenset[str] = frozenset()
    """Constants derived from the run length (``lr_decay_steps`` without --lr-decay-iters/-samples, then
    ``lr_warmup_steps`` of a --lr-warmup-fraction): on resume they follow the flags."""
    lr_warmup_tokens: int | None = None
    """--lr-warmup-tokens."""
    lr_decay_tokens: int | None = None
    """--lr-decay-tokens (the schedule then runs on tokens)."""

    def check(self) -> None:
        """Raises ValueError for a non-positive decay, or a warmup longer than the decay (samples or tokens)."""
        if self.lr_decay_steps <= 0:
            raise ValueError(
                f"LR decay length ({self.lr_decay_steps} samples) must be positive; set --lr-decay-iters or "
                "--lr-decay-samples (or --train-iters/--train-samples)."
            )
        if self.lr_warmup_steps > self.lr_decay_steps:
            raise ValueError(
                f"LR warmup ({self.lr_warmup_steps} samples) exceeds the decay length ({self.lr_decay_steps} "
                "samples); shorten --lr-warmup-* or lengthen --lr-decay-*."
            )
        warmup_tokens, decay_tokens = self.lr_warmup_tokens, self.lr_decay_tokens
        if warmup_tokens is not None and (decay_tokens is None or warmup_tokens > decay_tokens):
            raise ValueError(
                f"LR warmup of {warmup_tokens} tokens needs a longer --lr-decay-tokens (got {decay_tokens})."
            )


class OptimizerParamScheduler:
    """Megatron's LR schedule (sample-counted), with ``state_dict``/``load_state_dict`` for checkpoints.

    Raises:
        ValueError: see :meth:`LRSchedule.check`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer | None, schedule: LRSchedule) -> None:
        schedule.check()
        self.optimizer = optimizer
        self.max_lr = float(schedule.max_lr)
        self.min_lr = float(schedule.min_lr)
        self.lr_warmup_steps = int(schedule.lr_warmup_steps)
        self.lr_decay_steps = int(schedule.lr_decay_steps)
        self.lr_decay_style: DecayStyle = schedule.lr_decay_style
        self.on_resume: ResumePolicy = schedule.on_resume
        self.from_run_length = schedule.from_run_length
        """Constants derived from the run length (:attr:`LRSchedule.from_run_length`)."""
        self.lr_warmup_tokens = schedule.lr_warmup_tokens
        self.lr_decay_tokens = schedule.lr_decay_tokens
        self.num_steps = 0
        self.num_tokens = 0
        """Tokens consumed (the token schedule's position), as last given to :meth:`step`."""
        self.warmup_end_tokens: int | None = None
        """Tokens consumed when the iteration/sample warmup ended (where a token decay after it starts)."""
        self.step(0)

    def get_lr(self) -> float:
        """The learning rate at the current sample count (token count with --lr-decay-tokens)."""
        if self.lr_decay_tokens is not None:
            return self._token_lr(self.lr_decay_tokens)
        step, warmup, decay = self.num_steps, self.lr_warmup_steps, self.lr_decay_steps
        if warmup > 0 and step <= warmup:
            return self.max_lr * step / warmup
        if self.lr_decay_style == "constant":
            return self.max_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup = max(warmup, 1)
            return max(self.min_lr, self.max_lr * math.sqrt(warmup) / math.sqrt(max(step, 1)))
        if step > decay:
            return self.min_lr
        return self._decayed((step - warmup) / max(decay - warmup, 1))

    def _token_lr(self, decay: int) -> float:
        tokens = self.num_tokens
        if self.lr_warmup_tokens is not None:
            warmup = self.lr_warmup_tokens
            if warmup > 0 and tokens <= warmup:
                return self.max_lr * tokens / warmup
        else:
            if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
                return self.max_lr * self.num_steps / self.lr_warmup_steps
            warmup = self.warmup_end_tokens or 0
        if self.lr_decay_style == "constant":
            return self.max_lr
        if tokens > decay:
            return self.min_lr
        if self.lr_decay_style == "inverse-square-root":
            # Megatron-DeepSpeed: by tokens after a token warmup, by samples after a sample warmup.
            at, start = (
                (tokens, self.lr_warmup_tokens)
                if self.lr_warmup_tokens is not None
                else (self.num_steps, self.lr_warmup_steps)
            )
            return max(self.min_lr, self.max_lr * math.sqrt(max(start, 1)) / math.sqrt(max(at, 1)))
        return self._decayed((tokens - warmup) / max(decay - warmup, 1))

    def _decayed(self, ratio: float) -> float:
        """min_lr + coeff(ratio) x (max_lr - min_lr) for the linear and cosine decays."""
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            raise ValueError(f"--lr-decay-style {self.lr_decay_style!r} is not supported.")
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def apply(self, optimizer: torch.optim.Optimizer | None = None) -> float:
        """Write the current LR into every param group of ``optimizer`` (default: the one given at init)."""
        lr = self.get_lr()
        opt = optimizer if optimizer is not None else self.optimizer
        if opt is not None:
            for group in opt.param_groups:
                group["lr"] = lr * group.get("lr_mult", 1.0)
        return lr

    def step(self, increment: int, tokens: int | None = None) -> None:
        """Advance by ``increment`` samples, set the token count to ``tokens`` (the total consumed, when given)
        and apply the new LR."""
        self.num_steps += int(increment)
        if tokens is not None:
            self.num_tokens = int(tokens)
        if self.warmup_end_tokens is None and self.num_steps >= self.lr_warmup_steps:
            self.warmup_end_tokens = self.num_tokens
        self.apply()

    def state_dict(self) -> dict[str, Any]:
        """Megatron's keys (the subset this schedule uses)."""
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "lr_decay_steps": self.lr_decay_steps,
            "lr_decay_style": self.lr_decay_style,
            "num_steps": self.num_steps,
            "lr_warmup_tokens": self.lr_warmup_tokens,
            "lr_decay_tokens": self.lr_decay_tokens,
            "num_tokens": self.num_tokens,
            "lr_warmup_end_tokens": self.warmup_end_tokens,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a checkpoint's schedule: its sample count, and the rule of the module docstring for constants
        that differ from the flags (Megatron's --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler).

        Raises:
            ConfigError: a constant differs and neither switch is given (identical on every rank).
        """
        mismatches: list[str] = []
        for key, what in _COMPARED:
            if key not in state:
                continue  # an older checkpoint without it: the flags' value
            mine, theirs = getattr(self, key), state[key]
            if _same_value(mine, theirs):
                continue
            if key in self.from_run_length and self.on_resume != "checkpoint":
                logger.info(
                    "LR schedule: %s follows the run length of the flags: %s (the checkpoint had %s)",
                    what,
                    mine,
                    theirs,
                )
            elif self.on_resume == "override":
                logger.info(
                    "LR schedule: %s = %s from the flags (the checkpoint had %s)",
                    what,
                    mine,
                    theirs,
                )
            elif self.on_resume == "checkpoint":
                logger.info(
                    "LR schedule: %s = %s from the checkpoint (the flags give %s)",
                    what,
                    theirs,
                    mine,
                )
                setattr(self, key, theirs if mine is None or theirs is None else type(mine)(theirs))
            else:
                mismatches.append(f"{what}: flags {mine}, checkpoint {theirs}")
        if mismatches:
            raise ConfigError(
                "the LR schedule of the flags differs from the checkpoint's ("
                + "; ".join(mismatches)
                + "). Pass --override-opt_param-scheduler to use the flags' schedule, or "
                "--use-checkpoint-opt_param-scheduler to keep the checkpoint's, or give the flags it was saved with."
            )
        self.num_steps = 0
        # A checkpoint without it (before the token schedule): a warmup of 0 samples ended at token 0.
        self.warmup_end_tokens = state.get(
            "lr_warmup_end_tokens", 0 if self.lr_warmup_steps == 0 else None
        )
        self.step(int(state["num_steps"]), tokens=state.get("num_tokens", self.num_tokens))
        at, decay, unit = (
            (self.num_steps, self.lr_decay_steps, "samples")
            if self.lr_decay_tokens is None
            else (self.num_tokens, self.lr_decay_tokens, "tokens")
        )
        if at >= decay and self.lr_decay_style in ("linear", "cosine"):
            logger.warning(
                "LR schedule: the run resumes at %d %s, past the decay length (%d %s): it trains at "
                "--min-lr (%s)",
                at,
                unit,
                decay,
                unit,
                self.min_lr,
            )


_COMPARED: tuple[tuple[str, str], ...] = (
    ("max_lr", "--lr"),
    ("min_lr", "--min-lr"),
    ("lr_decay_style", "--lr-decay-style"),
    ("lr_warmup_steps", "warmup length in samples (--lr-warmup-iters/-samples/-fraction)"),
    (
        "lr_decay_steps",
        "decay length in samples (--lr-decay-iters/-samples, default: the run length)",
    ),
    ("lr_warmup_tokens", "--lr-warmup-tokens"),
    ("lr_decay_tokens", "--lr-decay-tokens"),
)
"""(state key, how the message names it) of every schedule constant compared on resume."""


def _same_value(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return float(a) == float(b)


def lr_schedule(
    t: TrainingConfig, global_batch: int, train_samples: int | None = None
) -> LRSchedule:
    """The schedule constants of ``t`` in samples (see the module docstring for the mapping of flags).

    ``train_samples``: the run's length in samples (``RunPlan.train_samples``), the default decay of a sample-based
    run; None computes it from ``t`` (a schedule built outside a run).
    """
    if t.train_iters is not None:
        decay = (t.lr_decay_iters or t.train_iters) * global_batch
        warmup = (
            int(t.lr_warmup_fraction * decay)
            if t.lr_warmup_fraction is not None
            else t.lr_warmup_iters * global_batch
        )
    else:
        if t.lr_decay_samples:
            decay = t.lr_decay_samples
        elif train_samples is not None:
            decay = train_samples
        else:
            decay = train_samples_and_iters(t, global_batch)[0]
        warmup = (
            int(t.lr_warmup_fraction * decay)
            if t.lr_warmup_fraction is not None
            else t.lr_warmup_samples
        )
    on_resume: ResumePolicy = (
        "override"
        if t.override_opt_param_scheduler
        else "checkpoint"
        if t.use_checkpoint_opt_param_scheduler
        else "error"
    )
    derived: frozenset[str] = frozenset()
    if (t.lr_decay_iters if t.train_iters is not None else t.lr_decay_samples) is None:
        derived = frozenset(
            {"lr_decay_steps", *(("lr_warmup_steps",) if t.lr_warmup_fraction is not None else ())}
        )
    return LRSchedule(
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=t.lr_decay_style,
        on_resume=on_resume,
        from_run_length=derived,
        lr_warmup_tokens=t.lr_warmup_tokens,
        lr_decay_tokens=t.lr_decay_tokens,
    )


def check_lr_schedule(t: TrainingConfig, plan: RunPlan) -> None:
    """The schedule's own checks (warmup vs decay length) for the run ``plan`` describes, building no scheduler.

    Raises:
        ValueError: see :meth:`LRSchedule.check`.
    """
    lr_schedule(t, plan.global_batch_size, plan.train_samples).check()


def build_lr_scheduler(
    t: TrainingConfig,
    global_batch: int,
    optimizer: torch.optim.Optimizer | None,
    *,
    train_samples: int | None = None,
) -> OptimizerParamScheduler:
    """The schedule for ``t`` in samples (:func:`lr_schedule`), writing its LR into ``optimizer``."""
    return OptimizerParamScheduler(optimizer, lr_schedule(t, global_batch, train_samples))
