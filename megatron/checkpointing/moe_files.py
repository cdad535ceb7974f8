"""Reading DeepSpeed-MoE checkpoints: the expert files, and the model-state files that then replace the pipeline
layer files, merged into the full model (global expert ids).

What DeepSpeed 0.19.8 writes for a model with ``deepspeed.moe.layer.MoE`` layers (``engine._save_moe_checkpoint``;
``mp`` = the engine's ``checkpoint_mp_rank``: the TP rank, or ``stage * p + tp_rank`` under a pipeline)::

    mp_rank_{mp:02d}_model_states.pt      written by data-parallel rank 0: ``module`` = every parameter but the
                                          experts (the router ``gate.wg`` stays here), ``num_experts`` (a list, one
                                          entry per MoE layer), the client state. Under a pipeline the module holds
                                          the stage's ``GPTModelPipe`` names and NO layer files are written.
    layer_{l}_expert_{e}_mp_rank_{mp:02d}_model_states.pt
                                          one per (MoE layer, expert), written by expert-data-parallel rank 0 of the
                                          rank holding it: ``l`` counts the MoE layers of the saving module (per
                                          stage under a pipeline), ``e`` is the GLOBAL expert id and the keys carry
                                          it too (``...deepspeed_experts.{e}.dense_h_to_4h.weight``).
    expp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt   ZeRO-0: the optimizer state of EP rank ``r``;
    zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt  ZeRO-1/2 (as for dense models).

An expert may be in several files (one per TP rank holding it): whole copies (compared, one kept) or, with
``--enable-expert-tensor-parallelism``, TP shards (merged by ``megatron.layout.experts.moe_partition``; told apart by
their shape). Every file read was checked against the checksums recorded at save by the caller.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from megatron.checkpointing.safe_load import torch_load_checkpoint_file
from megatron.config import ModelConfig
from megatron.layout.experts import expert_id, moe_partition
from megatron.layout.names import pipe_to_megatron_name

Progress = Callable[[str, int, int], None]

EXPERT_FILE = re.compile(r"(?:layer_(\d+)_)?expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
"""DeepSpeed's expert file names (``layer_{l}_`` absent in checkpoints older than DeepSpeed 0.6)."""


def expert_file_name(moe_layer: int, global_expert: int, mp_rank: int) -> str:
    """``layer_{l}_expert_{e}_mp_rank_{mp:02d}_model_states.pt`` (DeepSpeed's ``_get_expert_ckpt_name``)."""
    return f"layer_{moe_layer}_expert_{global_expert}_mp_rank_{mp_rank:02d}_model_states.pt"


def has_expert_files(tag_dir: Path) -> bool:
    """Whether the checkpoint tag holds DeepSpeed-MoE expert files."""
    return any(EXPERT_FILE.search(p.name) for p in tag_dir.glob("*expert_*_model_states.pt"))


def _full_shape(key: str, config: ModelConfig) -> tuple[int, ...]:
    f, h = config.ffn_size, config.hidden_size
    rows = 2 * f if config.swiglu else f
    if key.endswith("dense_h_to_4h.weight"):
        return (rows, h)
    if key.endswith("dense_h_to_4h.bias"):
        return (rows,)
    if key.endswith("dense_4h_to_h.weight"):
        return (h, f)
    return (h,)


def read_expert_weights(
    tag_dir: Path,
    config: ModelConfig,
    *,
    tp: int,
    pp: int,
    progress: Progress | None = None,
) -> dict[str, torch.Tensor]:
    """Every expert tensor of the checkpoint tag (fp32, Megatron names, global ids, whole experts).

    Raises:
        FileNotFoundError: the tag has no expert file, or an expert lacks a TP shard.
        ValueError: a file cannot be read safely, copies of an expert differ, or an expert is missing.
    """
    files = [
        (p, m)
        for p in sorted(tag_dir.glob("*expert_*_model_states.pt"))
        if (m := EXPERT_FILE.search(p.name))
    ]
    if not files:
        raise FileNotFoundError(
            f"{tag_dir} has no DeepSpeed-MoE expert files (layer_*_expert_*_mp_rank_*_model_states.pt) although "
            "its model has MoE layers; copy the whole checkpoint directory."
        )
    copies: dict[str, dict[int, torch.Tensor]] = {}
    for i, (path, m) in enumerate(files):
        tp_rank = int(m.group(3)) % tp
        for key, value in torch_load_checkpoint_file(path).items():
            name = pipe_to_megatron_name(key, config.num_layers) if pp > 1 else key
            copies.setdefault(name, {})[tp_rank] = value.float()
        if progress is not None:
            progress("reading expert files", i + 1, len(files))
    rule = moe_partition(config, expert_tensor_parallel=True)
    out: dict[str, torch.Tensor] = {}
    for name, by_rank in copies.items():
        first = next(iter(by_rank.values()))
        if tuple(first.shape) == _full_shape(name, config):
            for r, t in by_rank.items():
                if not torch.equal(t, first):
                    raise ValueError(
                        f"{tag_dir}: the copies of {name} in the expert files of TP ranks differ (rank {r}); "
                        "the checkpoint is inconsistent."
                    )
            out[name] = first
            continue
        part = rule(name)
        if part is None or sorted(by_rank) != list(range(tp)):
            raise FileNotFoundError(
                f"{tag_dir}: {name} is a TP shard {tuple(first.shape)} but the expert files hold TP ranks "
                f"{sorted(by_rank)} of {tp}; copy the whole checkpoint directory."
            )
        dim, stride = part
        pieces = [torch.chunk(by_rank[r], stride, dim=dim) for r in range(tp)]
        out[name] = torch.cat([pieces[r][s] for s in range(stride) for r in range(tp)], dim=dim)
    _check_all_experts(out, config, tag_dir)
    return out


def _check_all_experts(
    experts: dict[str, torch.Tensor], config: ModelConfig, tag_dir: Path
) -> None:
    """Every MoE layer has all its experts (ValueError naming the first gap)."""
    per_layer = config.moe.experts_per_layer(config.num_layers)
    for i, n in enumerate(per_layer):
        if n < 2:
            continue
        prefix = f"language_model.encoder.layers.{i}."
        found = {expert_id(k) for k in experts if k.startswith(prefix)}
        missing = sorted(set(range(n)) - found)
        if missing:
            raise ValueError(
                f"{tag_dir}: layer {i} has {n} experts but the expert files hold none for expert(s) "
                f"{missing[:8]}; copy the whole checkpoint directory."
            )


def read_moe_pipe_tp_rank(
    tag_dir: Path, config: ModelConfig, tp_rank: int, *, tp: int, pp: int
) -> dict[str, torch.Tensor]:
    """TP rank ``tp_rank``'s non-expert weights of a pipelined MoE checkpoint (Megatron names, TP-local shapes):
    the ``module`` of ``mp_rank_{stage * tp + tp_rank:02d}_model_states.pt`` of every stage (DeepSpeed writes no
    layer files for MoE models).

    Raises:
        FileNotFoundError: a stage's file is missing.
        ValueError: a file cannot be read safely or holds no module.
    """
    out: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        path = tag_dir / f"mp_rank_{stage * tp + tp_rank:02d}_model_states.pt"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing (MoE checkpoint saved at TP = {tp}, PP = {pp}); copy the whole checkpoint "
                "directory."
            )
        module = torch_load_checkpoint_file(path).get("module") or {}
        if not module:
            raise ValueError(f"{path} holds no module weights; is the checkpoint complete?")
        for key, value in module.items():
            out[pipe_to_megatron_name(key, config.num_layers)] = value.float()
    return out
