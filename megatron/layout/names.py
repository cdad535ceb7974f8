"""Parameter names: Megatron's state-dict names of the full model, and ``GPTModelPipe``'s names for the same tensors.

Megatron names (``GPTModel``, every TP/PP layout; the names parameter seeds are drawn from)::

    language_model.embedding.word_embeddings.weight
    language_model.embedding.position_embeddings.weight              (learned positions only)
    language_model.encoder.layers.{i}.{input_layernorm,self_attention,post_attention_layernorm,mlp}.*
    language_model.encoder.final_layernorm.{weight,bias}
    language_model.output_layer.weight                                (untied output layer only)

``GPTModelPipe`` (a DeepSpeed ``PipelineModule``) numbers its layers by spec index, for ``L`` layers::

    idx 1        word_embeddings.weight, position_embeddings.weight   (the tied embedding is saved here only;
                 in the module's state dict it is tied_modules.embed.*)
    idx 2..L+1   layer i = idx-2: input_layernorm.weight, self_attention.query_key_value.weight, ...
    idx L+2      weight, bias                                          (final norm)
    idx L+3      lm_head.weight                                        (untied output layer only)

and DeepSpeed writes one file per layer and TP rank: ``layer_{idx:02d}-model_{tp_rank:02d}-model_states.pt``.
"""

from __future__ import annotations

import re

EMBEDDING_PREFIX = "language_model.embedding"
ENCODER_PREFIX = "language_model.encoder"
WORD_EMBEDDINGS = f"{EMBEDDING_PREFIX}.word_embeddings.weight"
POSITION_EMBEDDINGS = f"{EMBEDDING_PREFIX}.position_embeddings.weight"
FINAL_NORM = f"{ENCODER_PREFIX}.final_layernorm"
OUTPUT_LAYER = "language_model.output_layer.weight"

_TIED_PREFIX = "tied_modules.embed."
_LAYER_RE = re.compile(rf"{re.escape(ENCODER_PREFIX)}\.layers\.(\d+)\.(.+)")


def layer_prefix(i: int) -> str:
    """``language_model.encoder.layers.{i}`` (global layer index, 0-based)."""
    return f"{ENCODER_PREFIX}.layers.{i}"


def layer_param_name(layer_number: int, suffix: str) -> str:
    """Global Megatron name of a parameter of transformer layer ``layer_number`` (0-based, global).

    Example: ``layer_param_name(3, "mlp.dense_h_to_4h.weight")`` ->
    ``language_model.encoder.layers.3.mlp.dense_h_to_4h.weight``.
    """
    return f"{layer_prefix(layer_number)}.{suffix}"


def pipe_layer_file_name(layer_idx: int, tp_rank: int) -> str:
    """DeepSpeed's layer file name: ``layer_{idx:02d}-model_{tp_rank:02d}-model_states.pt``."""
    return f"layer_{layer_idx:02d}-model_{tp_rank:02d}-model_states.pt"


def pipe_layer_key(key: str, num_layers: int) -> tuple[int, str]:
    """``(spec index, key inside that layer's state dict)`` of a Megatron parameter name.

    Raises:
        ValueError: ``key`` is not a GPT parameter of a ``num_layers``-layer model.
    """
    if key.startswith(EMBEDDING_PREFIX + "."):
        return 1, key[len(EMBEDDING_PREFIX) + 1 :]
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


def pipe_layer_to_megatron_name(idx: int, local: str, num_layers: int) -> str:
    """Inverse of :func:`pipe_layer_key`: the Megatron name of key ``local`` of pipeline layer ``idx``.

    Raises:
        ValueError: ``(idx, local)`` is not a parameter of a ``num_layers``-layer ``GPTModelPipe``.
    """
    if idx == 1:
        return f"{EMBEDDING_PREFIX}.{local}"
    if 2 <= idx < num_layers + 2:
        return layer_param_name(idx - 2, local)
    if idx == num_layers + 2:
        return f"{FINAL_NORM}.{local}"
    if idx == num_layers + 3 and local == "lm_head.weight":
        return OUTPUT_LAYER
    raise ValueError(
        f"pipeline layer {idx} key '{local}' is not part of a {num_layers}-layer GPTModelPipe."
    )


def pipe_to_megatron_name(key: str, num_layers: int) -> str:
    """Map a ``GPTModelPipe`` state-dict key to its ``GPTModel`` (Megatron) name.

    ``tied_modules.embed.word_embeddings.weight`` -> ``language_model.embedding.word_embeddings.weight``,
    ``3.self_attention.dense.weight`` -> ``language_model.encoder.layers.1.self_attention.dense.weight``,
    ``{L+2}.weight`` -> ``language_model.encoder.final_layernorm.weight``,
    ``{L+3}.lm_head.weight`` -> ``language_model.output_layer.weight``.

    Raises:
        ValueError: for a key that is not part of ``GPTModelPipe``.
    """
    if key.startswith(_TIED_PREFIX):
        return f"{EMBEDDING_PREFIX}.{key[len(_TIED_PREFIX) :]}"
    m = re.fullmatch(r"(\d+)\.(.+)", key)
    if m:
        try:
            return pipe_layer_to_megatron_name(int(m.group(1)), m.group(2), num_layers)
        except ValueError:
            pass
    raise ValueError(f"{key!r} is not a GPTModelPipe parameter of a {num_layers}-layer model.")
