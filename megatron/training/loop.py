"""The training loop: steps, LR schedule, logging, evaluation and the exit conditions.

Per iteration: write the scheduled LR into the optimizer, run one step (``step.py``), count the global batch
as consumed, advance the schedule unless the step was skipped, then log (every --log-interval), evaluate
(every --eval-interval; lm-evaluation-harness tasks every --eval-harness-interval, ``eval_harness.py``), save
(every --save-interval, through the checkpoint hook) and check the exits:

* ``--exit-interval N``: stop when iteration % N == 0 -> :data:`~megatron.launch.exit_codes.EXIT_INTERVAL`;
* ``--exit-duration-in-mins M``: stop once the MAX elapsed time over all ranks exceeds M minutes (so every rank
  decides the same) -> ``EXIT_DURATION``;
* SIGTERM (unless --no-exit-signal-handler): stop when any rank got it -> ``EXIT_SIGNAL``;
* SIGINT (Ctrl-C): the same clean stop when any rank got it -> ``EXIT_INTERRUPTED`` (130).

Each of them saves a checkpoint first when a save hook is present. With --async-save the save returns once the
state is copied; each iteration's end commits a background save that every rank finished, and every way out waits
for the one in flight (``checkpointing/async_save.py``). With --hang-timeout-minutes /
--hang-timeout-factor each training step and each save runs under the rank's hang watchdog (``watchdog.py``: stacks
in the log, then ``EXIT_HANG``); evaluation is not watched. A non-finite loss or grad norm
(--check-for-nan-in-loss-and-grad, on by default) stops at once on every rank -> ``EXIT_NON_FINITE``, saving
nothing, so ``latest`` stays at the last good checkpoint; so does a step DeepSpeed skipped in fp32/bf16, or the
third in a row at the lowest fp16 loss scale (``guards.py``). A run whose batches never held a loss token stops with
``ConfigError`` (exit 2) at the end of its first log interval, before any save (``guards.py``). Reaching
--train-iters returns ``EXIT_OK`` (after saving the final iteration, unless --save-interval just did), also when
that iteration is an exit point.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from megatron.config import RunPlan, TridentConfig
from megatron.config.batch_rampup import BatchRampup
from megatron.diagnostics.watchdog import HangWatchdog
from megatron.launch.exit_codes import (
    EXIT_DURATION,
    EXIT_INTERRUPTED,
    EXIT_INTERVAL,
    EXIT_NON_FINITE,
    EXIT_OK,
    EXIT_SIGNAL,
)
from megatron.log import global_rank
from megatron.mpu.mappings import all_reduce_max_
from megatron.planning.flops import Throughput
from megatron.training.curriculum import SeqlenCurriculum
from megatron.training.ds_config import curriculum_of
from megatron.training.eval_harness import HarnessSchedule
from megatron.training.guards import LossTokenWatch, SkipGuard, loss_scale_exhausted
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
from megatron.training.step_log import StepLogger
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
    check_for_nan: bool = True
    """Stop at a non-finite loss or grad norm (--check-for-nan-in-loss-and-grad)."""
    precision: str = "fp32"
    """fp32, bf16 or fp16: whether a step DeepSpeed skipped is a failure (``guards.SkipGuard``)."""
    min_loss_scale: float = 1.0
    """The lowest fp16 loss scale (--min-loss-scale; a static --loss-scale)."""
    tokens_per_iteration: int = 0
    """Tokens consumed per iteration (global batch x --seq-length)."""
    train_tokens: int | None = None
    """--train-tokens: the run also finishes once this many tokens are consumed (Megatron-DeepSpeed)."""
    rampup: BatchRampup | None = None
    """--rampup-batch-size: the global batch of each iteration follows the samples consumed before it."""
    curriculum: SeqlenCurriculum | None = None
    """The DeepSpeed JSON's sequence-length curriculum: iteration i trains on its first seqlen(i) tokens."""

    def seqlen_at(self, iteration: int) -> int | None:
        """The curriculum's sequence length of (1-based) ``iteration``; None without a curriculum."""
        return None if self.curriculum is None else self.curriculum.seqlen(iteration)

    def batch_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after ``consumed_samples`` samples."""
        if self.rampup is None:
            return self.global_batch
        return self.rampup.global_batch_at(consumed_samples)

    def finished(self, state: TrainState) -> bool:
        """--train-iters reached, or --train-tokens (whichever comes first, as in Megatron-DeepSpeed)."""
        return state.iteration >= self.train_iters or (
            self.train_tokens is not None and state.consumed_train_tokens >= self.train_tokens
        )

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
            check_for_nan=t.check_for_nan_in_loss_and_grad,
            precision=plan.precision,
            min_loss_scale=t.loss_scale or t.min_loss_scale,
            tokens_per_iteration=plan.global_batch_size * cfg.model.seq_length,
            train_tokens=t.train_tokens,
            rampup=(
                BatchRampup.parse(t.rampup_batch_size, plan.global_batch_size)
                if t.rampup_batch_size
                else None
            ),
            curriculum=curriculum_of(t, cfg.parallel, seq_length=cfg.model.seq_length),
        )


class _StopSignals:
    """Records SIGTERM (with the exit signal handler) and SIGINT (Ctrl-C) instead of dying, so the loop can save and
    exit cleanly at the end of the iteration. A second Ctrl-C interrupts at once (``KeyboardInterrupt``:
    ``pretrain_gpt.py`` exits 130 with one line)."""

    def __init__(self, sigterm: bool) -> None:
        self.sigterm = False
        self.sigint = False
        self._previous: dict[int, Any] = {}
        for sig in (signal.SIGINT, *((signal.SIGTERM,) if sigterm else ())):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. a test harness): no handler
                pass

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            if self.sigint:
                raise KeyboardInterrupt
            self.sigint = True
            logger.warning("Ctrl-C: stopping after this iteration (press again to interrupt now)")
        else:
            self.sigterm = True

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _any_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Element-wise OR of ``flags`` over every rank (one all-reduce), so every rank decides the same."""
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=device)
    return [bool(v > 0) for v in all_reduce_max_(t, group=dist.group.WORLD).tolist()]


