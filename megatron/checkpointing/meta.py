"""The schema of ``trident_meta.json``: what Trident records beside DeepSpeed's files in every checkpoint tag.

Written last by rank 0 (its presence marks the tag complete, see :mod:`megatron.checkpointing.pointers`)::

    {"version": 1, "iteration": N, "consumed_train_samples": ..., "consumed_valid_samples": ...,
     "model": {ModelConfig fields, vocab_size = the true vocabulary}, "padded_vocab_size": ...,
     "tensor_model_parallel_size": TP, "pipeline_model_parallel_size": PP, "world_size": W,
     "zero_stage": the stage DeepSpeed used, "precision": "fp32" | "bf16" | "fp16",
     "moe_expert_parallel_size": EP                                    (MoE models, since issue #35)
     "tokenizer": {megatron.tokenizer.info.tokenizer_info}}          (when the run had a tokenizer type)
    plus, from the converters: "weights_only": true, "converted_from": ..., "universal": true (to_universal).

Plain JSON: reading it never executes pickled code.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megatron.config import DataConfig, ModelConfig
from megatron.model.language_model import has_learned_positions
from megatron.tokenizer.info import tokenizer_info

META_FILE = "trident_meta.json"
META_VERSION = 1

SHAPE_FIELDS = (
    "num_layers",
    "moe_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "ffn_size",
    "max_positions",
    "normalization",
    "swiglu",
    "use_rotary_position_embeddings",
    "rotary_percent",
    "add_position_embedding",
    "apply_layernorm_1p",
    "add_bias_linear",
    "qkv_bias",
    "qk_layernorm",
    "untie_embeddings_and_output_weights",
    "vocab_size",
)
"""Resolved ModelConfig values that determine parameter names and shapes (a checkpoint must agree on all of them;
``max_positions`` only with learned positions)."""


def read_meta(load_dir: str | Path, tag: str) -> dict[str, Any]:
    """The ``trident_meta.json`` of a checkpoint (plain JSON, safe to read).

    Raises:
        ValueError: the file is not a JSON object (damaged): one line naming it.
    """
    path = Path(load_dir) / tag / META_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(
            f"{path} is not valid JSON ({err}): the checkpoint's meta is damaged; restore it from a good copy "
            "or --load-tag another checkpoint."
        ) from None
    if not isinstance(meta, dict):
        raise ValueError(
            f"{path} holds a JSON {type(meta).__name__}, not an object; it is damaged."
        )
    return meta


def tokenizer_record(data: DataConfig, fingerprint: str | None = None) -> dict[str, str] | None:
    """The ``"tokenizer"`` entry a run records (``tokenizer_info`` of its tokenizer flags), None without
    --tokenizer-type. ``fingerprint``: ``megatron.tokenizer.encoding_fingerprint`` of the run's tokenizer."""
    return tokenizer_info(
        tokenizer_type=data.tokenizer_type,
        vocab_file=data.vocab_file,
        merge_file=data.merge_file,
        tokenizer_model=data.tokenizer_model,
        fingerprint=fingerprint,
    )


def model_config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """A ``ModelConfig`` from its saved ``dataclasses.asdict`` form (unknown keys ignored)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in fields})


def model_config_from_meta(meta: dict[str, Any]) -> ModelConfig:
    """The ``ModelConfig`` saved in a checkpoint's ``trident_meta.json``."""
    return model_config_from_dict(meta["model"])


def model_mismatches(saved: dict[str, Any], current: ModelConfig) -> list[str]:
    """``"field: checkpoint X, flags Y"`` for every :data:`SHAPE_FIELDS` value that differs."""
    theirs_cfg = model_config_from_dict(saved)
    learned_mine, learned_theirs = has_learned_positions(current), has_learned_positions(theirs_cfg)
    out = []
    for name in SHAPE_FIELDS:
        if name == "max_positions" and not (learned_mine or learned_theirs):
            continue
        mine, theirs = getattr(current, name), getattr(theirs_cfg, name)
        if name == "add_position_embedding":  # with rotary there is no table whatever the flag says
            mine, theirs = learned_mine, learned_theirs
        if theirs != mine:
            out.append(f"{name}: checkpoint {theirs!r}, flags {mine!r}")
    return out


def check_model_matches(load_dir: str, tag: str, current: ModelConfig) -> dict[str, Any]:
    """Read the checkpoint's meta and refuse a model whose shape disagrees with the flags.

    Raises:
        ValueError: listing every differing field.
    """
    meta = read_meta(load_dir, tag)
    diffs = model_mismatches(meta["model"], current)
    if diffs:
        raise ValueError(
            f"--load {load_dir} (tag {tag}): the checkpoint's model differs from the flags in "
            f"{len(diffs)} field(s): " + "; ".join(diffs) + ". Pass the checkpoint's model flags "
            "(or --load another checkpoint)."
        )
    return meta


def check_universal_kind(meta: dict[str, Any], universal: bool, load_dir: str, tag: str) -> None:
    """A universal checkpoint is loaded with --universal-checkpoint, and only such a one.

    Raises:
        ValueError: naming the flag to add or the conversion to run.
    """
    if bool(meta.get("universal", False)) != universal:
        raise ValueError(
            f"--load {load_dir} (tag {tag}): "
            + (
                "this is a universal checkpoint; add --universal-checkpoint."
                if not universal
                else "--universal-checkpoint needs a universal checkpoint; convert this one with "
                f"python -m tools.checkpoint.to_universal --load {load_dir}"
            )
        )
