"""Embedding (vocab-parallel words + learned positions) and the vocab-parallel output logits.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``p`` TP size, ``v`` padded vocab, ``vp = v/p``,
``V`` true vocab (``config.vocab_size``).

Padded vocabulary: rows ``>= V`` of the word embedding (and of the untied output layer) are zero, and the logits of
padded columns are set to ``-inf`` before anything else sees them, so neither the loss nor a sampler ever depends on
the padding (which differs between TP sizes). Ids outside ``[0, V)`` are rejected by ``VocabParallelEmbedding``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.model.utils import (
    OUTPUT_LAYER_NAME,
    POSITION_EMBEDDINGS_NAME,
    WORD_EMBEDDINGS_NAME,
    InitMethod,
)
from megatron.mpu.layers import ColumnParallelLinear, VocabParallelEmbedding, init_method_normal
from megatron.mpu.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.mpu.random import get_cuda_rng_tracker, param_seed


def _position_table(
    config: ModelConfig,
    *,
    seed: int,
    params_dtype: torch.dtype,
    device: torch.device | str | None,
) -> nn.Embedding:
    """Learned position table ``[max_positions, h]``, N(0, std) drawn from ``param_seed(seed, name)``."""
    master = torch.empty(config.max_positions, config.hidden_size, dtype=torch.float32)
    init = init_method_normal(config.init_method_std)
    if config.layout_invariant_init:
        init(master, torch.Generator().manual_seed(param_seed(seed, POSITION_EMBEDDINGS_NAME)))
    else:
        init(master, None)
    weight = master.to(dtype=params_dtype, device=device)
    return nn.Embedding(config.max_positions, config.hidden_size, _weight=weight)


class Embedding(nn.Module):
    """``word_embeddings`` (vocab-parallel) + ``position_embeddings`` (learned, unless RoPE) -> ``[s, b, h]``.

    Args:
        config: model config (``vocab_size`` = true vocab, must be set).
        seed: the run's seed (values = f(seed, global name)).
        padded_vocab: padded vocabulary ``v`` (multiple of ``make_vocab_size_divisible_by * p``).
        sequence_parallel: scatter the output to ``[s/p, b, h]`` (Megatron SP).
        with_position_embeddings: False builds only the word embeddings (the tied output copy on the last
            pipeline stage has no use for positions).
        params_dtype, device: of the parameters.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        seed: int,
        padded_vocab: int,
        sequence_parallel: bool = False,
        with_position_embeddings: bool = True,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.hidden_dropout = config.hidden_dropout
        self.max_positions = config.max_positions
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab,
            config.hidden_size,
            init_method=init_method_normal(config.init_method_std),
            params_dtype=params_dtype,
            device=device,
            init_seed=param_seed(seed, WORD_EMBEDDINGS_NAME)
            if config.layout_invariant_init
            else None,
            true_vocab_size=config.vocab_size,
        )
        self.position_embeddings: nn.Embedding | None = None
        if with_position_embeddings and not config.use_rotary_position_embeddings:
            self.position_embeddings = _position_table(
                config, seed=seed, params_dtype=params_dtype, device=device
            )

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids, position_ids [b, s] -> [s, b, h]`` (``[s/p, b, h]`` under sequence parallelism).

        Raises:
            ValueError: a position id outside ``[0, max_positions)`` with learned positions.
        """
        x = self.word_embeddings(input_ids)  # [b, s] -> [b, s, h]
        if self.position_embeddings is not None:
            lo, hi = torch.stack([position_ids.min(), position_ids.max()]).tolist()  # one sync
            if lo < 0 or hi >= self.max_positions:
                raise ValueError(
                    f"position ids span [{lo}, {hi}] but the learned position table has "
                    f"{self.max_positions} rows; raise --max-position-embeddings (or shorten "
                    "--seq-length)."
                )
            x = x + self.position_embeddings(position_ids)  # [b, s, h]
        x = x.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x)  # [s, b, h] -> [s/p, b, h]
        if self.training and self.hidden_dropout > 0.0:
            rng = (
                get_cuda_rng_tracker().fork()
                if self.sequence_parallel
                else contextlib.nullcontext()
            )
            with rng:
                x = F.dropout(x, p=self.hidden_dropout, training=True)
        return x


def _true_rows_init(std: float, true_vocab: int) -> InitMethod:
    """Init for the full ``[v, h]`` output weight: rows ``< V`` ~ N(0, std), padded rows zero."""

    def init(tensor: torch.Tensor, generator: torch.Generator | None) -> None:
        with torch.no_grad():
            tensor.zero_()
            tensor[:true_vocab].normal_(0.0, std, generator=generator)

    return init


def build_output_layer(
    config: ModelConfig,
    *,
    seed: int,
    padded_vocab: int,
    tp_rank: int,
    params_dtype: torch.dtype,
    device: torch.device | str | None,
) -> ColumnParallelLinear:
    """Untied ``output_layer``: column-parallel ``[vp, h]`` weight, no bias; padded rows are zero.

    Only its ``weight`` is used (through :func:`parallel_lm_logits`), so the tied and untied paths share one
    logits computation.
    """
    layer = ColumnParallelLinear(
        config.hidden_size,
        padded_vocab,
        bias=False,
        gather_output=False,
        init_method=_true_rows_init(config.init_method_std, config.vocab_size),
        params_dtype=params_dtype,
        device=device,
        init_seed=param_seed(seed, OUTPUT_LAYER_NAME) if config.layout_invariant_init else None,
    )
    vp = layer.weight.shape[0]
    first_padded = max(
        0, config.vocab_size - tp_rank * vp
    )  # local row index of the first padded row
    if first_padded < vp:
        with torch.no_grad():
            layer.weight[first_padded:].zero_()
    return layer


def parallel_lm_logits(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    *,
    sequence_parallel: bool,
    tp_size: int,
) -> torch.Tensor:
    """Vocab-parallel logits ``[s(/p), b, h] x [vp, h] -> [s, b, vp]``.

    Under sequence parallelism the input is first all-gathered on ``s`` (backward: reduce-scatter); otherwise it
    goes through ``copy_to_tensor_model_parallel_region`` (backward: all-reduce of the input gradient over TP).
    """
    if sequence_parallel:
        hidden_states = gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=True
        )  # [s/p, b, h] -> [s, b, h]
    elif tp_size > 1:
        hidden_states = copy_to_tensor_model_parallel_region(hidden_states)
    return F.linear(hidden_states, weight)  # [s, b, h] -> [s, b, vp]


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Set the logits of padded vocabulary columns (global index ``>= vocab_size``) to ``-inf``.

    Args:
        logits: ``[..., vp]``, this TP rank's vocabulary slice ``[tp_rank*vp, (tp_rank+1)*vp)``.
        vocab_size: true vocabulary ``V``.
        tp_rank: this rank's TP index.
    """
    vp = logits.shape[-1]
    start = tp_rank * vp
    if start + vp <= vocab_size:
        return logits
    padded = torch.arange(start, start + vp, device=logits.device) >= vocab_size  # [vp]
    return logits.masked_fill(padded, float("-inf"))
