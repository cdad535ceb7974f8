"""Small model-level helpers: masked-mean loss, parameter counts, the shape checks the model applies.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``n`` query heads, ``g`` key/value groups, ``p`` TP size,
``np = n/p``, ``hn = h/n`` (head dim), ``v`` padded vocab, ``vp = v/p``.

Names and seeds (the layout-invariance contract): every parameter's FULL value is a function of
``(seed, global Megatron name)`` only. The global name is the ``GPTModel`` state-dict name, e.g.
``language_model.encoder.layers.3.self_attention.query_key_value.weight``, on every TP/PP layout (also inside
``GPTModelPipe``, whose own state-dict keys differ); :mod:`megatron.layout.names` builds those names.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from megatron.config import ModelConfig
from megatron.config.rules import check_head_layout, check_tensor_parallel_split
from megatron.mpu.context import ParallelContext
from megatron.mpu.mappings import reduce_from_ulysses_region
from megatron.mpu.parallel_state import ProcessGroup
from megatron.mpu.random import param_seed


def init_seed(config: ModelConfig, parallel: ParallelContext, name: str) -> int | None:
    """The seed the parameter ``name`` (global Megatron name) is drawn from: ``param_seed(seed, name)`` with
    layout-invariant init, None with --per-shard-init (each TP shard drawn from the model-parallel RNG stream)."""
    return param_seed(parallel.seed, name) if config.layout_invariant_init else None


class _ScaleGradient(torch.autograd.Function):
    """forward: identity; backward: the gradient times ``factor`` (no communication)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def loss_func(
    per_token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    sequence_parallel_group: ProcessGroup | None = None,
    context_parallel_size: int = 1,
    reduction: Literal["mean", "sum"] = "mean",
) -> torch.Tensor:
    """Masked mean of a per-token loss: ``sum(loss * mask) / sum(mask)`` in fp32 (``reduction="sum"``: the
    weighted sum ``sum(loss * mask)``, the mask holding per-token weights that already normalize).

    Args:
        per_token_loss: ``[b, s]`` (any float dtype); ``[b, s/N]`` when the sequence is split over N ranks
            (context parallelism x DeepSpeed-Ulysses).
        loss_mask: ``[b, s]``, 1 where the token counts, 0 elsewhere (float, int or bool).
        sequence_parallel_group: the ranks the sequence is split over (CP x Ulysses; None: not split). The sum
            and the count are then summed over it (``reduce_from_ulysses_region``), so the result is the mean over
            the WHOLE sequence on every rank of the group; each rank's backward covers its own tokens.
        context_parallel_size: ``cp``; the backward is multiplied by it (the value is not). DeepSpeed averages the
            gradients over DP x CP (``(dp * cp * sp) / sp`` ranks: it knows the Ulysses degree only), while the
            gradient of the whole sequence is the SUM of its CP ranks' shares; Megatron-LM scales its CP loss
            the same way. ZeRO-3 + Ulysses is corrected apart (``training/ulysses.py``).
        reduction: ``"mean"`` (pretraining: the mean of this micro-batch) or ``"sum"`` (--sft: the weights of the
            global per-token mean, ``training/token_weights.py``; no division).

    Returns:
        A 0-dim fp32 tensor. A mask summing to 0 gives 0 (not NaN), so an all-masked micro-batch is harmless.
    """
    if per_token_loss.shape != loss_mask.shape:
        raise ValueError(
            f"loss_func: per-token loss {tuple(per_token_loss.shape)} and loss mask "
            f"{tuple(loss_mask.shape)} must have the same [b, s] shape."
        )
    mask = loss_mask.to(torch.float32)
    total = torch.sum(per_token_loss.to(torch.float32) * mask)
    count = mask.sum()
    if sequence_parallel_group is not None:
        sums = reduce_from_ulysses_region(torch.stack([total, count]), sequence_parallel_group)
        total, count = sums[0], sums[1]  # [2] summed over the CP x Ulysses group
    loss = total if reduction == "sum" else total / count.clamp_min(1.0)
    if context_parallel_size > 1:
        loss = _ScaleGradient.apply(loss, float(context_parallel_size))
    return loss


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
    if config.add_position_embedding and not config.use_rotary_position_embeddings:
        embedding += config.max_positions * h
    non_embedding = config.num_layers * per_layer + _norm_params(config)
    return {
        "total": embedding + non_embedding,
        "embedding": embedding,
        "non_embedding": non_embedding,
        "per_layer": per_layer,
    }


def check_tensor_parallel_shapes(config: ModelConfig, tp: int) -> None:
    """What the model needs of ``config`` at TP size ``tp``: a set vocabulary, and the rules of
    :mod:`megatron.config.rules` (which flag validation applies too).

    Raises:
        ValueError: naming the flag, its value, the TP size and a fix.
    """
    if config.vocab_size < 1:
        raise ValueError(
            f"ModelConfig.vocab_size ({config.vocab_size}) is unset; the trainer must set it to the "
            "tokenizer's vocabulary size before building the model."
        )
    check_head_layout(config)
    check_tensor_parallel_split(config, tp)
