"""``Trainer``: one run's engine, LR schedule, data and checkpoints, as the three things the loop asks of them.

    trainer.train_step()        one optimizer step over a global batch (writes the scheduled LR first)
    trainer.evaluate("valid")   mean loss over --eval-iters global batches of a split
    trainer.save(state)         a checkpoint of the current iteration (when --save is given)

The loop (``loop.py``) owns the schedule (when to log, evaluate, save, exit); the trainer owns how.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from megatron.config import RunPlan
from megatron.training.checkpoint_hooks import CheckpointHooks
from megatron.training.data_iterators import RunIterators, pipe_batch
from megatron.training.initialize import Distributed
from megatron.training.lr_scheduler import OptimizerParamScheduler
from megatron.training.model_setup import EngineBundle, optimizers_for_lr
from megatron.training.step import (
    StepGroups,
    StepResult,
    eval_step_engine,
    eval_step_pipe,
    train_step_engine,
    train_step_pipe,
)
from megatron.training.timers import Timers, install_pipe_timers

Split = Literal["valid", "test"]


@dataclass(frozen=True)
class Checkpointing:
    """How a trainer checkpoints."""

    hooks: CheckpointHooks | None = None
    """Save/load hooks; None without --save/--load."""
    save: bool = False
    """--save is given (the hooks may exist for --load alone)."""


class Trainer:
    """The engine of a run and what drives it.

    Args:
        bundle: the engine, its client optimizer and whether it is the pipeline engine.
        scheduler: the LR schedule (written into every optimizer's param groups before each step).
        iterators: this rank's micro-batch iterators (train; valid/test or None).
        plan: the run plan: micro-batch size, DP size, gradient-accumulation steps (the plain engine's loop
            count) and so the global batch.
        run: this rank's device (where the loop's exit flags are all-reduced) and model-parallel groups (what the
            step reduces over).
        eval_iters: global batches per evaluation (0: no evaluation).
        checkpointing: save/load hooks and whether --save is given; default: none.
        timers: the run's timers (``timers.py``); default: none exist (--timing-log-level 0).
    """

    def __init__(
        self,
        *,
        bundle: EngineBundle,
        scheduler: OptimizerParamScheduler,
        iterators: RunIterators,
        plan: RunPlan,
        run: Distributed,
        eval_iters: int,
        checkpointing: Checkpointing | None = None,
        timers: Timers | None = None,
    ) -> None:
        checkpointing = checkpointing if checkpointing is not None else Checkpointing()
        self.bundle = bundle
        self.engine = bundle.engine
        self.scheduler = scheduler
        self.iterators = iterators
        self.gas = plan.gradient_accumulation_steps
        self.eval_iters = eval_iters
        self.device = run.device
        self.state = run.state
        """The run's model-parallel groups."""
        self.groups = StepGroups.of(run.state)
        self.checkpointer = checkpointing.hooks
        self.save_enabled = checkpointing.save and checkpointing.hooks is not None
        self.optimizers = optimizers_for_lr(bundle)
        self.timers = timers if timers is not None else Timers()
        if bundle.is_pipe:
            install_pipe_timers(self.engine, self.timers)
        self.seqlen = iterators.seqlen
        """The curriculum length the training iterator cuts samples to (``curriculum.py``)."""
        self._pipe_seqlen: int | None = None
        """The sequence length the pipeline engine's p2p buffers were last shaped for (None: whole samples)."""
        self._samples_per_micro_step = plan.micro_batch_size * plan.data_parallel_size
        """Samples one micro-step of every DP rank consumes (the plan's, which DeepSpeed's config was made from)."""
        self.global_batch = plan.gradient_accumulation_steps * self._samples_per_micro_step
        self._ds_batch_factor = plan.context_parallel_size if bundle.is_pipe else 1
        """DeepSpeed's pipeline grid counts CP ranks as data-parallel: its batch is the global batch x CP."""
        self.ramped = False
        """True once --rampup-batch-size changed the batch: micro-step boundaries are then set explicitly."""
        self.loss_reduction: Literal["mean", "sum"] = (
            "mean" if iterators.token_weights is None else "sum"
        )
        """How the step reduces per-token losses: ``"sum"`` of --sft's global per-token weights."""

    def set_global_batch(self, global_batch: int) -> None:
        """Train (and evaluate) the next steps with ``global_batch`` samples (--rampup-batch-size): the
        DeepSpeed engine's batch (gradient-accumulation steps; the pipeline engine's micro-batches) follows."""
        if global_batch == self.global_batch:
            return
        self.engine.set_train_batch_size(global_batch * self._ds_batch_factor)
        self.gas = global_batch // self._samples_per_micro_step
        self.global_batch, self.ramped = global_batch, True

    def set_seqlen(self, seqlen: int | None) -> None:
        """Train the next step on the first ``seqlen`` tokens of each sample (None: whole samples)."""
        self.seqlen.value = seqlen
        self._reshape_pipe(seqlen)

    def _reshape_pipe(self, seqlen: int | None) -> None:
        # The pipeline engine sends activation shapes once and reuses its buffers: a new length needs a reset.
        if self.bundle.is_pipe and seqlen != self._pipe_seqlen:
            self.engine.reset_activation_shape()
            self._pipe_seqlen = seqlen

    def apply_lr(self) -> float:
        """Write the scheduled LR into every optimizer's param groups; returns it."""
        for opt in self.optimizers:
            self.scheduler.apply(opt)
        return self.scheduler.get_lr()

    def train_step(self) -> StepResult:
        """One optimizer step over the next global batch."""
        batches, _ = self._global_batch(self.iterators.train)
        if self.bundle.is_pipe:
            return train_step_pipe(self.engine, batches, self.groups, self.timers)
        return train_step_engine(
            self.engine,
            batches,
            self.gas,
            groups=self.groups,
            explicit_boundary=self.ramped,
            timers=self.timers,
            loss_reduction=self.loss_reduction,
        )

    def _global_batch(self, micro: Iterator[Any]) -> tuple[Iterator[Any], int]:
        """The micro-batches of the next global batch as the engine takes them, and its loss tokens (0 when not
        counted). --sft: this rank's ``gas`` micro-batches with the global per-token weights (``token_weights.py``,
        one all-reduce), as pipe tuples for the pipeline engine; otherwise ``micro`` itself."""
        weights = self.iterators.token_weights
        if weights is None:
            return micro, 0
        timer = self.timers("batch-generator", 2)  # the data of the whole global batch is read here
        timer.start()
        batches, total = weights.take(micro, self.gas)
        timer.stop()
        if self.bundle.is_pipe:
            return iter([pipe_batch(b) for b in batches]), total
        return iter(batches), total

    def take_loss_tokens(self) -> int | None:
        """Loss tokens this rank drew for training since the last call (None: the iterators do not count)."""
        counter = self.iterators.loss_tokens
        return None if counter is None else counter.take()

    def can_evaluate(self, split: Split) -> bool:
        """The split has data and --eval-iters is positive."""
        return self._batches(split) is not None and self.eval_iters > 0

    def evaluate(self, split: Split) -> float:
        """Mean loss over --eval-iters global batches of ``split`` (call only when :meth:`can_evaluate`)."""
        batches = self._batches(split)
        if batches is None or self.eval_iters <= 0:
            raise RuntimeError(f"no {split} data to evaluate (check can_evaluate first)")
        self._reshape_pipe(None)  # evaluation batches are whole samples
        total, tokens = 0.0, 0
        for _ in range(self.eval_iters):
            micro, count = self._global_batch(batches)
            if self.bundle.is_pipe:
                loss = eval_step_pipe(self.engine, micro, self.groups)
            else:
                loss = eval_step_engine(
                    self.engine, micro, self.gas, self.groups, self.loss_reduction
                )
            # --sft: each batch's per-token mean weighed by its loss tokens (the mean over all of them)
            weight = count if self.loss_reduction == "sum" else 1
            total, tokens = total + loss * weight, tokens + weight
        return total / max(tokens, 1)

    def save(self, state: Any) -> None:
        """Write a checkpoint of ``state.iteration`` (no-op without --save)."""
        if self.save_enabled and self.checkpointer is not None:
            self.checkpointer.save(self.engine, self.scheduler, state)

    def finalize_save(self, *, blocking: bool) -> None:
        """Commit a background save (--async-save) once every rank wrote it; ``blocking``: wait for it (the exit).
        Every rank calls it at the same points. Hooks without background saves have nothing to finalize."""
        finalize = getattr(self.checkpointer, "finalize_save", None)
        if self.save_enabled and finalize is not None:
            finalize(blocking=blocking)

    def _batches(self, split: Split) -> Iterator[Any] | None:
        return self.iterators.valid if split == "valid" else self.iterators.test
