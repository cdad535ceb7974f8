"""The ``universal_checkpoint_info`` DeepSpeed's ``ds_to_universal`` needs: how each parameter of ``GPTModel`` /
``GPTModelPipe`` is laid out over TP and PP (the patterns of :mod:`megatron.layout.tensor_parallel`).

Legend: ``p`` TP size, ``v`` padded vocab, ``V`` true vocab, ``L`` layers.

Parameter kinds (the patterns match both naming schemes: ``language_model.encoder.layers.3.mlp.dense_4h_to_h.weight``
and the pipeline's ``5.mlp.dense_4h_to_h.weight``; DeepSpeed applies them with ``re.match``):

- column-parallel (split on dim 0; the default): QKV (per-KV-group interleaved, contiguous groups per rank, so
  concatenating the shards on dim 0 gives the TP=1 layout), ``mlp.dense_h_to_4h`` (with SwiGLU: 2 sub-params
  [gate; up] each split on dim 0), word embeddings and the untied output layer (vocabulary rows);
- row-parallel (split on dim 1): ``self_attention.dense.weight``, ``mlp.dense_4h_to_h.weight``;
- TP-replicated: norms, row-parallel biases, learned position embeddings;
- PP-replicated: the tied word embeddings (first and last stage hold a copy).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from deepspeed.checkpoint import constants as ds

from megatron.config.model import ModelConfig
from megatron.layout.tensor_parallel import (
    PIPELINE_REPLICATED_PATTERNS,
    ROW_PARALLEL_PATTERNS,
    SWIGLU_PATTERNS,
    VOCABULARY_PATTERNS,
    tp_replicated_patterns,
)


def universal_checkpoint_info(config: ModelConfig, padded_vocab: int) -> dict[str, Any]:
    """The ``universal_checkpoint_info`` client state DeepSpeed's ``ds_to_universal`` needs for this model.

    Args:
        config: the model config (``vocab_size`` = true vocabulary).
        padded_vocab: the padded vocabulary of the run that saves (see ``padded_vocab_size``).

    Save it with ``engine.save_checkpoint(dir, client_state={UNIVERSAL_CHECKPOINT_INFO: info})``.
    """
    info: dict[str, Any] = {
        ds.UNIVERSAL_CHECKPOINT_VERSION_KEY: ds.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        ds.ORIGINAL_VOCAB_SIZE: config.vocab_size,
        ds.PADDED_VOCAB_SIZE: padded_vocab,
        ds.VOCABULARY_PARAMETER_PATTERNS: list(VOCABULARY_PATTERNS),
        ds.PIPELINE_REPLICATED_PARAMETER_PATTERNS: list(PIPELINE_REPLICATED_PATTERNS),
        ds.TP_REPLICATED_PARAMETER_PATTERNS: tp_replicated_patterns(config.num_layers),
        ds.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: list(ROW_PARALLEL_PATTERNS),
    }
    if config.swiglu:
        info[ds.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0] = list(SWIGLU_PATTERNS)
    return info


def used_patterns(info: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``info`` keeping only the patterns that match one of the parameter ``names`` (``ds_to_universal`` asserts
    every pattern is used; e.g. the pipeline's final-norm pattern never matches ``GPTModel`` names, nor
    ``output_layer`` when the embeddings are tied)."""
    out: dict[str, Any] = {}
    for key, value in info.items():
        if isinstance(value, list) and all(isinstance(p, str) for p in value):
            value = [p for p in value if any(re.match(p, n) for n in names)]
        out[key] = value
    return out
