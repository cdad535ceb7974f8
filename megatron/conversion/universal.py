"""Trident checkpoint -> DeepSpeed universal checkpoint (resume at another TP / PP / DP with optimizer state).

``convert_to_universal(ckpt_dir)`` runs DeepSpeed's ``ds_to_universal`` on a complete tag (its client state holds
``universal_checkpoint_info``, saved by ``megatron.checkpointing.engine``) into ``{tag}_universal`` next to it, then:

- adds the other naming scheme for every parameter folder under ``zero/`` (symlinks): ``GPTModel`` (PP = 1) names
  ``language_model.encoder.layers.0...`` and ``GPTModelPipe`` (PP > 1) names ``2...`` / ``tied_modules.embed...``,
  so a PP = 1 checkpoint resumes at PP > 1 and back;
- writes ``trident_meta.json`` (``"universal": true``) and moves ``latest_universal`` atomically.

Training then resumes with ``--load DIR --universal-checkpoint`` (``latest_universal``, or --load-tag).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from megatron.checkpointing.meta import META_FILE, read_meta
from megatron.checkpointing.pointers import LATEST_UNIVERSAL_FILE, atomic_write, find_tag
from megatron.deepspeed_internals import ds_to_universal
from megatron.layout.names import pipe_layer_key, pipe_to_megatron_name


def _aliases(name: str, num_layers: int) -> list[str]:
    if name.startswith("language_model."):
        idx, local = pipe_layer_key(name, num_layers)
        out = [f"{idx}.{local}"]
        if idx == 1:
            out.append(f"tied_modules.embed.{local}")
        return out
    return [pipe_to_megatron_name(name, num_layers)]


def add_name_aliases(universal_dir: Path, num_layers: int) -> int:
    """Symlink every ``zero/<param>`` folder under its other-scheme names; returns how many were added."""
    zero = universal_dir / "zero"
    added = 0
    for folder in sorted(p for p in zero.iterdir() if p.is_dir() and not p.is_symlink()):
        try:
            names = _aliases(folder.name, num_layers)
        except ValueError:
            continue  # not a GPT parameter (left as is)
        for alias in names:
            target = zero / alias
            if not target.exists():
                os.symlink(folder.name, target)
                added += 1
    return added


def _check_has_optimizer_partitions(tag_dir: Path, meta: dict[str, Any]) -> None:
    """``ds_to_universal`` reads the ZeRO optimizer partitions (``*_optim_states.pt``): ZeRO stage >= 1 only.

    ``meta["zero_stage"]`` when recorded; checkpoints saved before it was, by the presence of those files.
    """
    stage = meta.get("zero_stage")
    if stage is None:
        has_partitions = any(tag_dir.glob("*_optim_states.pt"))
        what = "has no ZeRO optimizer partitions (*_optim_states.pt)"
    else:
        has_partitions = int(stage) >= 1
        what = f"was saved with ZeRO stage {int(stage)}"
    if not has_partitions:
        raise ValueError(
            f"{tag_dir} {what}: universal checkpoints are built from the ZeRO optimizer partitions, so they "
            "need a run saved with --zero-stage >= 1. To move just the weights to another layout use "
            "python -m tools.checkpoint.reshard."
        )


def convert_to_universal(ckpt_dir: str | Path, tag: str | None = None, *, workers: int = 1) -> str:
    """Write ``{tag}_universal`` (default tag: ``latest``) and point ``latest_universal`` at it; returns its tag.

    Raises:
        FileNotFoundError: no complete checkpoint (or ``tag`` is not one).
        ValueError: the checkpoint was saved with ZeRO stage 0, or lacks ``universal_checkpoint_info`` (saved by
            an older Trident).
    """
    root = Path(ckpt_dir)
    found = find_tag(root, tag)
    if found is None:
        raise FileNotFoundError(f"{root} holds no Trident checkpoint (no 'latest' file).")
    meta = read_meta(root, found)
    if meta.get("universal"):
        raise ValueError(f"{root / found} is already a universal checkpoint.")
    _check_has_optimizer_partitions(root / found, meta)
    out_tag = f"{found}_universal"
    out = root / out_tag
    if out.exists():
        shutil.rmtree(out)
    try:
        ds_to_universal(str(root / found), str(out), workers=workers)
    except AssertionError as err:
        raise ValueError(f"ds_to_universal refused {root / found}: {err}") from None
    add_name_aliases(out, int(meta["model"]["num_layers"]))
    meta["universal"] = True
    meta["universal_source_tag"] = found
    atomic_write(out / META_FILE, json.dumps(meta, indent=1, sort_keys=True) + "\n")
    atomic_write(root / LATEST_UNIVERSAL_FILE, out_tag)
    return out_tag
