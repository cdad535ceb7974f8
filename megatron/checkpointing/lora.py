"""LoRA checkpoints: adapters only, on top of a recorded base checkpoint (``--pretrained-checkpoint``).

A run with ``--lora-rank`` > 0 saves only the trainable parameters (the adapters; DeepSpeed's
``exclude_frozen_parameters``), the optimizer and scheduler state, and records in ``trident_meta.json`` which base
checkpoint the frozen weights came from::

    "lora_base": {"dir": "/abs/path/of/--pretrained-checkpoint", "tag": "global_step100", "iteration": 100}

(the LoRA settings are in ``"model"``, the ``ModelConfig`` with its ``lora`` field). :func:`read_lora_checkpoint`
gives the FULL (TP/PP-merged) adapter tensors and base weights of such a checkpoint, the layout
``megatron/model/lora.py`` documents (``lora_a [r, in]``, ``lora_b [out, r]``), for the exports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.readers import Progress, no_progress, read_checkpoint_weights
from megatron.config import ModelConfig
from megatron.model.lora import is_lora_parameter

LORA_BASE_KEY = "lora_base"
"""The ``trident_meta.json`` entry naming the base checkpoint of an adapter checkpoint."""


def lora_base_record(base_dir: str, tag: str, iteration: int) -> dict[str, Any]:
    """The :data:`LORA_BASE_KEY` entry of the meta of a run whose base is ``base_dir``/``tag``."""
    return {"dir": str(Path(base_dir).resolve()), "tag": tag, "iteration": int(iteration)}


def read_lora_checkpoint(
    ckpt_dir: str | Path,
    tag: str | None = None,
    *,
    verify_checksums: bool = True,
    progress: Progress = no_progress,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """``(adapters, base, config, meta)`` of an adapter checkpoint written by a LoRA run.

    Args:
        ckpt_dir: the run's --save directory; ``tag``: None for the one ``latest`` names.

    Returns:
        ``adapters``: every ``<linear>.lora_a`` ``[r, in]`` / ``<linear>.lora_b`` ``[out, r]`` merged over TP and
        PP (Megatron names); ``base``: the full state dict of the recorded base checkpoint (vocabulary rows
        padded as saved); ``config``: the ``ModelConfig`` (``config.lora`` has rank, alpha, targets; scaling
        ``config.lora.scaling``); ``meta``: the adapter checkpoint's ``trident_meta.json``.

    Raises:
        FileNotFoundError: no checkpoint, or the recorded base checkpoint is gone.
        ValueError: the checkpoint is not an adapter checkpoint (no LoRA in its meta).
    """
    saved, cfg, meta = read_checkpoint_weights(
        ckpt_dir, tag, progress, verify_checksums=verify_checksums
    )
    record = meta.get(LORA_BASE_KEY)
    if not cfg.lora.enabled or not isinstance(record, dict):
        raise ValueError(
            f"{ckpt_dir}: not a LoRA adapter checkpoint (its trident_meta.json has no --lora-rank and no "
            f"'{LORA_BASE_KEY}'); export it as a plain model instead."
        )
    adapters = {k: v for k, v in saved.items() if is_lora_parameter(k)}
    base_dir = Path(record["dir"])
    if not base_dir.is_dir():
        raise FileNotFoundError(
            f"{ckpt_dir}: the base checkpoint it was trained on, {base_dir} (tag {record['tag']}), is gone; "
            "restore it there (the adapters alone are not a model)."
        )
    base, _, _ = read_checkpoint_weights(
        base_dir, record["tag"], progress, verify_checksums=verify_checksums
    )
    return adapters, base, cfg, meta
