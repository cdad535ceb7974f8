"""``Trainer``: one run's engine, LR schedule, data and checkpoints, as the three things the loop asks of them.

    trainer.train_step()        one optimizer step over a global batch (writes the scheduled LR first)
    trainer.evaluate("valid")   mean loss over --eval-iters global batches of a split
    trainer.save(state)         a checkpoint of the current iteration (when --save is given)

The loop (``loop.py``) owns the schedule (when to log, evaluate, save, exit); the trainer owns how.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch

from megatron.training.checkpoint_hooks import CheckpointHooks
from megatron.training.data_iterators import RunIterators
from megatron.training.lr_scheduler import OptimizerParamScheduler
from megatron.training.model_setup import EngineBundle, optimizers_for_lr
from megatron.training.step import (
    StepResult,
    eval_step_engine,
    eval_step_pipe,
    train_step_engine,
    train_step_pipe,
)

Split = Literal["valid", "test"]


class Trainer:
    """The engine of a run and what drives it.

    Args:
        bundle: the engine, its client optimizer and whether it is the pipeline engine.
        scheduler: the LR schedule (written into every optimizer's param groups before each step).
        iterators: this rank's micro-batch iterators (train; valid/test or None).
        gradient_accumulation_steps: micro-batches per rank per step (the plain engine's loop count).
        eval_iters: global batches per evaluation (0: no evaluation).
        device: where the loop's flags (exit conditions) are all-reduced.
        checkpointer: save/load hooks; None without --save/--load.
        save_enabled: --save is given (the checkpointer may exist for --load alone).
    """

    def __init__(
        self,
        *,
        bundle: EngineBundle,
        scheduler: OptimizerParamScheduler,
        iterators: RunIterators,
        gradient_accumulation_steps: int,
        eval_iters: int,
        device: torch.device,
        checkpointer: CheckpointHooks | None = None,
        save_enabled: bool = False,
    ) -> None:
        self.bundle = bundle
        self.engine = bundle.engine
        self.scheduler = scheduler
        self.iterators = iterators
        self.gas = gradient_accumulation_steps
        self.eval_iters = eval_iters
        self.device = device
        self.checkpointer = checkpointer
        self.save_enabled = save_enabled and checkpointer is not None
        self.optimizers = optimizers_for_lr(bundle)

    def apply_lr(self) -> float:
        """Write the scheduled LR into every optimizer's param groups; returns it."""
        for opt in self.optimizers:
            self.scheduler.apply(opt)
        return self.scheduler.get_lr()

    def train_step(self) -> StepResult:
        """One optimizer step over the next global batch."""
        if self.bundle.is_pipe:
            return train_step_pipe(self.engine, self.iterators.train)
        return train_step_engine(self.engine, self.iterators.train, self.gas)

    def can_evaluate(self, split: Split) -> bool:
        """The split has data and --eval-iters is positive."""
        return self._batches(split) is not None and self.eval_iters > 0

    def evaluate(self, split: Split) -> float:
        """Mean loss over --eval-iters global batches of ``split`` (call only when :meth:`can_evaluate`)."""
        batches = self._batches(split)
        if batches is None or self.eval_iters <= 0:
            raise RuntimeError(f"no {split} data to evaluate (check can_evaluate first)")
        total = 0.0
        for _ in range(self.eval_iters):
            if self.bundle.is_pipe:
                total += eval_step_pipe(self.engine, batches)
            else:
                total += eval_step_engine(self.engine, batches, self.gas)
        return total / self.eval_iters

    def save(self, state: Any) -> None:
        """Write a checkpoint of ``state.iteration`` (no-op without --save)."""
        if self.save_enabled and self.checkpointer is not None:
            self.checkpointer.save(self.engine, self.scheduler, state)

    def _batches(self, split: Split) -> Iterator[Any] | None:
        return self.iterators.valid if split == "valid" else self.iterators.test
