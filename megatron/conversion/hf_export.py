"""Trident checkpoint -> Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer files), verified
by comparing logits and greedy decodes of the written directory (loaded with transformers, offline) with the
checkpoint run in our ``GPTModel``.

GPT-2-style checkpoints become ``GPT2LMHeadModel`` (``hf_gpt2.py``), LLaMA-style ones ``LlamaForCausalLM``
(``hf_llama.py``); the weights come through ``megatron.checkpointing.readers`` (any TP/PP layout, any ZeRO stage).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from megatron.checkpointing.readers import (
    Progress,
    build_megatron_model,
    no_progress,
    read_checkpoint_weights,
)
from megatron.config import ModelConfig
from megatron.conversion.hf_gpt2 import megatron_to_gpt2_hf
from megatron.conversion.hf_llama import megatron_to_llama_hf
from megatron.conversion.hf_tokenizer import export_tokenizer, special_token_ids
from megatron.conversion.output_dirs import check_output_dir_path
from megatron.conversion.verify import (
    LogitComparison,
    compare_logits,
    fixed_prompts,
    hf_logits_fn,
    megatron_logits_fn,
)
from megatron.data.indexed_dataset import apply_umask_mode

logger = logging.getLogger(__name__)


def is_llama(cfg: ModelConfig) -> bool:
    """LLaMA-style (rmsnorm/SwiGLU/RoPE) vs GPT-2-style architecture."""
    return cfg.swiglu or cfg.normalization == "rmsnorm" or cfg.use_rotary_position_embeddings


STALE_EXPORT_FILES = (
    "config.json",
    "generation_config.json",
    "model*.safetensors*",
    "pytorch_model*.bin*",
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)
"""What ``export_to_hf(overwrite=True)`` removes from ``out_dir`` first: files of an earlier model or tokenizer that
transformers would otherwise read beside ours (a stale ``tokenizer.json`` wins over our ``vocab.json``)."""


def check_export_dir(out_dir: str | Path, *, overwrite: bool) -> None:
    """--out of ``trident_to_hf``: a new or empty directory, or any directory with ``overwrite``.

    Raises:
        ValueError: --out is a file, or a non-empty directory without ``overwrite``.
    """
    check_output_dir_path(out_dir, "--out")
    out = Path(out_dir)
    if overwrite or not out.is_dir():
        return
    present = sorted(p.name for p in out.iterdir())
    if present:
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        raise ValueError(
            f"--out {out_dir} is not empty ({shown}); files left from another model or tokenizer would be "
            "mixed with the export. Choose a new or empty directory, or pass --overwrite to replace the "
            "model, config and tokenizer files there."
        )


def remove_stale_export_files(out_dir: Path) -> list[str]:
    """Delete the :data:`STALE_EXPORT_FILES` in ``out_dir``; returns the names removed."""
    removed = []
    for pattern in STALE_EXPORT_FILES:
        for path in out_dir.glob(pattern):
            if path.is_file() or path.is_symlink():
                path.unlink()
                removed.append(path.name)
    return sorted(removed)


def export_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    tag: str | None = None,
    verify: bool = True,
    steps: int = 32,
    progress: Progress = no_progress,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    tokenizer: dict[str, str] | None = None,
    write_tokenizer: bool = True,
    overwrite: bool = False,
    say: Callable[[str], None] = logger.info,
) -> LogitComparison | None:
    """Write ``out_dir/config.json`` + ``model.safetensors`` (fp32) and the tokenizer files from a checkpoint.

    The tokenizer is the one recorded in the checkpoint's meta, or ``tokenizer`` (``hf_tokenizer.TOKENIZER_KEYS``
    values) when given; ``write_tokenizer=False`` skips it. With ``verify``, loads the written directory with
    transformers (offline) and compares it with the checkpoint run in our ``GPTModel`` on :func:`fixed_prompts`
    (greedy decodes of ``steps`` tokens).

    ``out_dir`` must be new or empty; with ``overwrite`` an existing directory is used after removing the
    :data:`STALE_EXPORT_FILES` in it (only once the tokenizer was checked: a refused export changes nothing).
    ``model.safetensors`` gets the mode the umask gives new files (safetensors itself writes 0600).

    Returns:
        The comparison (None without ``verify``).

    Raises:
        FileNotFoundError / ValueError: unreadable checkpoint, a tokenizer that cannot be exported faithfully, or
            an --out that is a file or a non-empty directory (without ``overwrite``).
    """
    from safetensors.torch import save_file

    check_export_dir(out_dir, overwrite=overwrite)
    full, cfg, meta = read_checkpoint_weights(ckpt_dir, tag, progress)
    tok_info = (tokenizer or meta.get("tokenizer")) if write_tokenizer else None
    if tok_info:
        tok_bos, tok_eos = special_token_ids(tok_info)
        bos_token_id = tok_bos if bos_token_id is None else bos_token_id
        eos_token_id = tok_eos if eos_token_id is None else eos_token_id
    export = megatron_to_llama_hf if is_llama(cfg) else megatron_to_gpt2_hf
    hf_sd, hf_cfg = export(
        full, cfg, cfg.vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id
    )
    out = Path(out_dir)
    with tempfile.TemporaryDirectory() as staging:
        # The tokenizer is written and checked first, aside: a refused tokenizer leaves out_dir untouched.
        if write_tokenizer:
            trained = (meta.get("tokenizer") or {}).get("fingerprint")
            say(export_tokenizer(tok_info, staging, cfg.vocab_size, trained))
        out.mkdir(parents=True, exist_ok=True)
        if overwrite and (removed := remove_stale_export_files(out)):
            say(f"--overwrite: removed {', '.join(removed)} from {out}")
        save_file({k: v.contiguous() for k, v in hf_sd.items()}, str(out / "model.safetensors"))
        apply_umask_mode(out / "model.safetensors")
        (out / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
        for f in Path(staging).iterdir():
            shutil.copyfile(f, out / f.name)
    progress("writing", 1, 1)
    if not verify:
        return None
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).float().eval()
    ours = build_megatron_model(full, cfg)
    max_pos = cfg.max_position_embeddings or cfg.seq_length
    prompts, n = fixed_prompts(cfg.vocab_size, max_pos, steps)
    with torch.no_grad():
        return compare_logits(
            megatron_logits_fn(ours), hf_logits_fn(hf), prompts, n, vocab_size=cfg.vocab_size
        )
