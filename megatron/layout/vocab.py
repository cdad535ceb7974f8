"""Vocabulary padding of state dicts: Megatron pads the vocabulary rows to a multiple of
``--make-vocab-size-divisible-by`` x TP (:func:`megatron.config.rules.padded_vocab_size`), so a state dict saved at
one TP size is re-padded before it is split for another (and to TP = 1 for export).

Legend: ``v`` true vocabulary, ``vpad`` padded vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron.config.model import ModelConfig
from megatron.config.rules import padded_vocab_size


def is_vocab_rows(key: str) -> bool:
    """True for a parameter whose rows are the vocabulary (word embeddings, untied output layer)."""
    return key.endswith(("word_embeddings.weight", "output_layer.weight"))


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


def pad_vocab_for_tp(
    full_sd: Mapping[str, torch.Tensor], model_config: ModelConfig, tp: int
) -> dict[str, torch.Tensor]:
    """Re-pad the vocab tensors of a full state dict to the padded vocabulary a TP=``tp`` model allocates.

    Args:
        full_sd: full state dict (any current padding >= ``model_config.vocab_size``).
        model_config: ``vocab_size`` (true vocabulary, must be set) and ``make_vocab_size_divisible_by``.
        tp: target TP size.

    Returns:
        A new dict; vocab tensors re-padded (true rows verbatim, padding zero), every other entry the same object.
    """
    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size ({tp}) must be >= 1.")
    if model_config.vocab_size <= 0:
        raise ValueError(
            "model_config.vocab_size is not set; it must be the tokenizer's true vocabulary to re-pad."
        )
    rows = padded_vocab_size(model_config.vocab_size, model_config.make_vocab_size_divisible_by, tp)
    return {
        k: repad_vocab(t, model_config.vocab_size, rows) if is_vocab_rows(k) else t
        for k, t in full_sd.items()
    }
