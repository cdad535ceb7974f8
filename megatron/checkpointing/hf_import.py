"""Hugging Face directory -> Trident checkpoint at any TP/PP, written by a real DeepSpeed engine.

The HF weights are converted to Megatron's full layout (``hf_gpt2``/``hf_llama``), the vocabulary padded for the
target TP, and written to a temporary safetensors file. Then ``TP x PP`` ranks are spawned; each builds the model
at the target layout (``GPTModel`` or ``GPTModelPipe``), loads its shard BEFORE ``deepspeed.initialize`` (so ZeRO's
fp32 master copies hold the imported weights) and saves through ``DeepSpeedCheckpointer`` at iteration 0. The result
is what training writes, so ``--load`` reads it by construction; it is marked ``weights_only`` (loads like
--finetune: iteration 0, fresh optimizer and LR schedule from the flags).

Verification reads the written checkpoint back (``convert.read_checkpoint_weights``), runs it in our ``GPTModel``
and compares it with the source HF model.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.convert import (
    Progress,
    _no_progress,
    build_megatron_model,
    fixed_prompts,
    hf_logits_fn,
    megatron_logits_fn,
    read_checkpoint_weights,
)
from megatron.checkpointing.hf_gpt2 import gpt2_hf_to_megatron
from megatron.checkpointing.hf_llama import llama_hf_to_megatron
from megatron.checkpointing.layout import padded_vocab_size
from megatron.checkpointing.safe_load import load_hf_directory
from megatron.checkpointing.verify import LogitComparison, compare_logits
from megatron.config import ModelConfig


def hf_to_full(
    hf_dir: str | Path, tp: int, make_vocab_size_divisible_by: int = 128
) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """``(full Megatron state dict padded for TP = tp, ModelConfig, HF config dict)`` of a local HF directory.

    Raises:
        ValueError: the model type is neither ``gpt2`` nor ``llama`` (or the converters refuse a variant).
    """
    sd, config = load_hf_directory(hf_dir)
    kind = config.get("model_type")
    convert = {"gpt2": gpt2_hf_to_megatron, "llama": llama_hf_to_megatron}.get(kind)
    if convert is None:
        raise ValueError(
            f"{hf_dir}/config.json: model_type {kind!r} is not supported; convert a GPT2LMHeadModel "
            "('gpt2') or LlamaForCausalLM ('llama') directory."
        )
    vocab = int(config["vocab_size"])
    padded = padded_vocab_size(vocab, make_vocab_size_divisible_by, tp)
    full, cfg = convert(
        sd, config, padded_vocab=padded, make_vocab_size_divisible_by=make_vocab_size_divisible_by
    )
    return full, cfg, config


def _rank_writer(
    full_path: str, model: dict[str, Any], tp: int, pp: int, out_dir: str, source: str
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
        ckpt.extra_meta = {"weights_only": True, "converted_from": source}
        ckpt.save(engine, scheduler, TrainState())
    finally:
        mpu.destroy_model_parallel()


def import_from_hf(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    verify: bool = True,
    steps: int = 32,
    progress: Progress = _no_progress,
    timeout: float = 900.0,
) -> LogitComparison | None:
    """Convert a local HF GPT-2/LLaMA directory into a Trident checkpoint for ``tp`` x ``pp`` ranks.

    Returns:
        The HF-vs-written-checkpoint comparison (None without ``verify``).
    """
    from safetensors.torch import save_file

    from megatron.testing import run_distributed

    if tp < 1 or pp < 1:
        raise ValueError(f"--tp ({tp}) and --pp ({pp}) must be >= 1.")
    full, cfg, _ = hf_to_full(hf_dir, tp)
    if cfg.num_layers < pp:
        raise ValueError(
            f"--pp ({pp}) exceeds the model's {cfg.num_layers} layers; use --pp <= that."
        )
    progress("converting", 1, 3)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "full.safetensors")
        save_file({k: v.contiguous() for k, v in full.items()}, path)
        run_distributed(
            _rank_writer,
            tp * pp,
            path,
            dataclasses.asdict(cfg),
            tp,
            pp,
            str(out_dir),
            str(hf_dir),
            init_process_group=False,
            timeout=timeout,
        )
    progress("writing", 2, 3)
    if not verify:
        return None
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True).float().eval()
    back, back_cfg, _ = read_checkpoint_weights(out_dir)
    ours = build_megatron_model(back, back_cfg)
    max_pos = cfg.max_position_embeddings or cfg.seq_length
    prompts, n = fixed_prompts(cfg.vocab_size, max_pos, steps)
    with torch.no_grad():
        result = compare_logits(
            hf_logits_fn(hf), megatron_logits_fn(ours), prompts, n, vocab_size=cfg.vocab_size
        )
    progress("verifying", 3, 3)
    return result
