"""``pretrain(cfg)``: the whole run as a library function (``pretrain_gpt.py`` is a thin CLI over it).

    from megatron.config import parse_args
    from megatron.training import pretrain
    result = pretrain(parse_args([...]))        # every rank of the job calls it
    result.exit_code, result.iteration, result.losses

Stages: (1) :func:`preflight` (no process group yet): rendezvous env, ``validate()``, data/tokenizer flags,
the DeepSpeed config with its conflict check; every rank raises the same ``ValueError``/``FileNotFoundError``.
(2) ``deepspeed.init_distributed`` + ``initialize_model_parallel`` + seeds. (3) tokenizer, model, optimizer,
engine, LR schedule, data iterators. (4) the loop (``loop.py``; skipped with --skip-train), the final evaluations
(validation unless the last iteration just did it, then the test split, --eval-iters batches each, as Megatron
does at the end of training), and teardown of the model-parallel state (the default process group stays, as other
code in the process may share it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from megatron import mpu
from megatron.checkpointing.engine_checkpoint import (
    DeepSpeedCheckpointer,
    check_checkpoint_dirs,
    resolve_universal_flag,
)
from megatron.config import TridentConfig, validate
from megatron.log import global_rank
from megatron.model import padded_vocab_size
from megatron.tokenizer import encoding_fingerprint
from megatron.training import initialize
from megatron.training.checkpoint_hooks import CheckpointHooks
from megatron.training.data_iterators import (
    build_iterators,
    build_run_tokenizer,
    check_data_flags,
    check_data_vocab,
)
from megatron.training.ds_config import (
    build_ds_config,
    effective_zero_stage,
    global_batch_size,
    gradient_accumulation_steps,
    log_zero_upgrade,
)
from megatron.training.exit_codes import EXIT_OK
from megatron.training.flops import detect_peak_tflops, flops_per_token
from megatron.training.loop import LoopSpec, TrainState, run_evaluation, run_test_evaluation, train
from megatron.training.lr_scheduler import build_lr_scheduler, train_samples_and_iters
from megatron.training.metrics import MetricsWriter
from megatron.training.model_setup import build_engine, optimizers_for_lr
from megatron.training.step import (
    eval_step_engine,
    eval_step_pipe,
    train_step_engine,
    train_step_pipe,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preflight:
    """What the checks before any process group produce."""

    cfg: TridentConfig
    """The run's config as preflight resolved it (e.g. a stale --universal-checkpoint dropped)."""
    world_size: int
    device_type: str
    ds_config: dict[str, Any]
    tokenizer: Any
    """The run's tokenizer (its files are read here, so a missing one fails before any group exists)."""
    tokenizer_fingerprint: str | None = None
    """``megatron.tokenizer.encoding_fingerprint`` of ``tokenizer`` (recorded in checkpoints, checked on load)."""


@dataclass
class TrainResult:
    """Outcome of :func:`pretrain` on this rank."""

    exit_code: int
    iteration: int
    consumed_train_samples: int
    losses: list[float] = field(default_factory=list)
    """lm loss of each iteration run (global-batch mean, same on every rank)."""
    grad_norms: list[float | None] = field(default_factory=list)
    """Global grad norm of each iteration (None where DeepSpeed computed none: clipping off)."""
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


