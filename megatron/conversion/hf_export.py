"""Trident checkpoint -> Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer files), verified
by comparing logits and greedy decodes of the written directory (loaded with transformers, offline) with the
checkpoint run in our ``GPTModel``.

GPT-2-style checkpoints become ``GPT2LMHeadModel`` (``hf_gpt2.py``); LLaMA-style ones ``LlamaForCausalLM``,
``Qwen2ForCausalLM`` (QKV bias), ``Qwen3ForCausalLM`` (QK-norm) or ``MistralForCausalLM`` (a sliding window, or
imported from Mistral), the family picked by ``hf_features.export_family`` (``hf_llama.py``); DeepSpeed-MoE ones
``MixtralForCausalLM`` (``hf_mixtral.py``). The weights come through ``megatron.checkpointing.readers`` (any
TP/PP/EP layout, any ZeRO stage).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.readers import (
    CheckpointRead,
    Progress,
    build_megatron_model,
    no_progress,
)
from megatron.config import ModelConfig
from megatron.conversion.hf_gpt2 import megatron_to_gpt2_hf
from megatron.conversion.hf_llama import megatron_to_llama_hf
from megatron.conversion.hf_mixtral import is_mixtral, megatron_to_mixtral_hf, verification_config
from megatron.conversion.hf_tokenizer import export_tokenizer, special_token_ids
from megatron.conversion.lora_export import (
    STALE_ADAPTER_FILES,
    LoraOutput,
    hf_weights,
    peft_adapter,
    read_export_weights,
    write_peft_adapter,
)
from megatron.conversion.output_dirs import check_output_dir_path, check_output_not_input
from megatron.conversion.verify import (
    LogitComparison,
    Verification,
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


def hf_exporter(cfg: ModelConfig, meta: dict[str, Any]) -> Callable[..., Any]:
    """The exporter of a checkpoint's model: Mixtral for MoE, the LLaMA family (LLaMA, Qwen2, Qwen3 or Mistral, by
    its features and the ``hf_model_type`` the import recorded in ``meta``) for LLaMA-style models, else GPT-2."""
    if is_mixtral(cfg):
        return megatron_to_mixtral_hf
    if is_llama(cfg):
        return functools.partial(megatron_to_llama_hf, recorded_family=meta.get("hf_model_type"))
    return megatron_to_gpt2_hf


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


def check_export_dir(
    out_dir: str | Path, *, overwrite: bool, load: str | Path | None = None
) -> None:
    """--out of ``trident_to_hf``: a new or empty directory, or any directory with ``overwrite``; never the
    checkpoint directory ``load`` or a directory inside it (compared by real path).

    Raises:
        ValueError: --out is a file, inside --load, or a non-empty directory without ``overwrite``.
    """
    check_output_dir_path(out_dir, "--out")
    if load is not None:
        check_output_not_input(out_dir, "--out", load, "--load")
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


def remove_stale_export_files(
    out_dir: Path, patterns: tuple[str, ...] = STALE_EXPORT_FILES
) -> list[str]:
    """Delete the files matching ``patterns`` (default :data:`STALE_EXPORT_FILES`) in ``out_dir``; returns the
    names removed."""
    removed = []
    for pattern in patterns:
        for path in out_dir.glob(pattern):
            if path.is_file() or path.is_symlink():
                path.unlink()
                removed.append(path.name)
    return sorted(removed)


@dataclass(frozen=True)
class TokenizerExport:
    """The tokenizer :func:`export_to_hf` writes beside the weights, and the special-token ids of ``config.json``."""

    info: dict[str, str] | None = None
    """``hf_tokenizer.TOKENIZER_KEYS`` values of the tokenizer to export; None: the one in the checkpoint's meta."""
    write: bool = True
    """Write the tokenizer files (``--no-tokenizer``: False; then no tokenizer is read either)."""
    bos_token_id: int | None = None
    """``config.json``'s ``bos_token_id`` (``--bos-token-id``); None: the exported tokenizer's."""
    eos_token_id: int | None = None
    """``config.json``'s ``eos_token_id`` (``--eos-token-id``); None: the exported tokenizer's."""


