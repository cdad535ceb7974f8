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

from megatron.checkpointing.checksums import sizes_only
from megatron.checkpointing.meta import model_mismatches, read_meta
from megatron.checkpointing.pointers import find_checkpoint, find_tag
from megatron.checkpointing.readers import Progress, no_progress, read_checkpoint_weights
from megatron.checkpointing.stage_reader import read_stage_weights
from megatron.config import CheckpointConfig, ModelConfig, RunPlan
from megatron.layout.names import pipe_to_megatron_name
from megatron.layout.pipeline import split_layers_for_pp
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


def _base_tag(base_dir: str) -> tuple[str, dict[str, Any]]:
    """The tag ``latest`` names in the base checkpoint and its meta (checked: a full, non-LoRA checkpoint)."""
    tag = find_tag(base_dir, None, tag_flag="--load-tag") if Path(base_dir).is_dir() else None
    if tag is None:
        raise FileNotFoundError(
            f"--pretrained-checkpoint {base_dir} holds no Trident checkpoint (no 'latest' file); point it at the "
            "--save directory of the base model's run (or of tools/checkpoint/hf_to_trident.py)."
        )
    meta = read_meta(base_dir, tag)
    if LORA_BASE_KEY in meta:
        raise ValueError(
            f"--pretrained-checkpoint {base_dir} (tag {tag}) is itself a LoRA adapter checkpoint; give its base, "
            "or merge the adapters first (the merged export)."
        )
    return tag, meta


def _checked_base(base_dir: str, model: ModelConfig) -> tuple[str, dict[str, Any]]:
    """:func:`_base_tag`, and the base's architecture is the flags' (one line listing every difference)."""
    tag, meta = _base_tag(base_dir)
    diffs = model_mismatches(meta["model"], model)
    if diffs:
        raise ValueError(
            f"--pretrained-checkpoint {base_dir} (tag {tag}): the base model differs from the flags in "
            + "; ".join(diffs)
            + ". Pass the base model's architecture flags."
        )
    return tag, meta


_SAME_LAYOUT = (
    ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ("world_size", "world size"),
    ("zero_stage", "--zero-stage"),
)
"""What an adapter checkpoint must be resumed at: the layout it was saved at (no relayout of adapter-only files)."""


def _check_same_layout(meta: dict[str, Any], plan: RunPlan, where: str) -> None:
    for key, words in _SAME_LAYOUT:
        saved, run = meta.get(key), getattr(plan, key)
        if saved is not None and int(saved) != int(run):
            raise ValueError(
                f"{where} was saved at {words} {saved}, this run has {run}: an adapter checkpoint resumes at the "
                "layout it was saved at; run at that layout (or export the merged model and start anew)."
            )


def check_lora_start(checkpoint: CheckpointConfig, model: ModelConfig, plan: RunPlan) -> None:
    """Preflight of a LoRA run (before any process group, identical on every rank): the base checkpoint exists
    and has the model's shape; a checkpoint in --load is an adapter checkpoint of the same LoRA settings and base,
    saved at this run's layout (``plan``).

    Raises:
        FileNotFoundError / ValueError: one line naming the flag, the directory and the fix.
    """
    base_dir = checkpoint.pretrained_checkpoint or ""
    tag, meta = _checked_base(base_dir, model)
    if not checkpoint.load:
        return
    load_tag = find_checkpoint(
        checkpoint.load, checkpoint.load_tag, universal=checkpoint.universal_checkpoint
    )
    if load_tag is not None:
        base = lora_base_record(base_dir, tag, int(meta.get("iteration", 0)))
        where = f"--load {checkpoint.load} (tag {load_tag})"
        load_meta = read_meta(checkpoint.load, load_tag)
        check_adapter_resume(load_meta, model, base, where)
        _check_same_layout(load_meta, plan, where)


