"""``pretrain(cfg)``: the whole run as a library function (``pretrain_gpt.py`` is a thin CLI over it).

    from megatron.config import parse_args
    from megatron.training import pretrain
    result = pretrain(parse_args([...]))        # every rank of the job calls it
    result.exit_code, result.iteration, result.losses

Stages: (1) :func:`~megatron.training.preflight.preflight` (no process group yet): every user-input check, and the
run plan. (2) ``deepspeed.init_distributed`` + ``initialize_model_parallel`` (every group with
--distributed-timeout-minutes) + the --save lock (``checkpointing/save_lock.py``, held by global rank 0 until
``pretrain`` returns or raises) + seeds. (3) model, optimizer, engine,
LR schedule, checkpoint load, data iterators: a :class:`~megatron.training.trainer.Trainer`. (4) the loop
(``loop.py``; skipped with --skip-train), the final evaluations (validation unless the last iteration just did it,
then the test split, --eval-iters batches each, as Megatron does at the end of training), and teardown of the
model-parallel state (the default process group stays, as other code in the process may share it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from megatron import mpu
from megatron.checkpointing.checksums import PendingVerification
from megatron.checkpointing.engine import DeepSpeedCheckpointer
from megatron.checkpointing.lora import LORA_BASE_KEY, load_lora_base
from megatron.checkpointing.meta import tokenizer_record
from megatron.checkpointing.save_lock import SaveLock, acquire_save_lock
from megatron.config import TridentConfig
from megatron.diagnostics.watchdog import HangWatchdog
from megatron.launch.elastic import restart_report
from megatron.launch.exit_codes import EXIT_OK, ConfigError
from megatron.launch.peers import (
    Peer,
    PeerLostError,
    peer_loss_reason,
    peer_lost_message,
    this_process,
)
from megatron.launch.supervisor import last_logged_iteration
from megatron.log import global_rank
from megatron.mpu.expert_parallel import expert_parallel_rank
from megatron.mpu.mappings import all_gather_object
from megatron.planning.flops import Throughput, detect_peak_tflops, flops_per_token
from megatron.planning.memory_plan import MemoryPlan, format_plan, plan_memory
from megatron.planning.planner_config import PlannerConfig
from megatron.training import initialize
from megatron.training.checkpoint_hooks import CheckpointHooks
from megatron.training.data_iterators import build_iterators
from megatron.training.ds_config import log_zero_upgrade
from megatron.training.eval_harness import HarnessFactory, TrainingModel, harness_schedule
from megatron.training.initialize import Distributed
from megatron.training.loop import LoopSpec, run_evaluation, run_test_evaluation, train
from megatron.training.lr_scheduler import build_lr_scheduler
from megatron.training.model_setup import build_engine
from megatron.training.preflight import Preflight, preflight
from megatron.training.state import TrainState
from megatron.training.step_log import build_run_logging, timers_of
from megatron.training.trainer import Checkpointing, Trainer

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """Outcome of :func:`pretrain` on this rank."""

    exit_code: int
    iteration: int
    consumed_train_samples: int
    consumed_train_tokens: int
    losses: list[float] = field(default_factory=list)
    """lm loss of each iteration run (global-batch mean, same on every rank)."""
    grad_norms: list[float | None] = field(default_factory=list)
    """Global grad norm of each iteration (None where DeepSpeed computed none: clipping off)."""
    moe_losses: list[float] = field(default_factory=list)
    """MoE loss term of each iteration (--moe-loss-coeff x summed aux losses; empty for a dense model)."""
    valid_loss: float | None = None
    """The final evaluation's loss (None without a validation set or with --eval-iters 0)."""
    test_loss: float | None = None
    """The test-split loss at the end (None without a test split or with --eval-iters 0)."""


def _after_first_item(it: Iterator[Any], action: Callable[[], None]) -> Iterator[Any]:
    """Yield ``it`` unchanged, calling ``action`` once the first item has been produced.

    The loaded RNG states are restored there: the DataLoader draws its base seed from torch's default generator
    when its iterator is created (lazily, at the first batch), which the uninterrupted run did before any dropout.
    """
    for i, item in enumerate(it):
        if i == 0:
            action()
        yield item


