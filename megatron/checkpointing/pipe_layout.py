"""Megatron names <-> ``GPTModelPipe`` layer files (DeepSpeed pipeline checkpoints), as pure dict functions.

DeepSpeed's ``PipelineModule.save_state_dict`` writes one file per layer that is an ``nn.Module``, holding that
layer's own ``state_dict()`` (keys relative to the layer), per TP rank::

    global_stepN/layer_{idx:02d}-model_{tp_rank:02d}-model_states.pt

With ``GPTModelPipe``'s spec list (``megatron/model/gpt_model_pipe.py``) that is, for ``L`` layers::

    idx 1        word_embeddings.weight, position_embeddings.weight   (the tied embedding is saved here only)
    idx 2..L+1   layer i = idx-2: input_layernorm.weight, self_attention.query_key_value.weight, ...
    idx L+2      weight, bias                                          (final norm)
    idx L+3      lm_head.weight                                        (untied output layer only)
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from megatron.checkpointing.layout import FINAL_NORM, OUTPUT_LAYER

_EMBEDDING_PREFIX = "language_model.embedding."
_LAYER_RE = re.compile(r"language_model\.encoder\.layers\.(\d+)\.(.+)")


def pipe_layer_file_name(layer_idx: int, tp_rank: int) -> str:
    """DeepSpeed's layer file name: ``layer_{idx:02d}-model_{tp_rank:02d}-model_states.pt``."""
    return f"layer_{layer_idx:02d}-model_{tp_rank:02d}-model_states.pt"


def pipe_layer_key(key: str, num_layers: int) -> tuple[int, str]:
    """``(spec index, key inside that layer's state dict)`` of a Megatron parameter name.

    Raises:
        ValueError: ``key`` is not a GPT parameter of a ``num_layers``-layer model.
    """
    if key.startswith(_EMBEDDING_PREFIX):
        return 1, key[len(_EMBEDDING_PREFIX) :]
    m = _LAYER_RE.fullmatch(key)
    if m and int(m.group(1)) < num_layers:
        return int(m.group(1)) + 2, m.group(2)
    if key.startswith(FINAL_NORM + "."):
        return num_layers + 2, key[len(FINAL_NORM) + 1 :]
    if key == OUTPUT_LAYER:
        return num_layers + 3, "lm_head.weight"
    raise ValueError(
        f"'{key}' is not a parameter of a {num_layers}-layer GPT model (check --num-layers)."
    )


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
    out: dict[str, torch.Tensor] = {}
    for idx, sd in layers.items():
        for local, t in sd.items():
            if idx == 1:
                key = _EMBEDDING_PREFIX + local
            elif 2 <= idx < num_layers + 2:
                key = f"language_model.encoder.layers.{idx - 2}.{local}"
            elif idx == num_layers + 2:
                key = f"{FINAL_NORM}.{local}"
            elif idx == num_layers + 3 and local == "lm_head.weight":
                key = OUTPUT_LAYER
            else:
                raise ValueError(
                    f"pipeline layer {idx} key '{local}' is not part of a {num_layers}-layer GPTModelPipe."
                )
            out[key] = t
    return out
