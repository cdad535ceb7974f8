"""How each parameter of ``GPTModel`` / ``GPTModelPipe`` is laid out over TP and PP, for DeepSpeed universal
checkpoints (``ds_to_universal``) and any tool that merges or splits TP shards.

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
from typing import Any

from deepspeed.checkpoint import constants as ds

from megatron.config import ModelConfig

ROW_PARALLEL_PATTERNS = [r".*self_attention\.dense\.weight$", r".*mlp\.dense_4h_to_h\.weight$"]
VOCABULARY_PATTERNS = [
    r".*word_embeddings\.weight$",
    r".*output_layer\.weight$",
    r".*lm_head\.weight$",
]
PIPELINE_REPLICATED_PATTERNS = [r"tied_modules\.embed\.word_embeddings\.weight$"]
SWIGLU_PATTERNS = [r".*mlp\.dense_h_to_4h\.(weight|bias)$"]


def tp_replicated_patterns(num_layers: int) -> list[str]:
    """Parameters identical on every TP rank (the pipeline's final norm is the bare layer ``{L+2}``)."""
    return [
        r".*position_embeddings\.weight$",
        r".*(input_layernorm|post_attention_layernorm|final_layernorm)\.(weight|bias)$",
        r".*(self_attention\.dense|mlp\.dense_4h_to_h)\.bias$",
        rf"{num_layers + 2}\.(weight|bias)$",
    ]


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


def param_layout(name: str, config: ModelConfig) -> tuple[bool, int, int]:
    """``(tensor_parallel, partition_dim, stride)`` of a parameter, from its name alone (either naming scheme).

    The same facts the TP layers attach as attributes (``tensor_model_parallel``, ``partition_dim``,
    ``partition_stride``), derived from the patterns above, so offline tools can split/merge shards without
    building the model. Replicated parameters give ``(False, -1, 1)``.
    """
    if any(re.match(p, name) for p in tp_replicated_patterns(config.num_layers)):
        return False, -1, 1
    if any(re.match(p, name) for p in ROW_PARALLEL_PATTERNS):
        return True, 1, 1
    stride = 2 if config.swiglu and any(re.match(p, name) for p in SWIGLU_PATTERNS) else 1
    return True, 0, stride
