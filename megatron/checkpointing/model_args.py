"""The model flags of a checkpoint: read for ``--use-checkpoint-args``, written as ``model_args.sh`` beside it.

``read_checkpoint_model`` is the :data:`megatron.config.checkpoint_args.ModelReader` that ``pretrain_gpt.py``
passes to ``parse_args``: it finds the tag the load would use (``latest``, ``--load-tag``, ``latest_universal``)
and returns the ``"model"`` record of its ``trident_meta.json`` (plain JSON).

``write_model_args`` writes, beside the ``latest`` pointer of a converted checkpoint, the flags that give its
model (``megatron.config.checkpoint_args.model_flags``) as a bash array a launch script sources or pastes::

    source ckpt/model_args.sh
    python pretrain_gpt.py "${MODEL_ARGS[@]}" --load ckpt --finetune --seq-length 4096 ...
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from megatron.checkpointing.meta import META_FILE, model_config_from_meta, read_meta
from megatron.checkpointing.pointers import atomic_write, find_checkpoint, find_tag
from megatron.config.checkpoint_args import CheckpointModel, model_flags

MODEL_ARGS_FILE = "model_args.sh"
"""Written by the converters into the checkpoint directory (beside ``latest``)."""

_FLAG = "--use-checkpoint-args"


def read_checkpoint_model(load: str, load_tag: str | None, universal: bool) -> CheckpointModel:
    """The model record of the checkpoint that ``--load load`` (``--load-tag``, ``--universal-checkpoint``) loads.

    Raises:
        ValueError: one line: --load is not a directory or holds no checkpoint, the tag is missing or
            incomplete, the meta is unreadable, damaged or has no model record.
    """
    root = Path(load)
    if not root.is_dir():
        raise ValueError(
            f"{_FLAG}: --load {load} is not a directory; point it at a checkpoint directory (one holding "
            "'latest', e.g. from tools/checkpoint/hf_to_trident.py)."
        )
    try:
        tag = find_checkpoint(load, load_tag, universal=universal)
    except FileNotFoundError as err:
        raise ValueError(f"{_FLAG}: {err}") from None
    if tag is None:
        raise ValueError(
            f"{_FLAG}: --load {load} holds no checkpoint (no 'latest'), so there is no model to take; point "
            "--load at a converted or saved checkpoint, or drop --use-checkpoint-args and pass the model flags."
        )
    path = root / tag / META_FILE
    try:
        meta = read_meta(root, tag)
    except OSError as err:
        raise ValueError(
            f"{_FLAG}: cannot read {path} ({err.strerror or err}); check its permissions."
        ) from None
    model = meta.get("model")
    if not isinstance(model, dict):
        raise ValueError(
            f'{_FLAG}: {path} has no "model" record, so the checkpoint\'s model is unknown; pass the model '
            "flags instead of --use-checkpoint-args."
        )
    return CheckpointModel(model=model, source=str(path))


def render_model_args(flags: list[str], *, tag: str, source: str | None) -> str:
    """The text of ``model_args.sh``: a comment saying what it is, then ``MODEL_ARGS=(...)``, one flag (with its
    values, shell-quoted) per line."""
    lines, i = [], 0
    while i < len(flags):
        j = i + 1
        while j < len(flags) and not flags[j].startswith("--"):
            j += 1
        lines.append("  " + " ".join(shlex.quote(w) for w in flags[i:j]))
        i = j
    origin = f", converted from {source}" if source else ""
    return (
        f"# The model flags of the Trident checkpoint in this directory ({tag}{origin}).\n"
        "# Written by Trident's checkpoint converters. Paste them into a launch script, or source this file:\n"
        '#   source DIR/model_args.sh && python pretrain_gpt.py "${MODEL_ARGS[@]}" --load DIR ...\n'
        "# (pretrain_gpt.py --use-checkpoint-args --load DIR takes the same model from trident_meta.json.)\n"
        "# --seq-length is the run's choice and not listed.\n"
        "MODEL_ARGS=(\n" + "".join(f"{ln}\n" for ln in lines) + ")\n"
    )


def write_model_args(ckpt_dir: str | Path, tag: str | None = None) -> Path:
    """Write ``ckpt_dir/model_args.sh`` for the checkpoint ``tag`` (default: the one ``latest`` names); returns
    its path.

    Raises:
        FileNotFoundError / ValueError: no such complete checkpoint in ``ckpt_dir`` (``pointers.find_tag``).
    """
    root = Path(ckpt_dir)
    found = find_tag(root, tag)
    if found is None:
        raise FileNotFoundError(
            f"{root} holds no checkpoint (no 'latest') to write model flags for."
        )
    meta: dict[str, Any] = read_meta(root, found)
    text = render_model_args(
        model_flags(model_config_from_meta(meta)), tag=found, source=meta.get("converted_from")
    )
    path = root / MODEL_ARGS_FILE
    atomic_write(path, text)
    return path