def preflight(cfg: TridentConfig, checkpoint_hooks: CheckpointHooks | None = None) -> Preflight:
    """Every user-input check, before any process group exists (identical on every rank).

    Raises:
        ValueError: a bad flag combination or a --deepspeed_config that contradicts a flag.
        FileNotFoundError: a named file (DeepSpeed JSON, tokenizer files, data) does not exist.
    """
    initialize.ensure_rendezvous_env(cfg.parallel.local_rank)
    world_size = initialize.world_size_from_env()
    dev = initialize.device_type(cfg)
    validate(cfg, world_size=world_size, device_type=dev)
    check_data_flags(cfg)
    gbs = global_batch_size(cfg, world_size)
    train_samples_and_iters(cfg.training, gbs)
    build_lr_scheduler(
        cfg.training, gbs, None
    )  # the schedule's own checks (warmup vs decay length)
    check_output_paths(cfg)
    cfg = resolve_universal_flag(cfg, world_size)
    ds_config = build_ds_config(cfg, world_size)
    tokenizer = build_run_tokenizer(cfg)
    check_data_vocab(cfg, tokenizer.vocab_size)
    fingerprint = encoding_fingerprint(tokenizer)
    check_checkpoint_dirs(
        cfg,
        true_vocab=tokenizer.vocab_size,
        world_size=world_size,
        tokenizer_fingerprint=fingerprint,
        zero_stage=effective_zero_stage(cfg),
    )
    return Preflight(
        cfg=cfg,
        world_size=world_size,
        device_type=dev,
        ds_config=ds_config,
        tokenizer=tokenizer,
        tokenizer_fingerprint=fingerprint,
    )


def check_output_paths(cfg: TridentConfig) -> None:
    """--metrics-file must be a file path and --tensorboard-dir a directory path (ValueError naming the flag)."""
    from pathlib import Path

    log = cfg.logging
    if log.metrics_file and Path(log.metrics_file).is_dir():
        raise ValueError(f"--metrics-file {log.metrics_file} is a directory; give a file path.")
    if log.tensorboard_dir and Path(log.tensorboard_dir).is_file():
        raise ValueError(
            f"--tensorboard-dir {log.tensorboard_dir} is a file; give a directory path."
        )


def pretrain(
    cfg: TridentConfig,
    *,
    checkpoint_hooks: CheckpointHooks | None = None,
    checked: Preflight | None = None,
) -> TrainResult:
    """Train ``cfg`` on this rank (every rank of the job calls it); see the module docstring.

    Args:
        cfg: the run's config (``megatron.config.parse_args``).
        checkpoint_hooks: save/load implementation (``checkpoint_hooks.CheckpointHooks``); default: DeepSpeed
            checkpoints (``megatron.checkpointing.engine_checkpoint.DeepSpeedCheckpointer``) when --save/--load.
        checked: the result of :func:`preflight` for ``cfg`` when the caller already ran it (the CLI does, to
            report input errors in one line); None runs it here.

    Raises:
        ValueError / FileNotFoundError: from :func:`preflight`, before any process group is created.
    """
    pre = checked if checked is not None else preflight(cfg, checkpoint_hooks)
    cfg = pre.cfg
    device = initialize.init_distributed(cfg)
    try:
        return _run(cfg, pre, device, checkpoint_hooks)
    finally:
        mpu.destroy_model_parallel()