def _exit_code(
    spec: LoopSpec, state: TrainState, start: float, signals: _StopSignals, device: torch.device
) -> int | None:
    sigint, sigterm = _any_rank([signals.sigint, signals.sigterm], device)
    if sigint:
        return EXIT_INTERRUPTED
    if spec.exit_signal_handler and sigterm:
        return EXIT_SIGNAL
    if spec.exit_duration_in_mins is not None:
        elapsed = torch.tensor([(time.time() - start) / 60.0], dtype=torch.float64, device=device)
        if all_reduce_max_(elapsed, group=dist.group.WORLD).item() > spec.exit_duration_in_mins:
            return EXIT_DURATION
    if spec.exit_interval and state.iteration % spec.exit_interval == 0:
        return EXIT_INTERVAL
    return None


def _non_finite(result: StepResult) -> str | None:
    """What is not finite: the loss, or the grad norm of a step DeepSpeed applied (a skipped step's inf norm is
    ``guards.SkipGuard``'s business); None when both are fine."""
    if math.isfinite(result.loss) and (
        result.skipped or result.grad_norm is None or math.isfinite(result.grad_norm)
    ):
        return None
    return f"non-finite lm loss ({result.loss}) or grad norm ({result.grad_norm})"


def _report_non_finite(iteration: int, reason: str | None, last_saved: int | None) -> None:
    if global_rank() != 0:
        return
    kept = (
        f"the newest checkpoint in --save stays the one of iteration {last_saved}"
        if last_saved is not None
        else "no checkpoint was saved by this run"
    )
    logger.error(
        "iteration %d: %s; stopping without saving (%s). Lower --lr or raise --lr-warmup-iters and resume "
        "from a good checkpoint (--no-check-for-nan-in-loss-and-grad turns this check off).",
        iteration,
        reason or "non-finite lm loss or grad norm on another rank",
        kept,
    )


@dataclass
class _Interval:
    """The iterations since the last progress line: their start (evaluation time excluded), count and tokens."""

    start: float
    iters: int = 0
    tokens: int = 0
    """The real tokens trained (--rampup-batch-size, the curriculum), for tokens/s and TFLOPs."""


@dataclass(frozen=True)
class _Iteration:
    """What one iteration of the loop did."""

    result: StepResult
    lr: float
    """The LR the step ran with."""
    batch: int
    """Its global batch (--rampup-batch-size)."""
    seqlen: int | None
    """Its curriculum sequence length (None: whole samples)."""


def _log(
    rates: Throughput,
    spec: LoopSpec,
    state: TrainState,
    it: _Iteration,
    interval: _Interval,
    writer: MetricsWriter,
    step_log: StepLogger | None = None,
) -> float:
    """Record the progress line of ``it`` (JSONL, TensorBoard, console); returns the seconds per iteration."""
    seconds_per_iter = (time.perf_counter() - interval.start) / interval.iters
    tokens_per_iter = (
        interval.tokens / interval.iters
    )  # the real batch and length (ramp-up, curriculum)
    tokens_per_sec, tflops, mfu = rates.rates(seconds_per_iter, tokens_per_iter)
    result = it.result
    rec = TrainRecord(
        iteration=state.iteration,
        consumed_samples=state.consumed_train_samples,
        lm_loss=result.loss,
        lr=it.lr,
        grad_norm=result.grad_norm,
        loss_scale=result.loss_scale,
        skipped_iter=int(result.skipped),
        tokens_per_sec=tokens_per_sec,
        tflops_per_device=tflops,
        mfu=mfu,
        curriculum_seqlen=it.seqlen,
        moe_loss=result.moe_loss,
        expert_load=None if result.expert_load is None else result.expert_load.as_dict(),
    )
    writer.train(rec)
    if writer.enabled:
        logger.info(
            format_train_line(
                rec,
                train_iters=spec.train_iters,
                elapsed_ms=1000.0 * seconds_per_iter,
                skipped_total=state.skipped_iterations,
                num_zeros=None if step_log is None else step_log.num_zeros,
                params_norm=None if step_log is None else step_log.params_norm,
            )
        )
    return seconds_per_iter