def load_lora_base(
    module: torch.nn.Module,
    base_dir: str,
    model: ModelConfig,
    *,
    tp: tuple[int, int],
    pp: tuple[int, int],
    verify_checksums: bool = True,
) -> dict[str, Any]:
    """Copy this rank's share of the base weights of ``base_dir`` (any saved TP/PP/ZeRO-0-2 layout) into every
    non-LoRA parameter of ``module`` (a ``GPTModel`` or a ``GPTModelPipe`` stage, before any training step; the
    frozen parameters have no optimizer copy to update).

    Args:
        model: the run's model config (true vocabulary): the base must have the same shape.
        tp, pp: ``(size, rank)`` of this rank's tensor- and pipeline-parallel groups.

    Returns:
        The :data:`LORA_BASE_KEY` record for the run's checkpoints.

    Raises:
        FileNotFoundError / ValueError: no base there, another model shape, a damaged file (one line each).
    """
    tag, meta = _checked_base(base_dir, model)
    layers = split_layers_for_pp(model.num_layers, pp[0])[pp[1]]
    weights = read_stage_weights(
        Path(base_dir) / tag,
        meta if verify_checksums else sizes_only(meta),
        model,
        tp=tp[0],
        tp_rank=tp[1],
        layers=layers,
        pre_process=pp[1] == 0,
        post_process=pp[1] == pp[0] - 1,
    )
    for name, param in module.named_parameters():
        if is_lora_parameter(name):
            continue
        # GPTModel's names are Megatron's; GPTModelPipe's ("3.self_attention...", "tied_modules...") are mapped
        pipe = not name.startswith("language_model.")
        key = pipe_to_megatron_name(name, model.num_layers) if pipe else name
        value = weights.get(key)
        if value is None or tuple(value.shape) != tuple(param.shape):
            got = "nothing" if value is None else f"shape {tuple(value.shape)}"
            raise ValueError(
                f"--pretrained-checkpoint {base_dir} (tag {tag}) has {got} for {key} (the model: "
                f"{tuple(param.shape)}); is it this model's checkpoint (same --make-vocab-size-divisible-by)?"
            )
        with torch.no_grad():
            param.copy_(value.to(dtype=param.dtype, device=param.device))
    return lora_base_record(base_dir, tag, int(meta.get("iteration", 0)))


def check_adapter_resume(
    meta: dict[str, Any], model: ModelConfig, base: dict[str, Any] | None, where: str
) -> None:
    """An adapter checkpoint ``meta`` (at ``where``: ``--load DIR (tag T)``) may be resumed by this LoRA run:
    same LoRA settings and the same base checkpoint.

    Raises:
        ValueError: a full checkpoint, other LoRA settings or another base (one line naming both).
    """
    saved_base = meta.get(LORA_BASE_KEY)
    if not isinstance(saved_base, dict):
        raise ValueError(
            f"{where} is a full checkpoint, not a LoRA adapter checkpoint; with --lora-rank give it as "
            "--pretrained-checkpoint and --load the directory the adapters are saved to."
        )
    saved = ModelConfig(**{"lora": meta["model"].get("lora", {})}).lora
    if saved != model.lora:
        raise ValueError(
            f"{where} holds adapters with {saved}, the flags ask for {model.lora}; pass its --lora-* flags."
        )
    if base is not None and (saved_base.get("dir"), saved_base.get("tag")) != (
        base["dir"],
        base["tag"],
    ):
        raise ValueError(
            f"{where} was trained on the base {saved_base.get('dir')} (tag {saved_base.get('tag')}), this run's "
            f"--pretrained-checkpoint is {base['dir']} (tag {base['tag']}); give the base it was trained on."
        )


def read_stage_lora_base(
    ckpt_dir: str | Path,
    meta: dict[str, Any],
    config: ModelConfig,
    *,
    tp: tuple[int, int],
    layers: tuple[int, int],
    pre_process: bool,
    post_process: bool,
    verify_checksums: bool = True,
) -> dict[str, torch.Tensor]:
    """The frozen base weights of one pipeline stage at TP ``tp = (size, rank)`` for the adapter checkpoint
    ``ckpt_dir`` whose ``trident_meta.json`` is ``meta`` (its :data:`LORA_BASE_KEY` names the base directory and tag); ``{}`` for a
    full checkpoint. Generation and evaluation load the adapters over these (a LoRA model, unmerged).

    Raises:
        FileNotFoundError: the recorded base checkpoint is gone. ValueError: a damaged file of it.
    """
    record = meta.get(LORA_BASE_KEY)
    if not config.lora.enabled or not isinstance(record, dict):
        return {}
    base_dir, tag = Path(record["dir"]), str(record["tag"])
    if not (base_dir / tag).is_dir():
        raise FileNotFoundError(
            f"{ckpt_dir}: this LoRA adapter checkpoint was trained on the base {base_dir} (tag {tag}), which is "
            "gone; restore it there (the adapters alone are not a model)."
        )
    base_meta = read_meta(base_dir, tag)
    return read_stage_weights(
        base_dir / tag,
        base_meta if verify_checksums else sizes_only(base_meta),
        config,
        tp=tp[0],
        tp_rank=tp[1],
        layers=layers,
        pre_process=pre_process,
        post_process=post_process,
    )