def export_to_hf(  # noqa: PLR0913 (the tool's flag groups, each a dataclass, plus --out and callbacks)
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    read: CheckpointRead = CheckpointRead(),
    tokenizer: TokenizerExport = TokenizerExport(),
    verification: Verification | None = Verification(),
    progress: Progress = no_progress,
    overwrite: bool = False,
    say: Callable[[str], None] = logger.info,
    lora: LoraOutput = LoraOutput(),
) -> LogitComparison | None:
    """Write ``out_dir/config.json`` + ``model.safetensors`` (fp32) and the tokenizer files from a checkpoint (the
    tag ``read.tag``, default ``latest``; its files checked against their recorded checksums unless
    ``read.verify_checksums`` is False).

    The tokenizer is the one recorded in the checkpoint's meta, or ``tokenizer.info`` when given;
    ``tokenizer.write=False`` skips it. With ``verification``, loads the written directory with transformers
    (offline) and compares it with the checkpoint run in our ``GPTModel`` on :func:`fixed_prompts` (greedy decodes
    of ``verification.steps`` tokens).

    A LoRA adapter checkpoint (a ``--lora-rank`` run's) needs ``lora`` (:mod:`megatron.conversion.lora_export`):
    ``lora.merge`` writes the merged model, ``lora.peft_dir`` the base model and, in that directory, the PEFT
    adapter folder; either is verified against our LoRA model (the PEFT folder loaded on the base with ``peft``).

    ``out_dir`` must be new or empty; with ``overwrite`` an existing directory is used after removing the
    :data:`STALE_EXPORT_FILES` in it (only once the tokenizer was checked: a refused export changes nothing).
    ``model.safetensors`` gets the mode the umask gives new files (safetensors itself writes 0600).

    The files are written and verified in a staging directory beside ``out_dir`` and moved in only when the
    comparison passes ``verification.tolerance`` (:meth:`LogitComparison.passes`; None: any result): a failed
    export goes to ``<out_dir>.unverified/`` instead, never into ``out_dir`` (the adapter likewise).

    Returns:
        The comparison (None without ``verification``).

    Raises:
        FileNotFoundError / ValueError: unreadable checkpoint, a tokenizer that cannot be exported faithfully, an
            --out that is a file or a non-empty directory (without ``overwrite``), an adapter checkpoint without
            ``lora`` (or ``lora`` without adapters).
    """
    check_export_dir(out_dir, overwrite=overwrite, load=ckpt_dir)
    lora.check_dirs(ckpt_dir, out_dir, overwrite=overwrite)
    full, cfg, meta = read_export_weights(ckpt_dir, read, progress, lora)
    if cfg.moe.num_experts_switch is not None:
        raise ValueError(
            f"{ckpt_dir}: a model with a Switch MLP (--num-experts-switch {cfg.moe.num_experts_switch}) has no "
            "Hugging Face transformers counterpart, so it cannot be exported; keep it in Trident's format."
        )
    tok_info = (tokenizer.info or meta.get("tokenizer")) if tokenizer.write else None
    bos_token_id, eos_token_id = _config_token_ids(tokenizer, tok_info)
    hf_sd, hf_cfg = hf_exporter(cfg, meta)(
        hf_weights(full, cfg, lora), cfg, cfg.vocab_size, bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )  # fmt: skip
    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Everything is written and verified in staging directories beside --out (and --peft-output); only an export
    # that passed (or was not verified) is moved in. A refused tokenizer or a failed verification leaves them as
    # they were.
    with contextlib.ExitStack() as stack:
        staging = _staging_dir(stack, out)
        adapter = _staging_dir(stack, Path(lora.peft_dir).absolute()) if lora.peft_dir else None
        if tokenizer.write:
            trained = (meta.get("tokenizer") or {}).get("fingerprint")
            say(export_tokenizer(tok_info, str(staging), cfg.vocab_size, trained))
        _write_model(staging, hf_sd, hf_cfg)
        if adapter is not None:
            family = "llama" if is_llama(cfg) or is_mixtral(cfg) else "gpt2"
            write_peft_adapter(
                adapter, *peft_adapter(full, cfg, family=family, base_model=str(out))
            )
        progress("writing", 1, 1)
        result = (
            None
            if verification is None
            else _verify_export(staging, full, cfg, verification, adapter)
        )
        tolerance = None if verification is None else verification.tolerance
        if result is not None and tolerance is not None and not result.passes(tolerance):
            failed = [_set_aside(staging, out)]
            if adapter is not None and lora.peft_dir is not None:
                failed.append(_set_aside(adapter, lora.peft_dir))
            say(
                f"verification FAILED: the export was NOT written to {out} (left for inspection in "
                f"{' and '.join(map(str, failed))}; do not use it)"
            )
            return result
        _move_in(staging, out, STALE_EXPORT_FILES if overwrite else (), say)
        if adapter is not None and lora.peft_dir is not None:
            _move_in(adapter, Path(lora.peft_dir), STALE_ADAPTER_FILES if overwrite else (), say)
    return result


