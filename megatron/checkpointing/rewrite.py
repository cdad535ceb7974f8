"""Write a Trident checkpoint at any TP/PP from full (TP = 1) weights, through a real DeepSpeed engine.

``write_trident_checkpoint`` spawns ``TP x PP`` local ranks; each builds the model at the target layout
(``GPTModel`` or ``GPTModelPipe``), loads its shard BEFORE ``deepspeed.initialize`` (so ZeRO's fp32 master copies
hold these weights) and saves through ``DeepSpeedCheckpointer`` at iteration 0, marked ``weights_only`` (training
loads it like --finetune). Used by the HF importer and by :func:`reshard_checkpoint` (offline TP/PP change).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.convert import (
    Progress,
    _no_progress,
    build_megatron_model,
    check_output_dir_path,
    fixed_prompts,
    megatron_logits_fn,
    read_checkpoint_config,
    read_checkpoint_weights,
)
from megatron.checkpointing.layout import padded_vocab_size
from megatron.checkpointing.reshard import pad_vocab_for_tp
from megatron.checkpointing.verify import LogitComparison, compare_logits
from megatron.config import ModelConfig


def _rank_writer(
    full_path: str, model: dict[str, Any], tp: int, pp: int, out_dir: str, meta: dict[str, Any]
) -> None:
    """One rank of the import: model at the target layout, its shard, DeepSpeed engine, save (spawned)."""
    import deepspeed
    from safetensors.torch import load_file

    from megatron import mpu
    from megatron.checkpointing.engine_checkpoint import DeepSpeedCheckpointer
    from megatron.checkpointing.reshard import shard_state_dict
    from megatron.config import parse_args
    from megatron.model.gpt_model_pipe import pipe_to_megatron_name
    from megatron.training import initialize
    from megatron.training.ds_config import build_ds_config, global_batch_size, uses_pipeline_engine
    from megatron.training.loop import TrainState
    from megatron.training.lr_scheduler import build_lr_scheduler
    from megatron.training.model_setup import build_model
    from megatron.training.optimizer import build_optimizer

    model_cfg = ModelConfig(**model)
    argv = [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--micro-batch-size", "1", "--train-iters", "1", "--mock-data", "--save", out_dir,
        "--log-level", "WARNING",
        *(["--zero-stage", "1"] if pp > 1 else []),
    ]  # fmt: skip
    cfg = parse_args(argv)
    cfg = dataclasses.replace(cfg, model=model_cfg)
    initialize.ensure_rendezvous_env(cfg.parallel.local_rank)
    world = initialize.world_size_from_env()
    device = initialize.init_distributed(cfg)
    try:
        initialize.set_seeds(cfg.training.seed)
        vocab = model_cfg.vocab_size
        module = build_model(cfg, true_vocab=vocab, device=device, world_size=world)
        full = load_file(full_path)
        shard = shard_state_dict(full, model_cfg, tp, mpu.get_tensor_model_parallel_rank())
        is_pipe = uses_pipeline_engine(cfg)
        own = module.state_dict()
        new = {
            k: shard[pipe_to_megatron_name(k, model_cfg.num_layers) if is_pipe else k] for k in own
        }
        module.load_state_dict(new, strict=True)
        optimizer = build_optimizer(module, cfg.training)
        engine, _, _, _ = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            mpu=None if is_pipe else mpu,
            config=build_ds_config(cfg, world),
        )
        scheduler = build_lr_scheduler(cfg.training, global_batch_size(cfg, world), optimizer)
        padded = padded_vocab_size(vocab, model_cfg.make_vocab_size_divisible_by, tp)
        ckpt = DeepSpeedCheckpointer(cfg, true_vocab=vocab, padded_vocab=padded, world_size=world)
        ckpt.extra_meta = {"weights_only": True, **meta}
        ckpt.save(engine, scheduler, TrainState())
    finally:
        mpu.destroy_model_parallel()


def check_new_save_dir(
    save: str | Path, *, load: str | Path | None = None, load_flag: str = "--load"
) -> None:
    """--save of the conversion tools: a new or empty directory (not the source ``load`` given with ``load_flag``,
    not a file, no checkpoints in it).

    The tools write a weights-only ``global_step0`` and point ``latest`` at it; in a directory holding a
    training run that would make the next relaunch silently restart from iteration 0.

    Raises:
        ValueError: naming --save, what it holds and the fix.
    """
    check_output_dir_path(save, "--save")
    out = Path(save)
    fix = "write the converted checkpoint to a new or empty directory"
    if load is not None and Path(load).resolve() == out.resolve():
        raise ValueError(f"--save {save} is the {load_flag} directory; {fix}.")
    if not out.is_dir():
        return
    found = sorted(p.name for p in out.glob("global_step*")) + sorted(
        p.name for p in out.glob("latest*") if p.is_file()
    )
    if found:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise ValueError(
            f"--save {save} already holds checkpoints ({shown}): the converted weights-only global_step0 "
            f"would become its 'latest' and a training relaunch there would restart from iteration 0; {fix}."
        )


def check_target_layout(cfg: ModelConfig, *, tp: int, pp: int) -> None:
    """The model of ``cfg`` can be split over ``tp`` x ``pp`` ranks (the rules ``GPTModel`` enforces).

    Raises:
        ValueError: naming --tp / --pp, the model's sizes and the values that would work.
    """
    from megatron.model.utils import check_tensor_parallel_shapes

    if tp < 1 or pp < 1:
        raise ValueError(f"--tp ({tp}) and --pp ({pp}) must be >= 1.")
    if cfg.num_layers < pp:
        raise ValueError(
            f"--pp ({pp}) exceeds the model's {cfg.num_layers} layers; use --pp <= that."
        )
    sizes = {"attention heads": cfg.num_attention_heads, "FFN hidden size": cfg.ffn_size}
    if cfg.num_query_groups != cfg.num_attention_heads:
        sizes["key/value heads"] = cfg.num_query_groups
    bad = [f"{name} ({value})" for name, value in sizes.items() if value % tp]
    if bad:
        common = math.gcd(*sizes.values())
        ok = [str(d) for d in range(1, common + 1) if common % d == 0]
        raise ValueError(
            f"--tp ({tp}) must divide the model's {' and '.join(bad)}; use --tp {', '.join(ok)}."
        )
    try:
        check_tensor_parallel_shapes(cfg, tp)
    except ValueError as err:
        raise ValueError(f"--tp ({tp}): {err}") from None


def write_trident_checkpoint(
    full: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | Path,
    *,
    tp: int,
    pp: int,
    source: str,
    tokenizer: dict[str, str] | None = None,
    timeout: float = 900.0,
) -> None:
    """Save ``full`` (Megatron names, any vocab padding) as a Trident checkpoint for ``tp`` x ``pp`` ranks.

    ``source`` and ``tokenizer`` (``hf_tokenizer.tokenizer_info``) are recorded in ``trident_meta.json``.

    Raises:
        ValueError: (before any process is spawned) ``out_dir`` is not a new or empty directory
            (:func:`check_new_save_dir`), or the model does not split over ``tp`` x ``pp``
            (:func:`check_target_layout`).
    """
    from safetensors.torch import save_file

    from megatron.testing import run_distributed

    check_new_save_dir(out_dir)
    check_target_layout(cfg, tp=tp, pp=pp)
    padded = pad_vocab_for_tp(full, cfg, tp)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "full.safetensors")
        save_file({k: v.contiguous() for k, v in padded.items()}, path)
        run_distributed(
            _rank_writer,
            tp * pp,
            path,
            dataclasses.asdict(cfg),
            tp,
            pp,
            str(out_dir),
            {"converted_from": source, **({"tokenizer": tokenizer} if tokenizer else {})},
            init_process_group=False,
            timeout=timeout,
        )


def reshard_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    tp: int,
    pp: int,
    tag: str | None = None,
    verify: bool = True,
    steps: int = 32,
    progress: Progress = _no_progress,
) -> LogitComparison | None:
    """Offline (TP, PP) -> (``tp``, ``pp``) for the weights of a Trident checkpoint (iteration 0, weights only).

    For resuming WITH optimizer state at another layout use the universal checkpoint (``universal.py``).

    Returns:
        Source vs written checkpoint logits (both run in a TP = 1 ``GPTModel``), None without ``verify``.

    Raises:
        ValueError / FileNotFoundError: ``dst`` is ``src``, a file or holds checkpoints; the model does not split
            over ``tp`` x ``pp``; the source is unreadable. All before any rank is spawned.
    """
    found, src_cfg, _ = read_checkpoint_config(src, tag)
    check_target_layout(src_cfg, tp=tp, pp=pp)
    check_new_save_dir(dst, load=src)
    full, cfg, meta = read_checkpoint_weights(src, found, progress)
    write_trident_checkpoint(
        full, cfg, dst, tp=tp, pp=pp, source=str(src), tokenizer=meta.get("tokenizer")
    )
    progress("writing", 1, 1)
    if not verify:
        return None
    back, back_cfg, _ = read_checkpoint_weights(dst)
    a, b = build_megatron_model(full, cfg), build_megatron_model(back, back_cfg)
    max_pos = cfg.max_position_embeddings or cfg.seq_length
    prompts, n = fixed_prompts(cfg.vocab_size, max_pos, steps)
    with torch.no_grad():
        return compare_logits(
            megatron_logits_fn(a), megatron_logits_fn(b), prompts, n, vocab_size=cfg.vocab_size
        )
