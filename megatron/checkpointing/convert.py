"""Checkpoint conversions: Trident (DeepSpeed) checkpoint -> Hugging Face directory, with logit verification.

A "Trident checkpoint" is the directory training writes with --save (``engine_checkpoint.py``). Reading its weights
back needs no pickle execution: DeepSpeed's model-state files hold only tensors and plain containers, so
``torch.load(weights_only=True)`` reads them.

- PP = 1: ``mp_rank_{tp:02d}_model_states.pt``, key ``module`` (Megatron names);
- PP > 1: ``layer_{idx:02d}-model_{tp:02d}-model_states.pt`` (``pipe_layout.py``; the tied head is not saved);
- ZeRO-3 (PP = 1): the fp32 partitions in ``zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt`` (``zero3.py``).

TP shards are merged with ``reshard.merge_tp_shards``; the architecture comes from ``trident_meta.json``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.engine_checkpoint import (
    META_FILE,
    find_checkpoint,
    is_complete,
    model_config_from_dict,
    read_meta,
)
from megatron.checkpointing.hf_gpt2 import megatron_to_gpt2_hf
from megatron.checkpointing.hf_llama import megatron_to_llama_hf
from megatron.checkpointing.hf_tokenizer import export_tokenizer, special_token_ids
from megatron.checkpointing.pipe_layout import pipe_layers_to_megatron
from megatron.checkpointing.reshard import merge_tp_shards, pad_vocab_for_tp
from megatron.checkpointing.safe_load import torch_load_checkpoint_file
from megatron.checkpointing.verify import LogitComparison, compare_logits
from megatron.checkpointing.weights_only import read_tp_rank_weights
from megatron.config import ModelConfig
from megatron.data.indexed_dataset import apply_umask_mode

logger = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]
"""``progress(what, done, total)``: called as a conversion advances (the CLIs draw a bar)."""

_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")


def _no_progress(what: str, done: int, total: int) -> None:
    return None


def find_tag(
    ckpt_dir: str | Path, tag: str | None = None, *, tag_flag: str = "--tag"
) -> str | None:
    """The tag a tool reads in ``ckpt_dir``: ``tag`` if complete, else the ``latest`` pointer (None: none there).

    ``engine_checkpoint.find_checkpoint`` words its errors for training (--load-tag); the tools name their own
    flag (``tag_flag``) and list the complete tags to pick from.

    Raises:
        FileNotFoundError: ``tag`` is missing or incomplete.
        ValueError: ``latest`` points to an incomplete or missing tag.
    """
    root = Path(ckpt_dir)
    if tag is None:
        try:
            return find_checkpoint(str(root), None)
        except ValueError as err:
            raise ValueError(str(err).replace("--load-tag", tag_flag)) from None
    if is_complete(root, tag):
        return tag
    complete = (
        [p.name for p in root.glob("*") if (p / META_FILE).is_file()] if root.is_dir() else []
    )
    complete.sort(key=lambda t: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", t)])
    shown = ("..., " if len(complete) > 8 else "") + ", ".join(complete[-8:])
    listing = f"complete tags there: {shown}" if complete else f"{root} holds no complete tag"
    raise FileNotFoundError(
        f"{tag_flag} {tag}: {root / tag} is not a complete checkpoint (no {META_FILE}); {listing}. "
        f"Pick one of them or drop {tag_flag} to use 'latest'."
    )


def model_config_from_meta(meta: dict[str, Any]) -> ModelConfig:
    """The ``ModelConfig`` saved in a checkpoint's ``trident_meta.json``."""
    return model_config_from_dict(meta["model"])


def read_checkpoint_config(
    ckpt_dir: str | Path, tag: str | None = None
) -> tuple[str, ModelConfig, dict[str, Any]]:
    """``(tag, ModelConfig, meta)`` of a Trident checkpoint, without reading its weights.

    Raises:
        FileNotFoundError: no checkpoint in ``ckpt_dir``, or ``tag`` is not a complete one.
    """
    root = Path(ckpt_dir)
    found = find_tag(root, tag)
    if found is None:
        raise FileNotFoundError(
            f"{root} holds no Trident checkpoint (no 'latest' file); point at a --save directory or pass --tag."
        )
    meta = read_meta(root, found)
    return found, model_config_from_meta(meta), meta


