"""One rank's share of a Trident checkpoint for generation at a TP x PP layout, without merging the model.

A rank at TP rank ``r`` of ``p`` on pipeline stage ``k`` needs only the tensors of its stage
(:func:`stage_keys`), as its TP shard. What it reads:

- the checkpoint was saved at the same TP size: only TP rank ``r``'s files (``mp_rank_{r:02d}_model_states.pt`` at
  PP = 1, ZeRO-3's fp32 partitions of rank ``r``; at PP > 1 only the layer files ``layer_{idx}-model_{r:02d}`` of
  the stage's layers);
- another TP size: every TP rank's files of the stage (PP > 1: only its layer files), merged on the fly for those
  tensors alone and cut to this rank's shard (vocabulary rows re-padded for ``p``). The peak is then the stage's
  full tensors; reshard offline (``tools/convert_checkpoint.py``) for a model whose stage does not fit.

DeepSpeed-MoE models: the stage's whole experts come from DeepSpeed's expert files (any saved EP/TP layout; the
generation model holds every expert, EP = 1), the rest as above or, for a pipelined MoE checkpoint (no layer files),
from the stages' ``mp_rank_XX_model_states.pt`` (``moe_files.py``).

Every file read is checked against the checksums recorded at save (when the checkpoint has them).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.checksums import CHECKSUMS_KEY, verify_checkpoint_files
from megatron.checkpointing.moe_files import (
    EXPERT_FILE,
    read_expert_weights,
    read_moe_pipe_tp_rank,
)
from megatron.checkpointing.safe_load import torch_load_checkpoint_file
from megatron.checkpointing.weights_only import read_tp_rank_weights
from megatron.checkpointing.zero3 import is_zero3_checkpoint
from megatron.config import ModelConfig
from megatron.layout.experts import moe_partition
from megatron.layout.names import (
    EMBEDDING_PREFIX,
    FINAL_NORM,
    OUTPUT_LAYER,
    WORD_EMBEDDINGS,
    layer_prefix,
    pipe_layer_file_name,
)
from megatron.layout.pipeline import pipe_layers_to_megatron
from megatron.layout.tensor_parallel import merge_tp_shards, shard_state_dict
from megatron.layout.vocab import pad_vocab_for_tp

Progress = Callable[[str, int, int], None]


def stage_keys(
    key: str,
    config: ModelConfig,
    *,
    layers: tuple[int, int],
    pre_process: bool,
    post_process: bool,
) -> bool:
    """Whether the Megatron parameter ``key`` belongs to the stage (layers ``[start, stop)``, embedding on the
    first stage, final norm and output weights on the last; the tied word embeddings on both)."""
    tied = not config.untie_embeddings_and_output_weights
    if key == WORD_EMBEDDINGS:
        return pre_process or (post_process and tied)
    if key.startswith(EMBEDDING_PREFIX + "."):
        return pre_process
    if key.startswith(FINAL_NORM + ".") or key == OUTPUT_LAYER:
        return post_process
    return any(key.startswith(layer_prefix(i) + ".") for i in range(*layers))


def _pipe_layer_indices(
    config: ModelConfig, layers: tuple[int, int], pre_process: bool, post_process: bool
) -> list[int]:
    """The ``GPTModelPipe`` spec indices whose files hold the stage's tensors."""
    num = config.num_layers
    idx = [i + 2 for i in range(*layers)]
    if pre_process or (post_process and not config.untie_embeddings_and_output_weights):
        idx.insert(0, 1)
    if post_process:
        idx.append(num + 2)
        if config.untie_embeddings_and_output_weights:
            idx.append(num + 3)
    return idx