def pretrain(
    cfg: TridentConfig,
    *,
    checkpoint_hooks: CheckpointHooks | None = None,
    checked: Preflight | None = None,
    eval_harness: HarnessFactory | None = None,
) -> TrainResult:
    """Train ``cfg`` on this rank (every rank of the job calls it); see the module docstring.

    Args:
        cfg: the run's config (``megatron.config.parse_args``).
        checkpoint_hooks: save/load implementation (``checkpoint_hooks.CheckpointHooks``); default: DeepSpeed
            checkpoints (``megatron.checkpointing.engine.DeepSpeedCheckpointer``) when --save/--load.
        checked: the result of ``preflight`` for ``cfg`` when the caller already ran it (the CLI does, to
            report input errors in one line); None runs it here.
        eval_harness: builds the --eval-harness-tasks evaluation over the training model (``eval_harness.py``;
            ``pretrain_gpt.py`` passes ``megatron.evaluation``'s); None: --eval-harness-tasks is not run.

    Raises:
        ValueError / FileNotFoundError: from ``preflight``, before any process group is created.
        PeerLostError: another rank died and a collective failed (one line naming it where knowable).
    """
    pre = checked if checked is not None else preflight(cfg)
    planner = PlannerConfig.from_configs(pre.cfg.model, pre.cfg.parallel, pre.cfg.training)
    memory = plan_memory(planner, pre.plan, pre.ds_config)
    worst = memory.worst
    lock: SaveLock | None = None
    peers: list[Peer] = []
    try:
        run = initialize.init_distributed(
            pre.cfg.parallel, planned_bytes=worst.total + worst.offloaded_bytes
        )  # the plan decides the CPU allocator setting (cpu_allocator: auto)
        peers = all_gather_object(this_process(global_rank()), group=dist.group.WORLD)
        lock = _hold_save_lock(pre.cfg.checkpoint.save)
        return _run(pre, memory, run, checkpoint_hooks, eval_harness)
    except (
        RuntimeError
    ) as err:  # a collective failed because another rank died: one line (``peers.py``)
        reason = peer_loss_reason(err)
        if reason is None:
            raise
        raise PeerLostError(peer_lost_message(global_rank(), reason, peers)) from None
    finally:
        if lock is not None:
            lock.release()
        mpu.destroy_model_parallel()


def _hold_save_lock(save: str | None) -> SaveLock | None:
    """Global rank 0 locks --save for the run (``save_lock.py``); every rank raises the same ``ConfigError`` when it
    cannot, before any checkpoint is read or written."""
    if not save:
        return None
    lock, error = None, None
    if global_rank() == 0:
        try:
            lock = acquire_save_lock(save)
        except (ValueError, OSError) as err:
            error = str(err)
    errors = [e for e in all_gather_object(error, group=dist.group.WORLD) if e]
    if errors:
        if lock is not None:
            lock.release()
        raise ConfigError(errors[0])
    return lock


def join_checksums(pending: PendingVerification | None) -> None:
    """Wait for this rank's checkpoint digests (started in preflight); every rank raises the same ``ConfigError``
    when any rank's files do not match, before anything is loaded."""
    error = None
    if pending is not None:
        try:
            pending.result()
        except (OSError, ValueError) as err:
            error = str(err)
    errors = [e for e in all_gather_object(error, group=dist.group.WORLD) if e]
    if errors:
        raise ConfigError(errors[0])


def build_checkpointer(
    pre: Preflight, run: Distributed, *, record_checksums: bool = True
) -> DeepSpeedCheckpointer:
    """The run's checkpointer: its checkpoint flags, plan, model, tokenizer record and parallel degrees
    (``record_checksums=False``: DeepSpeed's own ``torch.save``, for measuring what the checksums cost)."""
    cfg = pre.cfg
    return DeepSpeedCheckpointer(
        cfg.checkpoint,
        pre.plan,
        model=cfg.model,
        tokenizer=tokenizer_record(cfg.data, pre.tokenizer_fingerprint),
        tensor_model_parallel_rank=run.state.get_tensor_model_parallel_rank(),
        expert_parallel=(
            cfg.parallel.moe_expert_parallel_size,
            expert_parallel_rank(
                run.state.rank,
                world_size=pre.plan.world_size,
                tensor_model_parallel_size=pre.plan.tensor_model_parallel_size,
                pipeline_model_parallel_size=pre.plan.pipeline_model_parallel_size,
                expert_parallel_size=cfg.parallel.moe_expert_parallel_size,
                expert_tensor_parallel=cfg.parallel.enable_expert_tensor_parallelism,
            ),
        ),
        record_checksums=record_checksums,
        ds_sequence_parallel_size=cfg.parallel.ds_sequence_parallel_size,
    )


def load_base(
    pre: Preflight, run: Distributed, module: torch.nn.Module, hooks: CheckpointHooks | None
) -> None:
    """LoRA: the frozen base weights from --pretrained-checkpoint (before the adapters of --load), recorded in the
    run's checkpoints (``megatron/checkpointing/lora.py``)."""
    cfg, state = pre.cfg, run.state
    record = load_lora_base(
        module,
        cfg.checkpoint.pretrained_checkpoint or "",
        replace(cfg.model, vocab_size=pre.plan.true_vocab_size),
        tp=(state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()),
        pp=(
            state.get_pipeline_model_parallel_world_size(),
            state.get_pipeline_model_parallel_rank(),
        ),
        verify_checksums=cfg.checkpoint.verify_checkpoint_checksums,
    )
    if isinstance(hooks, DeepSpeedCheckpointer):
        hooks.extra_meta[LORA_BASE_KEY] = record
    if global_rank() == 0:
        logger.info("LoRA: base weights from %s (tag %s)", record["dir"], record["tag"])


