"""Pipeline layout: which transformer layers each stage holds, and Megatron state dicts <-> ``GPTModelPipe`` layer
state dicts (DeepSpeed pipeline checkpoints hold one file per layer; the names are in :mod:`megatron.layout.names`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron.layout.names import pipe_layer_key, pipe_layer_to_megatron_name


def megatron_to_pipe_layers(
    state_dict: Mapping[str, torch.Tensor], num_layers: int
) -> dict[int, dict[str, torch.Tensor]]:
    """Group a (full or one TP rank's) Megatron state dict into ``GPTModelPipe`` layer state dicts.

    Returns:
        ``{spec index: {layer-relative key: tensor}}``; the tensors are the same objects (no copy).
    """
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in state_dict.items():
        idx, local = pipe_layer_key(key, num_layers)
        layers.setdefault(idx, {})[local] = t
    return layers


def pipe_layers_to_megatron(
    layers: Mapping[int, Mapping[str, torch.Tensor]], num_layers: int
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`megatron_to_pipe_layers` (spec indices 0 and ``L+4`` hold no weights)."""
    return {
        pipe_layer_to_megatron_name(idx, local, num_layers): t
        for idx, sd in layers.items()
        for local, t in sd.items()
    }


def split_layers_for_pp(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Transformer-layer ranges per pipeline stage, as DeepSpeed's ``type:transformer`` partition makes them.

    DeepSpeed's balanced partition over 0/1 weights gives the first ``num_layers % pp`` stages one extra layer
    (e.g. 10 layers on 4 stages -> 3, 3, 2, 2); ``tests/checkpointing/test_ckpt_reshard.py`` checks this against
    the installed ``deepspeed.runtime.utils.partition_balanced`` with embedding/norm/head specs around the layers.

    Args:
        num_layers: ``--num-layers``.
        pp: ``--pipeline-model-parallel-size``.

    Returns:
        ``[(start, stop), ...]``, one half-open range of global layer indices per stage.
    """
    if pp < 1:
        raise ValueError(f"--pipeline-model-parallel-size ({pp}) must be >= 1.")
    if num_layers < pp:
        raise ValueError(
            f"--num-layers ({num_layers}) must be >= --pipeline-model-parallel-size ({pp}): every "
            "pipeline stage needs at least one transformer layer."
        )
    base, extra = divmod(num_layers, pp)
    bounds, start = [], 0
    for stage in range(pp):
        stop = start + base + (1 if stage < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
