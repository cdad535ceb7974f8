"""``--rampup-batch-size START INCR SAMPLES``: Megatron's global-batch ramp-up, as a pure function of consumed samples.

With ``G = --global-batch-size`` the ramp has ``n = (G - START) / INCR`` increments, one every
``SAMPLES / n`` consumed samples (a float, as in Megatron)::

    batch(consumed) = G                                            if consumed > SAMPLES
                    = START + int(consumed / (SAMPLES / n)) * INCR  otherwise

e.g. ``--rampup-batch-size 4 4 24 --global-batch-size 12``: n = 2, one increment per 12 samples; iterations draw
4, 4, 4, 8, 8, 12, 12, ... samples (consumed 0, 4, 8, 12, 20, 28, ...). The batch of an iteration depends only on
the samples consumed before it, so resuming from a checkpoint (which stores that count) continues the ramp exactly,
whatever the layout. A ``--train-samples`` run lasts :meth:`BatchRampup.train_iters` iterations (Megatron's count:
the ramp, then whole batches of G; a partial last batch is not trained). Megatron allows the ramp only for
sample-based runs; so do we.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.config.arguments import TridentConfig


@dataclass(frozen=True)
class BatchRampup:
    """A validated ramp from ``start`` to ``global_batch_size`` over ``ramp_samples`` samples."""

    start: int
    increment: int
    ramp_samples: int
    global_batch_size: int

    @classmethod
    def parse(cls, values: Sequence[str], global_batch_size: int) -> BatchRampup:
        """The ramp of ``--rampup-batch-size values`` towards ``global_batch_size``.

        Raises:
            ValueError: not three integers, non-positive START/INCR, negative SAMPLES, START above the global
                batch, or a gap to the global batch that INCR does not divide.
        """
        flag = f"--rampup-batch-size {' '.join(map(str, values))}"
        try:
            start, increment, samples = (int(v) for v in values)
        except ValueError:
            raise ValueError(
                f"{flag}: give three integers START INCR SAMPLES, e.g. --rampup-batch-size 16 16 300000 "
                "(start at 16, add 16 at a time, reach --global-batch-size after 300000 samples)."
            ) from None
        if start < 1 or increment < 1 or samples < 0:
            raise ValueError(f"{flag}: START and INCR must be >= 1 and SAMPLES >= 0.")
        gap = global_batch_size - start
        if gap < 0 or gap % increment:
            raise ValueError(
                f"{flag}: --global-batch-size ({global_batch_size}) minus START ({start}) = {gap} must be a "
                f"non-negative multiple of INCR ({increment}); pick START and INCR that reach it exactly."
            )
        return cls(start, increment, samples, global_batch_size)

    def global_batch_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after ``consumed_samples`` samples."""
        increments = (self.global_batch_size - self.start) // self.increment
        if consumed_samples > self.ramp_samples or increments == 0:
            return self.global_batch_size
        per_increment = self.ramp_samples / increments
        return self.start + int(consumed_samples / per_increment) * self.increment

    def train_iters(self, train_samples: int) -> int:
        """Iterations of a ``--train-samples`` run: ramp iterations, then whole global batches."""
        consumed = iterations = 0
        while consumed <= self.ramp_samples:
            batch = self.global_batch_at(consumed)
            if consumed + batch > train_samples:
                return iterations
            consumed += batch
            iterations += 1
        return iterations + (train_samples - consumed) // self.global_batch_size

    def check_layout(self, micro_batch_size: int, data_parallel_size: int) -> None:
        """Every batch of the ramp must split into whole micro-batches on every data-parallel rank.

        Raises:
            ValueError: START or INCR not a multiple of micro batch x data-parallel size.
        """
        unit = micro_batch_size * data_parallel_size
        steps = self.global_batch_size != self.start
        if self.start % unit or (steps and self.increment % unit):
            raise ValueError(
                f"--rampup-batch-size {self.start} {self.increment} {self.ramp_samples}: START ({self.start}) "
                f"and INCR ({self.increment}) must be multiples of --micro-batch-size ({micro_batch_size}) x "
                f"data-parallel size ({data_parallel_size}) = {unit}, so that every global batch of the ramp "
                f"splits into whole micro-batches; use multiples of {unit}."
            )


def check_rampup(cfg: TridentConfig, world_size: int) -> None:
    """``validate()``'s checks of ``--rampup-batch-size`` (nothing to check without it).

    Raises:
        ValueError: a bad ramp (:meth:`BatchRampup.parse`, :meth:`BatchRampup.check_layout`), an iteration-based
            run (Megatron's rule: the ramp is counted in samples), or the cyclic data loader.
    """
    t = cfg.training
    if t.rampup_batch_size is None:
        return
    dp = cfg.parallel.data_parallel_size(world_size)
    gbs = t.global_batch_size if t.global_batch_size is not None else t.micro_batch_size * dp
    ramp = BatchRampup.parse(t.rampup_batch_size, gbs)
    ramp.check_layout(t.micro_batch_size, dp)
    if t.train_samples is None:
        raise ValueError(
            "--rampup-batch-size needs a sample-based run: give --train-samples instead of --train-iters (and "
            "--lr-warmup-samples/--lr-decay-samples for the LR schedule), as Megatron requires."
        )
    if cfg.data.dataloader_type != "single":
        raise ValueError(
            f"--rampup-batch-size works with --dataloader-type single (got {cfg.data.dataloader_type}): the "
            "cyclic sampler's epochs are cut in whole global batches of one size."
        )
