"""The training loop: steps, LR schedule, logging, evaluation and the exit conditions.

Per iteration: write the scheduled LR into the optimizer, run one step (``step.py``), count the global batch
as consumed, advance the schedule unless the step was skipped, then log (every --log-interval), evaluate
(every --eval-interval), save (every --save-interval, through the checkpoint hook) and check the exits:

* ``--exit-interval N``: stop when iteration % N == 0 -> :data:`~megatron.training.exit_codes.EXIT_INTERVAL`;
* ``--exit-duration-in-mins M``: stop once the MAX elapsed time over all ranks exceeds M minutes (so every rank
  decides the same) -> ``EXIT_DURATION``;
* SIGTERM (unless --no-exit-signal-handler): stop when any rank got it -> ``EXIT_SIGNAL``.

Each of them saves a checkpoint first when a save hook is present. Reaching --train-iters returns ``EXIT_OK`` (after
saving the final iteration, unless --save-interval just did), also when that iteration is an exit point.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from megatron.config import RunPlan, TridentConfig
from megatron.mpu.mappings import all_reduce_max_
from megatron.training.exit_codes import EXIT_DURATION, EXIT_INTERVAL, EXIT_OK, EXIT_SIGNAL
from megatron.training.flops import Throughput
from megatron.training.metrics import (
    EvalRecord,
    MetricsWriter,
    TestRecord,
    TrainRecord,
    format_eval_line,
    format_test_line,
    format_train_line,
    perplexity,
)
from megatron.training.state import TrainState
from megatron.training.step import StepResult
from megatron.training.trainer import Trainer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopSpec:
    """The schedule of a run, in iterations: when the loop steps, logs, evaluates, saves and exits."""

    train_iters: int
    global_batch: int
    """Samples consumed per iteration."""
    log_interval: int
    eval_interval: int
    eval_samples: int
    """Validation samples one evaluation draws (--eval-iters x global batch)."""
    exit_interval: int | None
    exit_duration_in_mins: float | None
    exit_signal_handler: bool
    save_interval: int | None

    @classmethod
    def of(cls, cfg: TridentConfig, plan: RunPlan) -> LoopSpec:
        """The schedule of ``cfg`` run as ``plan``."""
        t = cfg.training
        return cls(
            train_iters=plan.train_iters,
            global_batch=plan.global_batch_size,
            log_interval=cfg.logging.log_interval,
            eval_interval=t.eval_interval,
            eval_samples=t.eval_iters * plan.global_batch_size,
            exit_interval=t.exit_interval,
            exit_duration_in_mins=t.exit_duration_in_mins,
            exit_signal_handler=t.exit_signal_handler,
            save_interval=cfg.checkpoint.save_interval,
        )


class _SigtermFlag:
    """Records SIGTERM instead of dying, so the loop can save and exit cleanly."""

    def __init__(self, enabled: bool) -> None:
        self.received = False
        self._previous: Any = None
        if enabled:
            try:
                self._previous = signal.signal(signal.SIGTERM, self._handle)
            except ValueError:  # not the main thread (e.g. a test harness): no handler
                self._previous = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _any_rank(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    return bool(all_reduce_max_(t, group=dist.group.WORLD).item() > 0)


def _exit_code(
    spec: LoopSpec, state: TrainState, start: float, sigterm: _SigtermFlag, device: torch.device
) -> int | None:
    if spec.exit_signal_handler and _any_rank(sigterm.received, device):
        return EXIT_SIGNAL
    if spec.exit_duration_in_mins is not None:
        elapsed = torch.tensor([(time.time() - start) / 60.0], dtype=torch.float64, device=device)
        if all_reduce_max_(elapsed, group=dist.group.WORLD).item() > spec.exit_duration_in_mins:
            return EXIT_DURATION
    if spec.exit_interval and state.iteration % spec.exit_interval == 0:
        return EXIT_INTERVAL
    return None


def _log(
    rates: Throughput,
    spec: LoopSpec,
    state: TrainState,
    result: StepResult,
    lr: float,
    seconds_per_iter: float,
    writer: MetricsWriter,
) -> None:
    tokens_per_sec, tflops, mfu = rates.rates(seconds_per_iter)
    rec = TrainRecord(
        iteration=state.iteration,
        consumed_samples=state.consumed_train_samples,
        lm_loss=result.loss,
        lr=lr,
        grad_norm=result.grad_norm,
        loss_scale=result.loss_scale,
        skipped_iter=int(result.skipped),
        tokens_per_sec=tokens_per_sec,
        tflops_per_device=tflops,
        mfu=mfu,
    )
    writer.train(rec)
    if writer.enabled:
        logger.info(
            format_train_line(
                rec,
                train_iters=spec.train_iters,
                elapsed_ms=1000.0 * seconds_per_iter,
                skipped_total=state.skipped_iterations,
            )
        )


def run_evaluation(
    trainer: Trainer, spec: LoopSpec, state: TrainState, writer: MetricsWriter
) -> float | None:
    """Evaluate now (if there is a validation set) and record the result."""
    if not trainer.can_evaluate("valid"):
        return None
    loss = trainer.evaluate("valid")
    state.consumed_valid_samples += spec.eval_samples
    state.last_valid_loss, state.last_eval_iteration = loss, state.iteration
    rec = EvalRecord(iteration=state.iteration, valid_loss=loss, valid_ppl=perplexity(loss))
    writer.evaluation(rec)
    if writer.enabled:
        logger.info(format_eval_line(rec))
    return loss


def run_test_evaluation(trainer: Trainer, state: TrainState, writer: MetricsWriter) -> float | None:
    """Evaluate on the test split (Megatron does it once, at the end of training) and record the result."""
    if not trainer.can_evaluate("test"):
        return None
    loss = trainer.evaluate("test")
    rec = TestRecord(iteration=state.iteration, test_loss=loss, test_ppl=perplexity(loss))
    writer.test(rec)
    if writer.enabled:
        logger.info(format_test_line(rec))
    return loss


def train(
    trainer: Trainer,
    spec: LoopSpec,
    rates: Throughput,
    state: TrainState,
    writer: MetricsWriter,
) -> int:
    """Run iterations until --train-iters or an exit condition; returns the exit code."""
    sigterm = _SigtermFlag(spec.exit_signal_handler)
    start = time.time()
    interval_start, interval_iters = time.perf_counter(), 0
    saved, first_iteration = False, state.iteration
    try:
        while state.iteration < spec.train_iters:
            lr = trainer.apply_lr()
            result = trainer.train_step()
            state.iteration += 1
            state.consumed_train_samples += spec.global_batch
            state.history.append(result.loss)
            state.grad_norms.append(result.grad_norm)
            interval_iters += 1
            if result.skipped:
                state.skipped_iterations += 1
            else:
                trainer.scheduler.step(spec.global_batch)
            if state.iteration % spec.log_interval == 0:
                now = time.perf_counter()
                _log(
                    rates, spec, state, result, lr, (now - interval_start) / interval_iters, writer
                )
                interval_iters = 0
            if spec.eval_interval and state.iteration % spec.eval_interval == 0:
                run_evaluation(trainer, spec, state, writer)
            if spec.log_interval and state.iteration % spec.log_interval == 0:
                interval_start = time.perf_counter()  # evaluation time is not training time
            saved = False
            if (
                trainer.save_enabled
                and spec.save_interval
                and state.iteration % spec.save_interval == 0
            ):
                trainer.save(state)
                saved = True
            # The last iteration finishes the run (exit 0) even when it is also an exit point: a job script that
            # resubmits on 3/4/5 would only relaunch a finished run.
            finished = state.iteration >= spec.train_iters
            code = None if finished else _exit_code(spec, state, start, sigterm, trainer.device)
            if code is not None:
                if trainer.save_enabled and not saved:
                    trainer.save(state)
                logger.info("exiting at iteration %d (exit code %d)", state.iteration, code)
                return code
        if trainer.save_enabled and not saved and state.iteration > first_iteration:
            trainer.save(state)  # Megatron saves the final iteration too
        return EXIT_OK
    finally:
        sigterm.restore()
