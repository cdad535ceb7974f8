"""Reading a Trident checkpoint's weights back: any TP/PP layout and ZeRO stage, merged into the full model.

A "Trident checkpoint" is the directory training writes with --save (``engine.py``). Reading its weights needs no
pickle execution: DeepSpeed's model-state files hold only tensors and plain containers, so
``torch.load(weights_only=True)`` reads them.

- PP = 1: ``mp_rank_{tp:02d}_model_states.pt``, key ``module`` (Megatron names);
- PP > 1: ``layer_{idx:02d}-model_{tp:02d}-model_states.pt`` (``megatron.layout.names``; the tied head is not saved);
- ZeRO-3 (PP = 1): the fp32 partitions in ``zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt`` (``zero3.py``);
- DeepSpeed-MoE models: the experts from DeepSpeed's expert files, the rest as above or, under a pipeline, from
  ``mp_rank_{stage*tp+tp:02d}_model_states.pt`` (``moe_files.py``).

TP shards are merged with ``megatron.layout.tensor_parallel.merge_tp_shards``; the architecture comes from
``trident_meta.json``. Used by the offline conversions (``megatron.conversion``) and by text generation.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.checksums import CHECKSUMS_KEY, verify_checkpoint_files
from megatron.checkpointing.meta import model_config_from_meta, read_meta
from megatron.checkpointing.moe_files import read_expert_weights, read_moe_pipe_tp_rank
from megatron.checkpointing.pointers import find_tag
from megatron.checkpointing.safe_load import torch_load_checkpoint_file
from megatron.checkpointing.weights_only import read_tp_rank_weights
from megatron.checkpointing.zero3 import is_zero3_checkpoint
from megatron.config import ModelConfig
from megatron.layout.experts import moe_partition
from megatron.layout.pipeline import pipe_layers_to_megatron
from megatron.layout.tensor_parallel import merge_tp_shards
from megatron.layout.vocab import pad_vocab_for_tp
from megatron.model import GPTModel
from megatron.mpu.context import ParallelContext

Progress = Callable[[str, int, int], None]
"""``progress(what, done, total)``: called as a read or a conversion advances (the CLIs draw a bar)."""

_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")


@dataclass(frozen=True)
class CheckpointRead:
    """Which tag of a checkpoint directory a tool reads, and how its files are checked."""

    tag: str | None = None
    """The tag (``--tag``); None: the one ``latest`` names."""
    verify_checksums: bool = True
    """Compare every file read with its SHA-256 recorded at save; False: its size only
    (``--no-verify-checkpoint-checksums``)."""


def no_progress(what: str, done: int, total: int) -> None:
    """A :data:`Progress` that reports nothing."""
    return None


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
    ckpt_dir: str | Path,
    tag: str | None = None,
    progress: Progress = no_progress,
    *,
    verify_checksums: bool = True,
) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """Full (TP = 1, PP = 1) Megatron state dict of a Trident checkpoint, its ``ModelConfig`` and meta.

    The vocabulary rows stay padded (to the saving run's padding); ``ModelConfig.vocab_size`` is the true size.
    Every file read is compared with the size and SHA-256 recorded at save; ``verify_checksums=False`` compares
    the sizes only (``--no-verify-checkpoint-checksums``).

    Raises:
        FileNotFoundError: no checkpoint in ``ckpt_dir`` or a model-state file is missing.
        ValueError: a file cannot be read safely, differs from its checksum recorded at save, or its contents
            disagree.
    """
    root = Path(ckpt_dir)
    found, cfg, meta = read_checkpoint_config(root, tag)
    tp = int(meta["tensor_model_parallel_size"])
    pp = int(meta["pipeline_model_parallel_size"])
    tag_dir = root / found
    zero3 = is_zero3_checkpoint(tag_dir, meta)
    recorded = (meta.get(CHECKSUMS_KEY) or {}).get("files", {})
    verify_checkpoint_files(
        tag_dir,
        meta,
        [n for n in recorded if n.endswith("_model_states.pt") or (zero3 and "optim_states" in n)],
        hashes=verify_checksums,
    )
    moe = cfg.moe.is_moe(cfg.num_layers)
    shards: list[dict[str, torch.Tensor]] = []
    if moe and pp > 1:
        shards = [read_moe_pipe_tp_rank(tag_dir, cfg, r, tp=tp, pp=pp) for r in range(tp)]
    elif pp == 1:
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
    # The model-state files hold no expert (they are in the expert files): the expert rule does not matter here.
    rule = moe_partition(cfg, expert_tensor_parallel=False) if moe else None
    full = merge_tp_shards(shards, cfg, partition=rule) if tp > 1 else shards[0]
    if moe:
        full.update(read_expert_weights(tag_dir, cfg, tp=tp, pp=pp, progress=progress))
    return full, cfg, meta


def build_megatron_model(full: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.nn.Module:
    """A TP = 1 ``GPTModel`` (eval mode, fp32) holding ``full`` (re-padded to TP = 1 rows)."""
    model = GPTModel(cfg, ParallelContext(seed=0)).eval()
    model.load_state_dict(pad_vocab_for_tp(full, cfg, 1), strict=True)
    return model