def read_checkpoint_weights(
    ckpt_dir: str | Path, tag: str | None = None, progress: Progress = _no_progress
) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """Full (TP = 1, PP = 1) Megatron state dict of a Trident checkpoint, its ``ModelConfig`` and meta.

    The vocabulary rows stay padded (to the saving run's padding); ``ModelConfig.vocab_size`` is the true size.

    Raises:
        FileNotFoundError: no checkpoint in ``ckpt_dir`` or a model-state file is missing.
        ValueError: a file cannot be read safely, or its contents disagree.
    """
    root = Path(ckpt_dir)
    found, cfg, meta = read_checkpoint_config(root, tag)
    tp = int(meta["tensor_model_parallel_size"])
    pp = int(meta["pipeline_model_parallel_size"])
    tag_dir = root / found
    shards: list[dict[str, torch.Tensor]] = []
    if pp == 1:
        # ZeRO-3's module weights are placeholders: read_tp_rank_weights rebuilds them from the fp32 partitions.
        for r in range(tp):
            shards.append(read_tp_rank_weights(tag_dir, meta, r, progress))
            progress("reading TP shards", r + 1, tp)
    else:
        files = sorted(tag_dir.glob("layer_*-model_*-model_states.pt"))
        per_rank: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in range(tp)]
        for i, path in enumerate(files):
            m = _LAYER_FILE.search(path.name)
            if m is None:
                continue
            idx, r = int(m.group(1)), int(m.group(2))
            sd = torch_load_checkpoint_file(path)
            per_rank[r][idx] = {k: v.float() for k, v in sd.items()}
            progress("reading layer files", i + 1, len(files))
        for r in range(tp):
            if not per_rank[r]:
                raise FileNotFoundError(f"{tag_dir} has no layer files for TP rank {r}.")
            shards.append(pipe_layers_to_megatron(per_rank[r], cfg.num_layers))
    full = merge_tp_shards(shards, cfg) if tp > 1 else shards[0]
    return full, cfg, meta


def fixed_prompts(vocab: int, max_positions: int, steps: int) -> tuple[list[list[int]], int]:
    """Three deterministic prompts (lengths 1, 4, 7) and the decode length that fits ``max_positions``."""
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (4, 7, 1)]
    return prompts, max(1, min(steps, max_positions - 7))


def megatron_logits_fn(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``tokens [1, s] -> logits [1, s, v]`` of a ``GPTModel`` (TP = 1)."""

    def fn(tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1]).unsqueeze(0)  # [1, s]
        return model(tokens, pos)

    return fn


def hf_logits_fn(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``tokens [1, s] -> logits [1, s, V]`` of a transformers causal LM."""
    return lambda tokens: model(input_ids=tokens).logits


def build_megatron_model(full: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.nn.Module:
    """A TP = 1 ``GPTModel`` (eval mode, fp32) holding ``full`` (re-padded to TP = 1 rows)."""
    from megatron.model import GPTModel

    model = GPTModel(cfg, seed=0).eval()
    model.load_state_dict(pad_vocab_for_tp(full, cfg, 1), strict=True)
    return model


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


def check_output_dir_path(path: str | Path, flag: str) -> None:
    """``path`` is a directory or can be created as one: its nearest existing ancestor is a writable directory.

    Raises:
        ValueError: naming ``flag``, the file in the way (or the read-only directory) and the fix.
    """
    p = Path(path)
    for candidate in (p, *p.parents):
        if candidate.exists() or candidate.is_symlink():
            if not candidate.is_dir():
                where = "is a file" if candidate == p else f"is inside {candidate}, which is a file"
                raise ValueError(
                    f"{flag} {path} {where}; give a directory path (a new one is created)."
                )
            if not os.access(candidate, os.W_OK | os.X_OK):
                raise ValueError(
                    f"{flag} {path}: {candidate} is not writable; choose a directory you can write to."
                )
            return


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
    progress: Progress = _no_progress,
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
