"""Two per-iteration checks of the training loop beyond NaN/Inf: steps DeepSpeed skipped, and batches without a
single loss token.

**Skipped steps** (``SkipGuard``). DeepSpeed skips the update of a step whose gradients are not finite: its fp16
loss scaler does (and lowers the scale), and so does its ZeRO optimizer in every precision (ZeRO ≥ 1, and every
pipeline run with clipping, which runs as ZeRO-1). The grad norm of such a step is ``inf``; the weights stay as
they were, so with the same data and LR the next step usually overflows again:

============ ==================================================================================================
precision    a skipped step is
============ ==================================================================================================
fp32, bf16   a failure at once: there is no loss scale to lower, nothing will change for the next step
fp16         the dynamic loss scaler's business while the scale can still go down; a failure after
             :data:`MAX_SKIPS_AT_MIN_LOSS_SCALE` consecutive skips at --min-loss-scale (or at a static
             --loss-scale, which never goes down). DeepSpeed's dynamic scaler itself raises
             ``Exception("Current loss scale already at minimum ...")`` on every rank at the first overflow it
             cannot absorb there (:func:`loss_scale_exhausted` recognizes it): the same failure.
============ ==================================================================================================

The loop stops such a run like a NaN loss (exit 6, nothing saved, ``latest`` stays at the last good checkpoint).

**Loss tokens** (``LossTokenWatch``). A global batch whose loss mask is all zero (every sample a lone EOD document
under --eod-mask-loss, say) has loss 0 and grad norm 0 and trains nothing but weight decay. One such batch in a
real corpus is harmless, so it is a warning (one per log interval, with the count). A run that has counted no loss
token at all by the end of its first log interval (or by its first save, or its end, if earlier) is reading data
it cannot learn from: that is bad input, and the run stops with exit 2 before any checkpoint of it is written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from megatron.launch.exit_codes import ConfigError
from megatron.log import global_rank
from megatron.training.step import StepResult

logger = logging.getLogger(__name__)

MAX_SKIPS_AT_MIN_LOSS_SCALE = 3
"""fp16: consecutive skipped steps at the lowest loss scale before the run stops. At that scale the gradients
overflow unscaled; DeepSpeed's hysteresis (default 2) already waited out a transient overflow."""


DEEPSPEED_MIN_SCALE_ERROR = "Current loss scale already at minimum"
"""The start of the message of the plain ``Exception`` DeepSpeed's ``DynamicLossScaler.update_scale`` raises (0.19.8)
when the gradients overflow at --min-loss-scale with no hysteresis left."""


def loss_scale_exhausted(err: BaseException) -> str | None:
    """Why the run must stop when ``err`` is DeepSpeed's fp16 loss scaler giving up (raised on every rank alike:
    DeepSpeed all-reduces the overflow), else None."""
    if DEEPSPEED_MIN_SCALE_ERROR not in str(err):
        return None
    return (
        "DeepSpeed's fp16 loss scaler skipped the update and cannot lower the loss scale below --min-loss-scale: "
        "the gradients overflow unscaled"
    )


@dataclass
class SkipGuard:
    """Decides when a step DeepSpeed skipped is a failure (see the module docstring)."""

    precision: str
    """``fp32``, ``bf16`` or ``fp16``."""
    min_loss_scale: float = 1.0
    """The lowest fp16 loss scale: --min-loss-scale, or the static --loss-scale."""
    skips_at_min: int = 0
    """Consecutive fp16 steps skipped at ``min_loss_scale`` so far."""

    def failure(self, result: StepResult) -> str | None:
        """Why the run must stop after ``result`` (identical on every rank: DeepSpeed agrees on a skip), or None."""
        if not result.skipped:
            self.skips_at_min = 0
            return None
        if self.precision != "fp16":
            return (
                f"DeepSpeed skipped the update (non-finite gradients, grad norm {result.grad_norm}); in "
                f"{self.precision} there is no loss scale to lower, so every later step would be skipped too"
            )
        if result.loss_scale > self.min_loss_scale:
            self.skips_at_min = 0
            return None
        self.skips_at_min += 1
        if self.skips_at_min < MAX_SKIPS_AT_MIN_LOSS_SCALE:
            return None
        return (
            f"{self.skips_at_min} consecutive steps skipped at the lowest fp16 loss scale "
            f"({result.loss_scale:g}): the gradients overflow even unscaled"
        )


@dataclass
class LossTokenWatch:
    """Counts global batches without a loss token (see the module docstring)."""

    first_iteration: int
    """The iteration the run started from (0, or the loaded checkpoint's)."""
    log_interval: int
    seen_any: bool = False
    """Some global batch of this run had a loss token."""
    empty: list[int] | None = None
    """Iterations of the current log interval whose global batch had none."""

    def record(self, iteration: int, has_tokens: bool) -> None:
        """``has_tokens``: some rank's micro-batches of ``iteration`` held a loss token (all-reduced)."""
        if has_tokens:
            self.seen_any = True
        else:
            self.empty = [*(self.empty or []), iteration]

    def check(self, iteration: int, *, decide_now: bool) -> None:
        """Warn at a log interval that had empty batches; stop when the run never counted a token.

        ``decide_now``: the first log interval ends, a checkpoint is due or the run ends at ``iteration``.

        Raises:
            ConfigError: no global batch since ``first_iteration`` had a loss token.
        """
        trained = iteration - self.first_iteration
        if decide_now and not self.seen_any:
            first = self.first_iteration + 1
            span = f"iteration {first}" if first == iteration else f"iterations {first}-{iteration}"
            raise ConfigError(
                f"no loss token in the {trained} iteration(s) trained ({span}): the loss mask of every sample "
                "is all zero, so the loss is 0 and nothing trains. With --eod-mask-loss the samples hold only "
                "EOD tokens: check the training data (--data-path; documents with no text but the EOD) or drop "
                "--eod-mask-loss."
            )
        if iteration % self.log_interval == 0 and self.empty:
            if global_rank() == 0:
                logger.warning(
                    "%d of the last %d iterations (%s) had no loss token in their global batch (an all-zero loss "
                    "mask, e.g. samples of EOD tokens only under --eod-mask-loss): loss 0, nothing trained",
                    len(self.empty),
                    min(self.log_interval, trained),
                    ", ".join(map(str, self.empty[:10])) + (" ..." if len(self.empty) > 10 else ""),
                )
            self.empty = None