def build_trainer(
    pre: Preflight, run: Distributed, hooks: CheckpointHooks | None, state: TrainState
) -> Trainer:
    """Engine, schedule, checkpoint load (into ``state``) and data iterators of the run."""
    cfg, plan = pre.cfg, pre.plan
    start = time.perf_counter()
    bundle = build_engine(
        cfg.model,
        cfg.training,
        cfg.parallel,
        plan,
        pre.ds_config,
        run,
        loss_reduction="sum" if cfg.data.sft else "mean",  # --sft: global per-token weights
    )
    logger.info(
        "rank %d: engine ready in %.1f s (%s, ZeRO-%d, global batch %d, micro %d, gas %d, vocab %d -> %d)",
        global_rank(),
        time.perf_counter() - start,
        type(bundle.engine).__name__,
        plan.zero_stage,
        plan.global_batch_size,
        plan.micro_batch_size,
        plan.gradient_accumulation_steps,
        plan.true_vocab_size,
        plan.padded_vocab_size,
    )
    scheduler = build_lr_scheduler(
        cfg.training,
        plan.global_batch_size,
        bundle.client_optimizer,
        train_samples=plan.train_samples,
    )
    if hooks is None and (cfg.checkpoint.save or cfg.checkpoint.load):
        hooks = build_checkpointer(pre, run)
    if cfg.model.lora.enabled:
        load_base(pre, run, bundle.engine.module, hooks)
    if hooks is not None and cfg.checkpoint.load:
        join_checksums(pre.checksums)
        hooks.load(bundle.engine, scheduler, state)
    if state.iteration >= plan.train_iters and not cfg.training.skip_train and global_rank() == 0:
        logger.info(
            "the checkpoint is at iteration %d, --train-iters is %d: nothing left to train "
            "(raise --train-iters to continue)",
            state.iteration,
            plan.train_iters,
        )
    iterators = build_iterators(
        cfg,
        plan,
        pre.tokenizer,
        run,
        consumed_train_samples=state.consumed_train_samples,
        consumed_valid_samples=state.consumed_valid_samples,
    )
    if hooks is not None and cfg.checkpoint.load:
        iterators.train = _after_first_item(iterators.train, hooks.restore_rng)
    return Trainer(
        bundle=bundle,
        scheduler=scheduler,
        iterators=iterators,
        plan=plan,
        run=run,
        eval_iters=cfg.training.eval_iters,
        checkpointing=Checkpointing(hooks=hooks, save=bool(cfg.checkpoint.save)),
        timers=timers_of(cfg.logging),
    )


def _run(
    pre: Preflight,
    memory: MemoryPlan,
    run: Distributed,
    hooks: CheckpointHooks | None,
    eval_harness: HarnessFactory | None = None,
) -> TrainResult:
    cfg, plan = pre.cfg, pre.plan
    initialize.set_seeds(cfg.training.seed, run.state, device_type=run.device.type)
    log_zero_upgrade(cfg.training, plan)
    if global_rank() == 0:  # the planner's numbers (tools/plan_memory.py) as the run's first lines
        for line in format_plan(memory, plan):
            logger.info("%s", line)
    state = TrainState()
    previous = last_logged_iteration(cfg.logging.metrics_file)  # before the writer truncates it
    trainer = build_trainer(pre, run, hooks, state)
    report = restart_report(state.iteration, previous, run.previous_failures)
    if report and global_rank() == 0:
        logger.warning("%s", report)
    spec = LoopSpec.of(cfg, plan)
    harness = harness_schedule(
        eval_harness,
        TrainingModel(trainer.engine.module, run.device, run.state, pre.tokenizer, cfg.training),
    )
    rates = Throughput(
        tokens_per_iteration=plan.global_batch_size * cfg.model.seq_length,
        flops_per_token=flops_per_token(cfg.model, plan.padded_vocab_size),
        world_size=plan.world_size,
        peak_tflops=detect_peak_tflops(cfg.training.peak_tflops, run.device.type),
    )
    writer, step_log = build_run_logging(cfg, plan, trainer, resume_from=state.iteration)
    test_loss = None
    watchdog = HangWatchdog(
        minutes=cfg.training.hang_timeout_minutes,
        factor=cfg.training.hang_timeout_factor,
        rank=global_rank(),
    )
    try:
        code = (
            EXIT_OK
            if cfg.training.skip_train
            else train(trainer, spec, rates, state, writer, step_log, watchdog, harness)
        )
        watchdog.close()  # the final evaluations are not watched
        if code == EXIT_OK and state.last_eval_iteration != state.iteration:
            run_evaluation(trainer, spec, state, writer)
        if code == EXIT_OK:
            test_loss = run_test_evaluation(trainer, state, writer)
    finally:
        watchdog.close()
        writer.close()
    return TrainResult(
        exit_code=code,
        iteration=state.iteration,
        consumed_train_samples=state.consumed_train_samples,
        consumed_train_tokens=state.consumed_train_tokens,
        losses=list(state.history),
        grad_norms=list(state.grad_norms),
        moe_losses=list(state.moe_history),
        valid_loss=state.last_valid_loss,
        test_loss=test_loss,
    )