def run_evaluation(
    trainer: Trainer, spec: LoopSpec, state: TrainState, writer: MetricsWriter
) -> float | None:
    """Evaluate now (if there is a validation set) and record the result."""
    if not trainer.can_evaluate("valid"):
        return None
    loss = trainer.evaluate("valid")
    state.consumed_valid_samples += spec.eval_samples // spec.global_batch * trainer.global_batch
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


class _Loop:
    """One run of :func:`train`: the trainer, the schedule and what the iterations share (interval, saves)."""

    def __init__(
        self,
        trainer: Trainer,
        spec: LoopSpec,
        rates: Throughput,
        state: TrainState,
        writer: MetricsWriter,
        step_log: StepLogger | None,
        watchdog: HangWatchdog | None,
    ) -> None:
        self.trainer, self.spec, self.rates, self.state = trainer, spec, rates, state
        self.writer, self.step_log = writer, step_log
        self.watchdog = (
            watchdog if watchdog is not None else HangWatchdog(minutes=None, factor=None, rank=0)
        )
        self.signals = _StopSignals(spec.exit_signal_handler)
        self.start = time.time()
        self.interval = _Interval(start=time.perf_counter())
        self.first_iteration = state.iteration
        self.saved = False
        """The current iteration was saved already (by --save-interval)."""
        self.last_saved: int | None = state.iteration if trainer.checkpointer is not None else None
        self.skips = SkipGuard(spec.precision, spec.min_loss_scale)
        self.loss_tokens = LossTokenWatch(state.iteration, spec.log_interval)
        self.harness: HarnessSchedule | None = None
        """--eval-harness-tasks (``eval_harness.py``), set by :func:`train`."""

    def step(self) -> _Iteration:
        """Batch size, sequence length and LR of the next iteration, one optimizer step, the counters, the LR
        schedule (not advanced by a skipped step)."""
        trainer, spec, state = self.trainer, self.spec, self.state
        batch = spec.batch_at(state.consumed_train_samples)
        trainer.set_global_batch(batch)
        seqlen = spec.seqlen_at(state.iteration + 1)
        trainer.set_seqlen(seqlen)
        lr = trainer.apply_lr()
        timed = self.step_log.timed_step() if self.step_log is not None else nullcontext()
        with self.watchdog.watch("train step", state.iteration + 1), timed:
            result = trainer.train_step()
        state.iteration += 1
        state.consumed_train_samples += batch
        # tokens per sample: --seq-length, or the curriculum's length (Megatron-DeepSpeed counts those)
        tokens = (seqlen or spec.tokens_per_iteration // spec.global_batch) * batch
        state.consumed_train_tokens += tokens
        self.interval.tokens += tokens
        state.history.append(result.loss)
        state.grad_norms.append(result.grad_norm)
        if result.moe_loss is not None:
            state.moe_history.append(result.moe_loss)
        self.interval.iters += 1
        if result.skipped:
            state.skipped_iterations += 1
        else:
            trainer.scheduler.step(batch, tokens=state.consumed_train_tokens)
        return _Iteration(result=result, lr=lr, batch=batch, seqlen=seqlen)

    def log(self, it: _Iteration) -> None:
        """The optional statistics (every iteration) and the progress line (every --log-interval)."""
        state, step_log = self.state, self.step_log
        log_now = state.iteration % self.spec.log_interval == 0
        if step_log is not None:
            step_log.after_step(state, it.result, it.lr, batch_size=it.batch, log_now=log_now)
        if log_now:
            seconds = _log(self.rates, self.spec, state, it, self.interval, self.writer, step_log)
            if step_log is not None:
                step_log.at_log_interval(state.iteration, seconds)
            self.interval.iters, self.interval.tokens = 0, 0

    def failed(self, it: _Iteration) -> bool:
        """A non-finite loss or grad norm, or a skipped step that is a failure, on any rank
        (--check-for-nan-in-loss-and-grad), reported; and the loss-token check (``guards.LossTokenWatch``). One
        all-reduce for both, so every rank decides the same.

        Raises:
            ConfigError: no global batch of this run held a loss token (bad training data).
        """
        spec, state = self.spec, self.state
        reason = None
        if spec.check_for_nan:
            reason = _non_finite(it.result) or self.skips.failure(it.result)
        tokens = self.trainer.take_loss_tokens()
        has_tokens = tokens is None or tokens > 0
        bad, any_tokens = _any_rank([reason is not None, has_tokens], self.trainer.device)
        if bad:
            _report_non_finite(state.iteration, reason, self.last_saved)
            return True
        self.loss_tokens.record(state.iteration, any_tokens)
        decide = (
            state.iteration - self.first_iteration >= spec.log_interval
            or spec.finished(state)
            or bool(spec.save_interval and state.iteration % spec.save_interval == 0)
        )
        self.loss_tokens.check(state.iteration, decide_now=decide)
        return False

    def evaluate_and_save(self) -> None:
        """Commit a finished background save (--async-save), evaluate every --eval-interval, run the harness every
        --eval-harness-interval, save every --save-interval."""
        spec, state = self.spec, self.state
        self.trainer.finalize_save(blocking=False)
        if spec.eval_interval and state.iteration % spec.eval_interval == 0:
            run_evaluation(self.trainer, spec, state, self.writer)
        if self.harness is not None and self.harness.due(state.iteration):
            start = time.perf_counter()
            self.harness.run(state.iteration, self.writer)
            # evaluation time is not training time
            self.interval.start += time.perf_counter() - start
        if spec.log_interval and state.iteration % spec.log_interval == 0:
            self.interval.start = time.perf_counter()  # evaluation time is not training time
        self.saved = False
        if spec.save_interval and state.iteration % spec.save_interval == 0:
            self.save_once()

    def save_once(self) -> None:
        """Save the current iteration (when --save is given) unless it was saved already."""
        if not self.trainer.save_enabled or self.saved:
            return
        with self.watchdog.watch("checkpoint save", self.state.iteration):
            self.trainer.save(self.state)
        self.saved, self.last_saved = True, self.state.iteration

    def exit_code(self) -> int | None:
        """The exit condition met now, if any. The last iteration finishes the run (exit 0) even when it is also
        an exit point: a job script that resubmits on 3/4/5 would only relaunch a finished run."""
        if self.spec.finished(self.state):
            return None
        return _exit_code(self.spec, self.state, self.start, self.signals, self.trainer.device)

    def stop(self, code: int) -> int:
        """Save (unless just saved) and return ``code``."""
        self.save_once()
        logger.info("exiting at iteration %d (exit code %d)", self.state.iteration, code)
        return code

    def wait_for_saves(self) -> None:
        """Before the run exits: wait for a background save (--async-save) and commit it."""
        with self.watchdog.watch("checkpoint save", self.state.iteration):
            self.trainer.finalize_save(blocking=True)

    def finish(self) -> int:
        """--train-iters (or --train-tokens) reached: save the final iteration too, as Megatron does."""
        if self.state.iteration > self.first_iteration:
            self.save_once()
        return EXIT_OK


def train(
    trainer: Trainer,
    spec: LoopSpec,
    rates: Throughput,
    state: TrainState,
    writer: MetricsWriter,
    step_log: StepLogger | None = None,
    watchdog: HangWatchdog | None = None,
    harness: HarnessSchedule | None = None,
) -> int:
    """Run iterations until --train-iters (or --train-tokens) or an exit condition; returns the exit code.

    ``step_log``: the optional statistics and timers (``step_log.py``), called on every rank every iteration.
    ``watchdog``: this rank's hang watchdog (``watchdog.py``), armed around each step and save; default: none.
    ``harness``: --eval-harness-tasks and its interval (``eval_harness.py``); default: none."""
    loop = _Loop(trainer, spec, rates, state, writer, step_log, watchdog)
    loop.harness = harness
    try:
        code = _iterate(loop)
        loop.wait_for_saves()  # every way out that all ranks take together (exceptions excepted)
        return code
    finally:
        loop.signals.restore()


def _iterate(loop: _Loop) -> int:
    """The iterations of :func:`train` until it finishes or an exit condition; returns the exit code."""
    spec, state = loop.spec, loop.state
    while not spec.finished(state):
        try:
            it = loop.step()
        except Exception as err:  # noqa: BLE001 - only DeepSpeed's fp16 give-up is handled, the rest re-raised
            reason = loss_scale_exhausted(err) if spec.check_for_nan else None
            if reason is None:
                raise
            _report_non_finite(state.iteration + 1, reason, loop.last_saved)
            return EXIT_NON_FINITE
        loop.log(it)
        if loop.failed(it):
            return EXIT_NON_FINITE
        loop.evaluate_and_save()
        code = loop.exit_code()
        if code is not None:
            return loop.stop(code)
    return loop.finish()
