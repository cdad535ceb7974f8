"""``preflight(cfg)``: every check of user input, before any process group exists, and the run plan it yields.

Identical on every rank, so all ranks fail together with the same one-line error (``ValueError`` or
``FileNotFoundError``): the installed DeepSpeed, the rendezvous environment, ``TRIDENT_CPU_ALLOCATOR``, ``validate()``,
data and tokenizer flags, the LR schedule, output paths, the tokenizer's files, the DeepSpeed config with its conflict
check, the token ids in the data, and the checkpoint rules (``megatron.checkpointing.rules``). The result carries the
:class:`RunPlan` every later stage uses.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.checkpointing.checksums import PendingVerification
from megatron.checkpointing.lora import check_lora_start
from megatron.checkpointing.pointers import resolve_universal_flag
from megatron.checkpointing.rules import check_checkpoint_dirs
from megatron.config import LoggingConfig, RunPlan, TridentConfig, validate
from megatron.deepspeed_internals import check_deepspeed_version
from megatron.fused_kernels.arch import bf16_refusal
from megatron.launch.cpu_allocator import allocator_choice
from megatron.launch.rendezvous import ensure_rendezvous_env, world_size_from_env
from megatron.planning.memory_plan import MemoryPlan, plan_memory
from megatron.planning.planner_config import PlannerConfig
from megatron.tokenizer import encoding_fingerprint
from megatron.training import initialize
from megatron.training.data_iterators import build_run_tokenizer, check_data_flags, check_data_vocab
from megatron.training.ds_config import build_ds_config
from megatron.training.lr_scheduler import check_lr_schedule


@dataclass(frozen=True)
class Preflight:
    """What the checks before any process group produce."""

    cfg: TridentConfig
    """The run's config as preflight resolved it (e.g. a stale --universal-checkpoint dropped)."""
    plan: RunPlan
    """Every derived value of the run (world, DP, batch sizes, iterations, ZeRO stage, vocabulary, ...)."""
    ds_config: dict[str, Any]
    tokenizer: Any
    """The run's tokenizer (its files are read here, so a missing one fails before any group exists)."""
    tokenizer_fingerprint: str | None = None
    """``megatron.tokenizer.encoding_fingerprint`` of ``tokenizer`` (recorded in checkpoints, checked on load)."""
    checksums: PendingVerification | None = None
    """The digests of the checkpoint files this rank will load, computed while the engine is built; ``pretrain``
    joins them (every rank together) before the load."""


def check_output_paths(log: LoggingConfig) -> None:
    """--metrics-file must be a file path and --tensorboard-dir a directory path (ValueError naming the flag)."""
    if log.metrics_file and Path(log.metrics_file).is_dir():
        raise ValueError(f"--metrics-file {log.metrics_file} is a directory; give a file path.")
    if log.tensorboard_dir and Path(log.tensorboard_dir).is_file():
        raise ValueError(
            f"--tensorboard-dir {log.tensorboard_dir} is a file; give a directory path."
        )


def check_eval_harness_include_path(path: str | None) -> None:
    """--eval-harness-include-path must be a directory (FileNotFoundError naming the flag)."""
    if path and not Path(path).is_dir():
        raise FileNotFoundError(
            f"--eval-harness-include-path {path}: no such directory (it holds lm-evaluation-harness task YAMLs)."
        )


def check_bf16_gpu() -> None:
    """``--bf16`` on a GPU before Ampere (a V100: fp16 only) is one ``ValueError`` line."""
    import torch

    message = bf16_refusal(torch.cuda.get_device_capability(), torch.cuda.get_device_name())
    if message is not None:
        raise ValueError(f"--bf16: {message}")


def preflight(cfg: TridentConfig) -> Preflight:
    """Every user-input check, before any process group exists (identical on every rank).

    Raises:
        ValueError: a bad flag combination, a --deepspeed_config that contradicts a flag, or an untested
            DeepSpeed version.
        FileNotFoundError: a named file (DeepSpeed JSON, tokenizer files, data) does not exist.
    """
    check_deepspeed_version()
    ensure_rendezvous_env(cfg.parallel.local_rank)
    world_size = world_size_from_env()
    device_type = initialize.run_device_type(cfg.parallel)
    if device_type == "cpu":
        allocator_choice(os.environ)
    validate(cfg, world_size=world_size, device_type=device_type)
    if cfg.training.bf16 and device_type == "cuda":
        check_bf16_gpu()
    check_data_flags(cfg)
    check_output_paths(cfg.logging)
    check_eval_harness_include_path(cfg.training.eval_harness_include_path)
    cfg = dataclasses.replace(
        cfg, checkpoint=resolve_universal_flag(cfg.checkpoint, cfg.parallel, world_size)
    )
    tokenizer = build_run_tokenizer(cfg.data)
    plan = RunPlan.build(  # also the run-length checks (--train-iters / --train-samples)
        cfg, world_size=world_size, device_type=device_type, true_vocab=tokenizer.vocab_size
    )
    check_lr_schedule(cfg.training, plan)  # the schedule's own checks (warmup vs decay length)
    ds_config = build_ds_config(cfg, plan)
    check_data_vocab(cfg.data, tokenizer.vocab_size)
    fingerprint = encoding_fingerprint(tokenizer)
    pending = check_checkpoint_dirs(
        cfg, plan, tokenizer_fingerprint=fingerprint, background_hashes=True
    )
    if cfg.model.lora.enabled:  # the base checkpoint, and --load holds adapters of this base
        model = dataclasses.replace(cfg.model, vocab_size=plan.true_vocab_size)
        check_lora_start(cfg.checkpoint, model, plan)
    return Preflight(
        cfg=cfg,
        plan=plan,
        ds_config=ds_config,
        tokenizer=tokenizer,
        tokenizer_fingerprint=fingerprint,
        checksums=pending,
    )


def plan_for_config(
    cfg: TridentConfig, *, world_size: int, device_type: str = "cuda"
) -> tuple[RunPlan, MemoryPlan, dict[str, Any]]:
    """(run plan, memory plan, DeepSpeed config) of ``cfg`` on ``world_size`` ranks, after the same checks a run makes.

    Raises:
        ValueError / FileNotFoundError: what ``validate``, the tokenizer or the DeepSpeed config raise for the
            same flags in ``pretrain_gpt.py`` (the same one-line messages).
    """
    validate(cfg, world_size=world_size, device_type=device_type)
    tokenizer = build_run_tokenizer(cfg.data)
    plan = RunPlan.build(
        cfg, world_size=world_size, device_type=device_type, true_vocab=tokenizer.vocab_size
    )
    ds_config = build_ds_config(cfg, plan)
    pc = PlannerConfig.from_configs(cfg.model, cfg.parallel, cfg.training)
    return plan, plan_memory(pc, plan, ds_config), ds_config
