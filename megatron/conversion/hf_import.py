"""Hugging Face directory -> Trident checkpoint at any TP/PP (and EP), written by a real DeepSpeed engine.

The HF weights are converted to Megatron's full layout (``hf_gpt2``; ``hf_llama`` for LLaMA, Qwen2, Qwen3 and
Mistral; ``hf_mixtral``), the vocabulary
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

import functools
import logging
from collections.abc import Callable
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
from megatron.conversion.hf_common import require_size
from megatron.conversion.hf_features import FAMILIES, REFUSED_MODEL_TYPES
from megatron.conversion.hf_gpt2 import gpt2_hf_to_megatron
from megatron.conversion.hf_llama import llama_hf_to_megatron
from megatron.conversion.hf_mixtral import mixtral_hf_to_megatron, verification_config
from megatron.conversion.hf_tokenizer import hf_dir_tokenizer
from megatron.conversion.output_dirs import check_new_save_dir
from megatron.conversion.rewrite import (
    StagedWrite,
    TargetLayout,
    Verify,
    check_target_layout,
    write_verified_checkpoint,
)
from megatron.conversion.verify import (
    LogitComparison,
    Verification,
    compare_logits,
    fixed_prompts,
    hf_logits_fn,
    megatron_logits_fn,
)
from megatron.layout.vocab import is_vocab_rows
from megatron.model import GPTModel
from megatron.mpu.context import ParallelContext

logger = logging.getLogger(__name__)


SUPPORTED = "gpt2, llama (rope_type default, llama3, linear), qwen2, qwen3, mistral, mixtral"
"""The ``model_type`` values :func:`hf_to_full` converts (for messages)."""


def hf_converter(
    kind: Any, hf_dir: str | Path
) -> Callable[..., tuple[dict[str, torch.Tensor], ModelConfig]]:
    """The converter of ``config.json``'s ``model_type`` ``kind``.

    Raises:
        ValueError: ``kind`` is not supported; a known relative (``qwen2_moe``, ...) is named with what it has that
            Trident cannot express.
    """
    if kind == "gpt2":
        return gpt2_hf_to_megatron
    if kind == "mixtral":
        return mixtral_hf_to_megatron
    if kind in FAMILIES:
        return functools.partial(llama_hf_to_megatron, model_type=kind)
    why = REFUSED_MODEL_TYPES.get(kind)
    if why is not None:
        raise ValueError(
            f"{hf_dir}/config.json: model_type {kind!r} is {why}, which Trident cannot express; supported: "
            f"{SUPPORTED}."
        )
    raise ValueError(
        f"{hf_dir}/config.json: model_type {kind!r} is not supported; convert a directory of one of: "
        f"{SUPPORTED}."
    )


def hf_to_full(
    hf_dir: str | Path, tp: int, make_vocab_size_divisible_by: int = 128
) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """``(full Megatron state dict padded for TP = tp, ModelConfig, HF config dict)`` of a local HF directory.

    Raises:
        ValueError: the model type is not one of :data:`SUPPORTED` (or the converters refuse a variant).
    """
    sd, config = load_hf_directory(hf_dir)
    kind = config.get("model_type")
    convert = hf_converter(kind, hf_dir)
    try:
        vocab = require_size(config, "vocab_size", str(kind))
        padded = padded_vocab_size(vocab, make_vocab_size_divisible_by, tp)
        full, cfg = convert(
            sd,
            config,
            padded_vocab=padded,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        )
    except ValueError as err:  # the converters name the field; the directory is named here
        raise ValueError(f"{hf_dir}: {err}") from None
    return full, cfg, config


def check_weights_fit_config(
    full: dict[str, torch.Tensor], cfg: ModelConfig, hf_dir: str | Path
) -> None:
    """Every converted tensor has the shape the model of ``config.json`` gives it (checked on the ``meta`` device,
    no memory), so a config that disagrees with its weights (``n_positions`` smaller than ``wpe``'s rows, another
    ``n_inner``) is one line here instead of a state-dict traceback in a spawned rank.

    Raises:
        ValueError: naming the tensor, both shapes and config.json.
    """
    with torch.device("meta"):
        expected = GPTModel(verification_config(cfg), ParallelContext(seed=0)).state_dict()
    for key, want in expected.items():
        got = full.get(key)
        # the vocabulary rows are padded differently per TP size: only their other dimensions must agree
        rows = 1 if is_vocab_rows(key) else 0
        if got is not None and tuple(got.shape[rows:]) != tuple(want.shape[rows:]):
            raise ValueError(
                f"{hf_dir}: the weights do not match config.json: {key} (converted from the HF tensor) has "
                f"shape {list(got.shape)}, but the model config.json describes needs {list(want.shape)}; fix "
                "config.json (e.g. n_positions / max_position_embeddings, n_inner / intermediate_size) to "
                "match the weights."
            )


def _hf_verifier(hf_dir: str | Path, cfg: ModelConfig, steps: int) -> Verify:
    """A :data:`Verify` comparing a written checkpoint with the HF model of ``hf_dir`` (loaded by transformers
    when called, offline)."""

    def verify(written: Path) -> LogitComparison:
        hf = load_hf_model(hf_dir)
        back, back_cfg, _ = read_checkpoint_weights(written)
        ours = build_megatron_model(back, verification_config(back_cfg))
        max_pos = cfg.max_position_embeddings or cfg.seq_length
        prompts, n = fixed_prompts(cfg.vocab_size, max_pos, steps)
        with torch.no_grad():
            return compare_logits(
                hf_logits_fn(hf), megatron_logits_fn(ours), prompts, n, vocab_size=cfg.vocab_size
            )

    return verify


def _transformers_error(hf_dir: str | Path, what: str, err: Exception) -> ValueError:
    text = str(err).strip().replace("\n", " ")
    return ValueError(
        f"transformers cannot load {what} of {hf_dir} ({type(err).__name__}: {text[:300]}); the verification "
        "compares the import with the HF model, so fix config.json (or pass --no-verify to import unverified)."
    )


def check_hf_config_loads(hf_dir: str | Path) -> None:
    """transformers accepts ``config.json`` (``AutoConfig``, offline): checked before anything is written when the
    import is to be verified.

    Raises:
        ValueError: one line naming the directory and transformers' complaint.
    """
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - transformers raises many types for a bad config
        raise _transformers_error(hf_dir, "config.json", err) from None


def load_hf_model(hf_dir: str | Path) -> torch.nn.Module:
    """The HF model of ``hf_dir`` (``AutoModelForCausalLM``, offline, fp32, eval).

    Raises:
        ValueError: transformers cannot load it (one line naming the directory and why).
    """
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - transformers raises many types for a bad directory
        raise _transformers_error(hf_dir, "the model", err) from None
    return model.float().eval()


def import_from_hf(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    layout: TargetLayout = TargetLayout(),
    verification: Verification | None = Verification(),
    progress: Progress = no_progress,
    say: Callable[[str], None] = logger.warning,
) -> LogitComparison | None:
    """Convert a local HF GPT-2/LLaMA/Qwen2/Qwen3/Mistral/Mixtral directory into a Trident checkpoint for ``layout.tp`` x
    ``layout.pp`` ranks (and a Mixtral's experts over ``layout.ep`` expert-parallel ranks: ``tp * pp * ep`` ranks
    write it, data-parallel size ``ep``).

    The checkpoint is written and verified in a staging directory beside ``out_dir`` and moved in only when the
    verification passes (:func:`megatron.conversion.rewrite.write_verified_checkpoint`): a failed import leaves
    ``out_dir`` as it was and keeps the unverified checkpoint in ``<out_dir>.unverified``.

    Returns:
        The HF-vs-written-checkpoint comparison (None without ``verification``).

    Raises:
        ValueError / FileNotFoundError: ``out_dir`` is a file or holds checkpoints, the model does not split over
            ``layout``, the HF directory is unreadable or unsupported, its weights do not fit its config.json, or
            (with ``verification``) transformers cannot load it. All before any rank is spawned, except
            transformers failing on the weights (then the written checkpoint is kept unverified, named).
    """
    check_new_save_dir(out_dir, load=hf_dir, load_flag="--hf-dir")
    if layout.tp < 1 or layout.pp < 1:
        raise ValueError(f"--tp ({layout.tp}) and --pp ({layout.pp}) must be >= 1.")
    full, cfg, hf_cfg = hf_to_full(hf_dir, layout.tp)
    check_target_layout(cfg, layout)
    check_weights_fit_config(full, cfg, hf_dir)
    if verification is not None:
        check_hf_config_loads(hf_dir)
    progress("converting", 1, 3)
    result = write_verified_checkpoint(
        StagedWrite(
            full,
            cfg,
            source=str(hf_dir),
            tokenizer=hf_dir_tokenizer(hf_dir),
            hf_model_type=hf_cfg.get("model_type"),
        ),
        out_dir,
        layout=layout,
        verify=None if verification is None else _hf_verifier(hf_dir, cfg, verification.steps),
        tolerance=None if verification is None else verification.tolerance,
        say=say,
    )
    progress("verifying", 3, 3)
    return result