def _run(
    cfg: TridentConfig, pre: Preflight, device: Any, hooks: CheckpointHooks | None
) -> TrainResult:
    initialize.set_seeds(cfg.training.seed)
    log_zero_upgrade(cfg)
    world = pre.world_size
    gbs = global_batch_size(cfg, world)
    gas = gradient_accumulation_steps(cfg, world)
    _, train_iters = train_samples_and_iters(cfg.training, gbs)
    tokenizer = pre.tokenizer
    start = time.perf_counter()
    bundle = build_engine(
        cfg, pre.ds_config, true_vocab=tokenizer.vocab_size, device=device, world_size=world
    )
    engine = bundle.engine
    padded_vocab = padded_vocab_size(
        tokenizer.vocab_size,
        cfg.model.make_vocab_size_divisible_by,
        cfg.parallel.tensor_model_parallel_size,
    )
    logger.info(
        "rank %d: engine ready in %.1f s (%s, ZeRO-%d, global batch %d, micro %d, gas %d, vocab %d -> %d)",
        global_rank(),
        time.perf_counter() - start,
        type(engine).__name__,
        pre.ds_config["zero_optimization"]["stage"],
        gbs,
        cfg.training.micro_batch_size,
        gas,
        tokenizer.vocab_size,
        padded_vocab,
    )
    scheduler = build_lr_scheduler(cfg.training, gbs, bundle.client_optimizer)
    if hooks is None and (cfg.checkpoint.save or cfg.checkpoint.load):
        hooks = DeepSpeedCheckpointer(
            cfg,
            true_vocab=tokenizer.vocab_size,
            padded_vocab=padded_vocab,
            world_size=world,
            tokenizer_fingerprint=pre.tokenizer_fingerprint,
        )
    state = TrainState()
    if hooks is not None and cfg.checkpoint.load:
        hooks.load(engine, scheduler, state)
    if state.iteration >= train_iters and not cfg.training.skip_train and global_rank() == 0:
        logger.info(
            "the checkpoint is at iteration %d, --train-iters is %d: nothing left to train "
            "(raise --train-iters to continue)",
            state.iteration,
            train_iters,
        )
    its = build_iterators(
        cfg,
        tokenizer,
        world_size=world,
        train_iters=train_iters,
        device=device,
        consumed_train_samples=state.consumed_train_samples,
        consumed_valid_samples=state.consumed_valid_samples,
        for_pipe=bundle.is_pipe,
    )
    if hooks is not None and cfg.checkpoint.load:
        its.train = _after_first_item(its.train, hooks.restore_rng)
    if bundle.is_pipe:
        step_fn = lambda: train_step_pipe(engine, its.train)
    else:
        step_fn = lambda: train_step_engine(engine, its.train, gas)
    evaluate = _evaluator(engine, its.valid, gas, cfg.training.eval_iters, bundle.is_pipe)
    evaluate_test = _evaluator(engine, its.test, gas, cfg.training.eval_iters, bundle.is_pipe)
    spec = LoopSpec(
        train_step=step_fn,
        evaluate=evaluate,
        scheduler=scheduler,
        optimizers=optimizers_for_lr(bundle),
        train_iters=train_iters,
        global_batch=gbs,
        seq_length=cfg.model.seq_length,
        world_size=world,
        flops_per_token=flops_per_token(cfg.model, padded_vocab),
        peak_tflops=detect_peak_tflops(cfg.training.peak_tflops),
        log_interval=cfg.logging.log_interval,
        eval_interval=cfg.training.eval_interval,
        eval_samples=cfg.training.eval_iters * gbs,
        exit_interval=cfg.training.exit_interval,
        exit_duration_in_mins=cfg.training.exit_duration_in_mins,
        exit_signal_handler=cfg.training.exit_signal_handler,
        device=device,
        save=(lambda st: hooks.save(engine, scheduler, st))
        if hooks and cfg.checkpoint.save
        else None,
        save_interval=cfg.checkpoint.save_interval,
    )
    writer = MetricsWriter(
        cfg.logging.metrics_file,
        cfg.logging.tensorboard_dir,
        enabled=global_rank() == 0,
        resume_from=state.iteration,
    )
    test_loss = None
    try:
        code = EXIT_OK if cfg.training.skip_train else train(spec, state, writer)
        if (
            code == EXIT_OK
            and evaluate is not None
            and state.last_eval_iteration != state.iteration
        ):
            run_evaluation(spec, state, writer)
        if code == EXIT_OK and evaluate_test is not None:
            test_loss = run_test_evaluation(evaluate_test, state, writer)
    finally:
        writer.close()
    return TrainResult(
        exit_code=code,
        iteration=state.iteration,
        consumed_train_samples=state.consumed_train_samples,
        losses=list(state.history),
        grad_norms=list(state.grad_norms),
        valid_loss=state.last_valid_loss,
        test_loss=test_loss,
    )


def _evaluator(
    engine: Any, batches: Iterator[Any] | None, gas: int, eval_iters: int, is_pipe: bool
) -> Callable[[], float] | None:
    """Mean loss over ``eval_iters`` global batches of ``batches`` (None without data or with --eval-iters 0)."""
    if batches is None or eval_iters <= 0:
        return None
    if is_pipe:
        one = lambda: eval_step_pipe(engine, batches)
    else:
        one = lambda: eval_step_engine(engine, batches, gas)
    return lambda: sum(one() for _ in range(eval_iters)) / eval_iters
