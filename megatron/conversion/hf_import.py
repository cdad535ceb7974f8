"""Hugging Face directory -> Trident checkpoint at any TP/PP (and EP), written by a real DeepSpeed engine.

The HF weights are converted to Megatron's full layout (``hf_gpt2``/``hf_llama``/``hf_mixtral``), the vocabulary
padded for the target TP, and written to a temporary safetensors file. Then ``TP x PP`` ranks (``x EP`` for a
Mixtral: data-parallel size EP) are spawned; each builds the model at the target layout (``GPTModel`` or
``GPTModelPipe``), loads its shard (its EP rank's experts) BEFORE ``deepspeed.initialize`` (so ZeRO's fp32 master
copies hold the imported weights) and saves through ``DeepSpeedCheckpointer`` at iteration 0. The result
is what training writes, so ``--load`` reads it by construction; it is marked ``weights_only`` (loads like
--finetune: iteration 0, fresh optimizer and LR schedule from the flags).

Verification reads the written checkpoint back (``convert.read_checkpoint_weights``), runs it in our ``GPTModel``
and compares it with the source HF model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.readers import (
    Progress,
    build_megatron_model,
    no_progress,
    read_checkpoint_weights,
)
from megatron.checkpointing.safe_load import load_hf_directory
from megatron.config import ModelConfig
from megatron.config.rules import padded_vocab_size
from megatron.conversion.hf_gpt2 import gpt2_hf_to_megatron
from megatron.conversion.hf_llama import llama_hf_to_megatron
from megatron.conversion.hf_mixtral import mixtral_hf_to_megatron, verification_config
from megatron.conversion.hf_tokenizer import hf_dir_tokenizer
from megatron.conversion.output_dirs import check_new_save_dir
from megatron.conversion.rewrite import (
    TargetLayout,
    check_target_layout,
    write_trident_checkpoint,
)
from megatron.conversion.verify import (
    LogitComparison,
    Verification,
    compare_logits,
    fixed_prompts,
    hf_logits_fn,
    megatron_logits_fn,
)


def hf_to_full(
    hf_dir: str | Path, tp: int, make_vocab_size_divisible_by: int = 128
) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """``(full Megatron state dict padded for TP = tp, ModelConfig, HF config dict)`` of a local HF directory.

    Raises:
        ValueError: the model type is not ``gpt2``, ``llama`` or ``mixtral`` (or the converters refuse a variant).
    """
    sd, config = load_hf_directory(hf_dir)
    kind = config.get("model_type")
    convert = {
        "gpt2": gpt2_hf_to_megatron,
        "llama": llama_hf_to_megatron,
        "mixtral": mixtral_hf_to_megatron,
    }.get(kind)
    if convert is None:
        raise ValueError(
            f"{hf_dir}/config.json: model_type {kind!r} is not supported; convert a GPT2LMHeadModel "
            "('gpt2'), LlamaForCausalLM ('llama') or MixtralForCausalLM ('mixtral') directory."
        )
    vocab = int(config["vocab_size"])
    padded = padded_vocab_size(vocab, make_vocab_size_divisible_by, tp)
    full, cfg = convert(
        sd, config, padded_vocab=padded, make_vocab_size_divisible_by=make_vocab_size_divisible_by
    )
    return full, cfg, config


def import_from_hf(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    layout: TargetLayout = TargetLayout(),
    verification: Verification | None = Verification(),
    progress: Progress = no_progress,
    timeout: float = 900.0,
) -> LogitComparison | None:
    """Convert a local HF GPT-2/LLaMA/Mixtral directory into a Trident checkpoint for ``layout.tp`` x
    ``layout.pp`` ranks (and a Mixtral's experts over ``layout.ep`` expert-parallel ranks: ``tp * pp * ep`` ranks
    write it, data-parallel size ``ep``).

    Returns:
        The HF-vs-written-checkpoint comparison (None without ``verification``).

    Raises:
        ValueError / FileNotFoundError: ``out_dir`` is a file or holds checkpoints, the model does not split over
            ``layout``, or the HF directory is unreadable or unsupported. All before any rank is spawned.
    """
    check_new_save_dir(out_dir, load=hf_dir, load_flag="--hf-dir")
    if layout.tp < 1 or layout.pp < 1:
        raise ValueError(f"--tp ({layout.tp}) and --pp ({layout.pp}) must be >= 1.")
    full, cfg, _ = hf_to_full(hf_dir, layout.tp)
    check_target_layout(cfg, layout)
    progress("converting", 1, 3)
    write_trident_checkpoint(
        full,
        cfg,
        out_dir,
        layout=layout,
        source=str(hf_dir),
        tokenizer=hf_dir_tokenizer(hf_dir),
        timeout=timeout,
    )
    progress("writing", 2, 3)
    if verification is None:
        return None
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True).float().eval()
    back, back_cfg, _ = read_checkpoint_weights(out_dir)
    ours = build_megatron_model(back, verification_config(back_cfg))
    max_pos = cfg.max_position_embeddings or cfg.seq_length
    prompts, n = fixed_prompts(cfg.vocab_size, max_pos, verification.steps)
    with torch.no_grad():
        result = compare_logits(
            hf_logits_fn(hf), megatron_logits_fn(ours), prompts, n, vocab_size=cfg.vocab_size
        )
    progress("verifying", 3, 3)
    return result