def _staging_dir(stack: contextlib.ExitStack, out: Path) -> Path:
    """A temporary directory beside ``out`` (same file system: the files are renamed in), removed on exit."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(
        stack.enter_context(
            tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.export-")
        )
    )


def _write_model(staging: Path, hf_sd: dict[str, torch.Tensor], hf_cfg: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in hf_sd.items()}, str(staging / "model.safetensors"))
    apply_umask_mode(staging / "model.safetensors")
    (staging / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")


def _set_aside(staging: Path, out: str | Path) -> Path:
    """Move a failed export's staging directory to ``<out>.unverified`` (replacing an older one)."""
    failed = Path(out).absolute().with_name(f"{Path(out).name}.unverified")
    shutil.rmtree(failed, ignore_errors=True)
    staging.rename(failed)
    staging.mkdir()  # for TemporaryDirectory's cleanup
    return failed


def _move_in(staging: Path, out: Path, stale: tuple[str, ...], say: Callable[[str], None]) -> None:
    """Move the staged files into ``out``, after removing the ``stale`` patterns there (``--overwrite``)."""
    out.mkdir(parents=True, exist_ok=True)
    if removed := remove_stale_export_files(out, stale):
        say(f"--overwrite: removed {', '.join(removed)} from {out}")
    for f in staging.iterdir():
        os.replace(f, out / f.name)


def _config_token_ids(
    tokenizer: TokenizerExport, tok_info: dict[str, str] | None
) -> tuple[int | None, int | None]:
    """``(bos_token_id, eos_token_id)`` of ``config.json``: the ones given, else the exported tokenizer's."""
    tok_bos, tok_eos = special_token_ids(tok_info)
    bos = tok_bos if tokenizer.bos_token_id is None else tokenizer.bos_token_id
    eos = tok_eos if tokenizer.eos_token_id is None else tokenizer.eos_token_id
    return bos, eos


def _verify_export(
    hf_dir: Path,
    full: dict[str, torch.Tensor],
    cfg: ModelConfig,
    verification: Verification,
    adapter: Path | None = None,
) -> LogitComparison:
    """The written HF directory (loaded with transformers, offline; with the PEFT ``adapter`` folder loaded on it
    by ``peft`` when given) against the checkpoint in our ``GPTModel`` (with its LoRA adapters, if any)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True).float().eval()
    if adapter is not None:
        from peft import PeftModel

        hf = PeftModel.from_pretrained(hf, str(adapter), local_files_only=True).eval()
    ours = build_megatron_model(full, verification_config(cfg))
    max_pos = cfg.max_position_embeddings or cfg.seq_length
    prompts, n = fixed_prompts(cfg.vocab_size, max_pos, verification.steps)
    with torch.no_grad():
        return compare_logits(
            megatron_logits_fn(ours), hf_logits_fn(hf), prompts, n, vocab_size=cfg.vocab_size
        )
