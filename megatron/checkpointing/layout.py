"""Row layouts of the fused Megatron tensors, and the vocabulary padding, as pure tensor functions.

Legend: ``h`` hidden, ``n`` query heads, ``G`` K/V heads (GQA groups; ``G = n`` for MHA), ``hn`` per-head
channels, ``r = n / G`` query heads per group, ``v`` true vocabulary, ``vpad`` padded vocabulary.

Fused QKV (``self_attention.query_key_value``), rows grouped by K/V head, the layout of Megatron-DeepSpeed before
the FPDT change (reference commit 6acc370a) and of ``tools/hf2megads_weight_converter.py``::

    group 0: q heads 0..r-1 (r*hn rows) | k_0 (hn rows) | v_0 (hn rows)
    group 1: q heads r..2r-1            | k_1           | v_1
    ...

so a TP shard (groups ``[rank*G/p, (rank+1)*G/p)``) is one contiguous row slice. HF stores ``q_proj`` with query
head ``j`` at rows ``[j*hn, (j+1)*hn)`` and uses K/V head ``j // r`` for it (``repeat_kv``), which is the grouping
above.

SwiGLU ``mlp.dense_h_to_4h``: the full tensor is ``[gate; up]`` (each ``ffn`` rows); TP shard ``k`` holds
``[gate_k; up_k]`` (partition stride 2).
"""

from __future__ import annotations

import torch


def _check_rows(name: str, t: torch.Tensor, rows: int) -> None:
    if t.shape[0] != rows:
        raise ValueError(f"{name} has {t.shape[0]} rows (shape {tuple(t.shape)}); expected {rows}.")


def fuse_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_heads: int,
    num_groups: int,
    head_dim: int,
) -> torch.Tensor:
    """Interleave separate Q, K, V projections into Megatron's per-group fused QKV rows.

    Args:
        q: ``[n*hn, ...]`` query rows (weight ``[n*hn, h]`` or bias ``[n*hn]``), head-major.
        k: ``[G*hn, ...]`` key rows.
        v: ``[G*hn, ...]`` value rows.
        num_heads: ``n``.
        num_groups: ``G``; must divide ``n``.
        head_dim: ``hn``.

    Returns:
        ``[(n + 2G)*hn, ...]`` rows ordered ``[q heads of g | k_g | v_g]`` for ``g = 0..G-1``.
    """
    if num_heads % num_groups:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be divisible by num_key_value_heads ({num_groups})."
        )
    r = num_heads // num_groups
    _check_rows("q", q, num_heads * head_dim)
    _check_rows("k", k, num_groups * head_dim)
    _check_rows("v", v, num_groups * head_dim)
    rest = q.shape[1:]
    qg = q.reshape(num_groups, r * head_dim, *rest)  # [n*hn, ...] -> [G, r*hn, ...]
    kg = k.reshape(num_groups, head_dim, *rest)  # [G*hn, ...] -> [G, hn, ...]
    vg = v.reshape(num_groups, head_dim, *rest)
    fused = torch.cat([qg, kg, vg], dim=1)  # [G, (r+2)*hn, ...]
    return fused.reshape(num_groups * (r + 2) * head_dim, *rest).clone()


def split_qkv(
    fused: torch.Tensor, *, num_heads: int, num_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: ``[(n + 2G)*hn, ...]`` -> ``(q [n*hn, ...], k [G*hn, ...], v [G*hn, ...])``."""
    if num_heads % num_groups:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be divisible by num_key_value_heads ({num_groups})."
        )
    r = num_heads // num_groups
    _check_rows("query_key_value", fused, (num_heads + 2 * num_groups) * head_dim)
    rest = fused.shape[1:]
    g = fused.reshape(num_groups, (r + 2) * head_dim, *rest)  # -> [G, (r+2)*hn, ...]
    q, k, v = torch.split(g, [r * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(num_heads * head_dim, *rest).clone(),
        k.reshape(num_groups * head_dim, *rest).clone(),
        v.reshape(num_groups * head_dim, *rest).clone(),
    )


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's ``_vocab_size_with_padding``: smallest multiple of ``divisible_by * tp`` that is >= ``vocab_size``.

    Example: GPT-2's 50257 -> 50304 (tp 1), 50432 (tp 2), 50688 (tp 4).
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab size ({vocab_size}) must be positive.")
    if make_vocab_size_divisible_by <= 0 or tp <= 0:
        raise ValueError(
            f"--make-vocab-size-divisible-by ({make_vocab_size_divisible_by}) and "
            f"--tensor-model-parallel-size ({tp}) must be positive."
        )
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def repad_vocab(tensor: torch.Tensor, true_vocab: int, new_padded: int) -> torch.Tensor:
    """Strip a vocab-row tensor to its ``true_vocab`` rows and zero-pad it to ``new_padded`` rows.

    Args:
        tensor: ``[vpad_old, ...]`` embedding or output-layer weight; rows ``>= true_vocab`` are padding.
        true_vocab: ``v``, the tokenizer's vocabulary (rows kept verbatim).
        new_padded: ``vpad_new >= v``; padding rows are zero (what ``VocabParallelEmbedding`` initializes them to).

    Returns:
        A new ``[vpad_new, ...]`` tensor (never a view of ``tensor``).
    """
    if tensor.shape[0] < true_vocab:
        raise ValueError(
            f"the vocab tensor has {tensor.shape[0]} rows, fewer than the true vocab size ({true_vocab}); "
            "pass the tokenizer's vocabulary size as true_vocab."
        )
    if new_padded < true_vocab:
        raise ValueError(
            f"the padded vocab size ({new_padded}) must be >= the true vocab size ({true_vocab})."
        )
    out = tensor.new_zeros((new_padded, *tensor.shape[1:]))
    out[:true_vocab] = tensor[:true_vocab]
    return out


# Megatron state-dict names of the full (TP=1) model, the contract of megatron/model.
WORD_EMBEDDINGS = "language_model.embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "language_model.embedding.position_embeddings.weight"
FINAL_NORM = "language_model.encoder.final_layernorm"
OUTPUT_LAYER = "language_model.output_layer.weight"


def layer_prefix(i: int) -> str:
    """``language_model.encoder.layers.{i}`` (global layer index, 0-based)."""
    return f"language_model.encoder.layers.{i}"
