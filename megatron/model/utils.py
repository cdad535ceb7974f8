"""Small model-level helpers: padded vocabulary, masked-mean loss, parameter counts, parameter names and seeds.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``n`` query heads, ``g`` key/value groups, ``p`` TP size,
``np = n/p``, ``hn = h/n`` (head dim), ``v`` padded vocab, ``vp = v/p``.

Names and seeds (the layout-invariance contract): every parameter's FULL value is a function of
``(seed, global Megatron name)`` only. The global name is the ``GPTModel`` state-dict name, e.g.
``language_model.encoder.layers.3.self_attention.query_key_value.weight``, on every TP/PP layout (also inside
``GPTModelPipe``, whose own state-dict keys differ). :func:`layer_param_name` builds those names.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron.config import ModelConfig

InitMethod = Callable[[torch.Tensor, "torch.Generator | None"], None]

EMBEDDING_PREFIX = "language_model.embedding"
ENCODER_PREFIX = "language_model.encoder"
WORD_EMBEDDINGS_NAME = f"{EMBEDDING_PREFIX}.word_embeddings.weight"
POSITION_EMBEDDINGS_NAME = f"{EMBEDDING_PREFIX}.position_embeddings.weight"
OUTPUT_LAYER_NAME = "language_model.output_layer.weight"
FINAL_NORM_PREFIX = f"{ENCODER_PREFIX}.final_layernorm"


def layer_param_name(layer_number: int, suffix: str) -> str:
    """Global Megatron name of a parameter of transformer layer ``layer_number`` (0-based, global).

    Example: ``layer_param_name(3, "mlp.dense_h_to_4h.weight")`` ->
    ``language_model.encoder.layers.3.mlp.dense_h_to_4h.weight``.
    """
    return f"{ENCODER_PREFIX}.layers.{layer_number}.{suffix}"


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: the smallest multiple of ``make_vocab_size_divisible_by * tp`` >= ``vocab_size``.

    Same rule as Megatron's ``_vocab_size_with_padding`` (GPT-2's 50257 -> 50304 at TP=1, 50432 at TP=2). Kept here
    (not imported from ``megatron.tokenizer``) so the model does not depend on the tokenizer package.

    Raises:
        ValueError: when any argument is not a positive integer.
    """
    for flag, value in (
        ("vocab size", vocab_size),
        ("--make-vocab-size-divisible-by", make_vocab_size_divisible_by),
        ("--tensor-model-parallel-size", tp),
    ):
        if int(value) != value or value < 1:
            raise ValueError(f"{flag} ({value}) must be a positive integer to pad the vocabulary.")
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def loss_func(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Masked mean of a per-token loss: ``sum(loss * mask) / sum(mask)`` in fp32.

    Args:
        per_token_loss: ``[b, s]`` (any float dtype).
        loss_mask: ``[b, s]``, 1 where the token counts, 0 elsewhere (float, int or bool).

    Returns:
        A 0-dim fp32 tensor. A mask summing to 0 gives 0 (not NaN), so an all-masked micro-batch is harmless.
    """
    if per_token_loss.shape != loss_mask.shape:
        raise ValueError(
            f"loss_func: per-token loss {tuple(per_token_loss.shape)} and loss mask "
            f"{tuple(loss_mask.shape)} must have the same [b, s] shape."
        )
    mask = loss_mask.to(torch.float32)
    return torch.sum(per_token_loss.to(torch.float32) * mask) / mask.sum().clamp_min(1.0)


def _norm_params(config: ModelConfig) -> int:
    return config.hidden_size * (2 if config.normalization == "layernorm" else 1)


def num_parameters(config: ModelConfig) -> dict[str, int]:
    """Parameter counts of the TRUE (unpadded, TP=1) model, for MFU (PaLM convention: non-embedding params).

    Returns:
        ``{"total", "embedding", "non_embedding", "per_layer"}``. ``embedding`` counts the word embeddings at the
        true vocab (once when tied; twice when untied, the output layer counts as embedding) plus learned positions.

    Raises:
        ValueError: when ``config.vocab_size`` is not set.
    """
    if config.vocab_size < 1:
        raise ValueError(
            f"ModelConfig.vocab_size ({config.vocab_size}) is unset; the trainer sets it from the tokenizer."
        )
    h, hn, n, g, f = (
        config.hidden_size,
        config.head_dim,
        config.num_attention_heads,
        config.num_query_groups,
        config.ffn_size,
    )
    bias = config.add_bias_linear
    qkv_out = (n + 2 * g) * hn
    up_out = f * (2 if config.swiglu else 1)
    per_layer = (
        2 * _norm_params(config)
        + h * qkv_out
        + n * hn * h
        + h * up_out
        + f * h
        + (qkv_out + h + up_out + h if bias else 0)
    )
    embedding = config.vocab_size * h
    if config.untie_embeddings_and_output_weights:
        embedding += config.vocab_size * h
    if not config.use_rotary_position_embeddings:
        embedding += config.max_positions * h
    non_embedding = config.num_layers * per_layer + _norm_params(config)
    return {
        "total": embedding + non_embedding,
        "embedding": embedding,
        "non_embedding": non_embedding,
        "per_layer": per_layer,
    }


def tensor_parallel_rank_and_size() -> tuple[int, int]:
    """``(tp_rank, tp_size)`` from ``parallel_state``; ``(0, 1)`` when torch.distributed is not initialized.

    Raises:
        RuntimeError: (from parallel_state) when torch.distributed is initialized but the model-parallel groups
            are not.
    """
    import torch.distributed as dist

    from megatron.mpu import parallel_state

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def check_tensor_parallel_shapes(config: ModelConfig, tp: int) -> None:
    """Divisibility rules the model needs at TP size ``tp`` (``config.validate`` checks the same for flags).

    Raises:
        ValueError: naming the flag, its value, the TP size and a fix.
    """
    n, g = config.num_attention_heads, config.num_query_groups
    if config.vocab_size < 1:
        raise ValueError(
            f"ModelConfig.vocab_size ({config.vocab_size}) is unset; the trainer must set it to the "
            "tokenizer's vocabulary size before building the model."
        )
    if n % g:
        raise ValueError(f"--num-key-value-heads ({g}) must divide --num-attention-heads ({n}).")
    for flag, value in (
        ("--num-attention-heads", n),
        ("--num-key-value-heads", g),
        ("--ffn-hidden-size", config.ffn_size),
    ):
        if value % tp:
            raise ValueError(
                f"{flag} ({value}) must be divisible by --tensor-model-parallel-size ({tp}); "
                "use a TP size that divides it."
            )
    if config.use_rotary_position_embeddings and config.head_dim % 2:
        raise ValueError(
            f"rotary embeddings need an even head dim; --kv-channels/head dim is {config.head_dim}."
        )
