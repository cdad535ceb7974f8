"""Trident checkpoint -> DeepSpeed universal checkpoint (resume at another TP / PP / DP with optimizer state).

``convert_to_universal(ckpt_dir)`` runs DeepSpeed's ``ds_to_universal`` on a complete tag (its client state holds
``universal_checkpoint_info``, saved by ``megatron.checkpointing.engine``) into ``{tag}_universal`` next to it, then:

- adds the other naming scheme for every parameter folder under ``zero/`` (symlinks): ``GPTModel`` (PP = 1) names
  ``language_model.encoder.layers.0...`` and ``GPTModelPipe`` (PP > 1) names ``2...`` / ``tied_modules.embed...``,
  so a PP = 1 checkpoint resumes at PP > 1 and back;
- writes ``trident_meta.json`` (``"universal": true``) and moves ``latest_universal`` atomically;
- writes the model's flags beside it (``model_args.sh``, ``megatron.checkpointing.model_args``).

Training then resumes with ``--load DIR --universal-checkpoint`` (``latest_universal``, or --load-tag). A plain
``--load`` of the regular checkpoint at the new layout does the same conversion on the way in
(``megatron.checkpointing.relayout``, which holds the converter steps shared with this module).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron.checkpointing.checksums import CHECKSUMS_KEY, checksums_of_tree
from megatron.checkpointing.meta import META_FILE, model_config_from_dict, read_meta
from megatron.checkpointing.model_args import write_model_args
from megatron.checkpointing.pointers import LATEST_UNIVERSAL_FILE, atomic_write, find_tag
from megatron.checkpointing.relayout import (
    add_name_aliases,
    check_converter_inputs,
    write_universal_form,
)


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


def refuse_moe_universal(model: dict, where: str) -> None:
    """One clear error for an MoE checkpoint: DeepSpeed 0.19.8's ``ds_to_universal`` converts AutoEP experts only,
    not the expert files of ``deepspeed.moe`` layers (``layer_*_expert_*_model_states.pt``).

    Raises:
        ValueError: ``model`` (the meta's saved ModelConfig) has MoE layers.
    """
    moe = model_config_from_dict(model).moe
    if moe.is_moe(int(model.get("num_layers", 1))):
        raise ValueError(
            f"{where} is a Mixture-of-Experts checkpoint (--num-experts {list(moe.num_experts)}): universal "
            "checkpoints are refused for MoE models (DeepSpeed 0.19.8's ds_to_universal does not convert "
            "deepspeed.moe expert files). Resume at the same layout, or reshard the weights with "
            "tools/checkpoint/reshard.py (iteration 0, no optimizer state)."
        )


def convert_to_universal(
    ckpt_dir: str | Path, tag: str | None = None, *, workers: int = 1, verify_checksums: bool = True
) -> str:
    """Write ``{tag}_universal`` (default tag: ``latest``) and point ``latest_universal`` at it; returns its tag.
    ``verify_checksums=False`` compares the source files' sizes only (``--no-verify-checkpoint-checksums``).

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
    refuse_moe_universal(meta.get("model", {}), str(root / found))
    _check_has_optimizer_partitions(root / found, meta)
    out_tag = f"{found}_universal"
    out = root / out_tag
    write_universal_form(root / found, out, meta, workers=workers, hashes=verify_checksums)
    meta["universal"] = True
    meta["universal_source_tag"] = found
    # ds_to_universal writes with torch.save directly: hashed by reading back (offline, once).
    meta[CHECKSUMS_KEY] = checksums_of_tree(out, skip=[META_FILE])
    atomic_write(out / META_FILE, json.dumps(meta, indent=1, sort_keys=True) + "\n")
    atomic_write(root / LATEST_UNIVERSAL_FILE, out_tag)
    write_model_args(root, out_tag)
    return out_tag


__all__ = [
    "add_name_aliases",
    "check_converter_inputs",
    "convert_to_universal",
    "refuse_moe_universal",
]