def _read_rank(
    tag_dir: Path,
    meta: dict[str, Any],
    config: ModelConfig,
    rank: int,
    wanted: Callable[[str], bool],
    pipe_indices: list[int],
) -> dict[str, torch.Tensor]:
    """TP rank ``rank``'s tensors of the stage (fp32, checkpoint's TP-local shapes and vocab padding)."""
    recorded = (meta.get(CHECKSUMS_KEY) or {}).get("files", {})
    saved_pp = int(meta["pipeline_model_parallel_size"])
    if (
        config.moe.is_moe(config.num_layers) and saved_pp > 1
    ):  # no layer files: per-stage mp_rank files
        tp = int(meta["tensor_model_parallel_size"])
        names = [f"mp_rank_{s * tp + rank:02d}_model_states.pt" for s in range(saved_pp)]
        verify_checkpoint_files(tag_dir, meta, [n for n in names if n in recorded])
        out = read_moe_pipe_tp_rank(tag_dir, config, rank, tp=tp, pp=saved_pp)
        return {k: v for k, v in out.items() if wanted(k)}
    if saved_pp == 1:
        if not is_zero3_checkpoint(tag_dir, meta):
            name = f"mp_rank_{rank:02d}_model_states.pt"
            verify_checkpoint_files(tag_dir, meta, [name] if name in recorded else [])
        else:
            names = [n for n in recorded if "optim_states" in n and f"mp_rank_{rank:02d}" in n]
            verify_checkpoint_files(tag_dir, meta, names)
        full = read_tp_rank_weights(tag_dir, meta, rank)
        return {k: v for k, v in full.items() if wanted(k)}
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    for idx in pipe_indices:
        name = pipe_layer_file_name(idx, rank)
        path = tag_dir / name
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing (checkpoint saved at TP = {meta['tensor_model_parallel_size']}, PP = "
                f"{meta['pipeline_model_parallel_size']}); copy the whole checkpoint directory."
            )
        verify_checkpoint_files(tag_dir, meta, [name] if name in recorded else [])
        sd = torch_load_checkpoint_file(path)
        per_layer[idx] = {k: v.float() for k, v in sd.items()}
    out = pipe_layers_to_megatron(per_layer, config.num_layers)
    return {k: v for k, v in out.items() if wanted(k)}


def read_stage_weights(
    tag_dir: Path,
    meta: dict[str, Any],
    config: ModelConfig,
    *,
    tp: int,
    tp_rank: int,
    layers: tuple[int, int],
    pre_process: bool,
    post_process: bool,
) -> dict[str, torch.Tensor]:
    """TP rank ``tp_rank`` of ``tp``'s shard of one pipeline stage's tensors (Megatron names, fp32, vocabulary rows
    padded for ``tp``), read from the checkpoint ``tag_dir`` (any saved TP/PP/ZeRO layout).

    Raises:
        FileNotFoundError: a file of the stage is missing.
        ValueError: a file cannot be read safely or differs from its checksum; the stage's tensors are
            incomplete.
    """

    def wanted(key: str) -> bool:
        return stage_keys(
            key, config, layers=layers, pre_process=pre_process, post_process=post_process
        )

    saved_tp = int(meta["tensor_model_parallel_size"])
    indices = _pipe_layer_indices(config, layers, pre_process, post_process)
    moe = config.moe.is_moe(config.num_layers)
    # MoE: the router is replicated; the experts (whole, EP = 1 here) come from DeepSpeed's expert files.
    rule = moe_partition(config, expert_tensor_parallel=False) if moe else None
    experts = _stage_experts(tag_dir, meta, config, wanted) if moe else {}
    if saved_tp == tp:
        return {**_read_rank(tag_dir, meta, config, tp_rank, wanted, indices), **experts}
    shards = [_read_rank(tag_dir, meta, config, r, wanted, indices) for r in range(saved_tp)]
    full = merge_tp_shards(shards, config, partition=rule) if saved_tp > 1 else shards[0]
    del shards
    padded = pad_vocab_for_tp(full, config, tp)
    return {**shard_state_dict(padded, config, tp, tp_rank, partition=rule), **experts}


def _stage_experts(
    tag_dir: Path, meta: dict[str, Any], config: ModelConfig, wanted: Callable[[str], bool]
) -> dict[str, torch.Tensor]:
    """The whole experts (global ids) of the stage's MoE layers, from DeepSpeed's expert files (checksummed)."""
    recorded = (meta.get(CHECKSUMS_KEY) or {}).get("files", {})
    verify_checkpoint_files(tag_dir, meta, [n for n in recorded if EXPERT_FILE.search(n)])
    experts = read_expert_weights(
        tag_dir,
        config,
        tp=int(meta["tensor_model_parallel_size"]),
        pp=int(meta["pipeline_model_parallel_size"]),
    )
    return {k: v for k, v in experts.items() if wanted(k)}
