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
from megatron.layout.names import OUTPUT_LAYER, POSITION_EMBEDDINGS, WORD_EMBEDDINGS
from megatron.model.output_logits import LogitsBuffer, local_logits
from megatron.model.utils import init_seed
from megatron.mpu.context import ParallelContext
from megatron.mpu.layers import (
    ColumnParallelLinear,
    InitMethod,
    VocabParallelEmbedding,
    WeightInit,
    init_method_normal,
    linear_with_async_allreduce,
)
from megatron.mpu.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.mpu.random import get_cuda_rng_tracker


def has_learned_positions(config: ModelConfig) -> bool:
    """The learned absolute position table exists: not with rotary embeddings, not with --no-position-embedding
    (then the model has no position signal but the causal mask, as Megatron's)."""
    return config.add_position_embedding and not config.use_rotary_position_embeddings


def _position_table(config: ModelConfig, parallel: ParallelContext) -> nn.Embedding:
    """Learned position table ``[max_positions, h]``, N(0, std) drawn from ``param_seed(seed, name)``."""
    master = torch.empty(config.max_positions, config.hidden_size, dtype=torch.float32)
    init = init_method_normal(config.init_method_std)
    seed = init_seed(config, parallel, POSITION_EMBEDDINGS)
    init(master, None if seed is None else torch.Generator().manual_seed(seed))
    weight = master.to(dtype=parallel.params_dtype, device=parallel.device)
    return nn.Embedding(config.max_positions, config.hidden_size, _weight=weight)


class Embedding(nn.Module):
    """``word_embeddings`` (vocab-parallel) + ``position_embeddings`` (learned, unless RoPE or
    --no-position-embedding) -> ``[s, b, h]``.

    Args:
        config: model config (``vocab_size`` = true vocab, must be set).
        parallel: TP group, sequence parallelism (scatter the output to ``[s/p, b, h]``), seed, dtype, device.
        padded_vocab: padded vocabulary ``v`` (multiple of ``make_vocab_size_divisible_by * p``).
        with_position_embeddings: False builds only the word embeddings (the tied output copy on the last
            pipeline stage has no use for positions).
    """

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        *,
        padded_vocab: int,
        with_position_embeddings: bool = True,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.hidden_dropout = config.hidden_dropout
        self.max_positions = config.max_positions
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab,
            config.hidden_size,
            init=WeightInit(
                init_method_normal(config.init_method_std),
                init_seed(config, parallel, WORD_EMBEDDINGS),
            ),
            true_vocab_size=config.vocab_size,
            tp=parallel.tp_settings,
        )
        self.position_embeddings: nn.Embedding | None = None
        if with_position_embeddings and has_learned_positions(config):
            self.position_embeddings = _position_table(config, parallel)

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
        sequence_parallel = self.parallel.sequence_parallel
        if sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.parallel.tp_group)  # -> [s/p, b, h]
        if self.training and self.hidden_dropout > 0.0:
            rng = get_cuda_rng_tracker().fork() if sequence_parallel else contextlib.nullcontext()
            with rng:
                x = F.dropout(x, p=self.hidden_dropout, training=True)
        return x


def _true_rows_init(std: float, true_vocab: int, padded_vocab: int, tp_rank: int) -> InitMethod:
    """Init of the output weight: rows of global index ``< V`` ~ N(0, std), padded rows zero.

    Called on the full ``[v, h]`` master (layout-invariant init) or on this rank's ``[vp, h]`` shard
    (--per-shard-init, whose rows start at global index ``tp_rank * vp``). The padded rows are zeroed here, inside
    the layer's ``__init__``: under ZeRO-3 construction the weight is partitioned as soon as it returns.
    """

    def init(tensor: torch.Tensor, generator: torch.Generator | None) -> None:
        rows = tensor.shape[0]
        start = 0 if rows == padded_vocab else tp_rank * rows  # global index of the first row
        with torch.no_grad():
            tensor.zero_()
            tensor[:true_vocab].normal_(0.0, std, generator=generator)
            tensor[max(0, true_vocab - start) :].zero_()

    return init


def build_output_layer(
    config: ModelConfig, parallel: ParallelContext, *, padded_vocab: int
) -> ColumnParallelLinear:
    """Untied ``output_layer``: column-parallel ``[vp, h]`` weight, no bias; padded rows are zero.

    Only its ``weight`` is used (through :func:`parallel_lm_logits`), so the tied and untied paths share one
    logits computation. Nothing writes the weight after construction (ZeRO-3 partitions it then).
    """
    return ColumnParallelLinear(
        config.hidden_size,
        padded_vocab,
        bias=False,
        gather_output=False,
        init=WeightInit(
            _true_rows_init(
                config.init_method_std, config.vocab_size, padded_vocab, parallel.tp_rank
            ),
            init_seed(config, parallel, OUTPUT_LAYER),
        ),
        tp=parallel.tp_settings,
    )


def parallel_lm_logits(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    parallel: ParallelContext,
    vocab_size: int,
    buffer: LogitsBuffer | None = None,
) -> torch.Tensor:
    """Vocab-parallel logits ``[s(/p), b, h] x [vp, h] -> [s, b, vp]``, padded columns ``-inf``.

    Under sequence parallelism the input is first all-gathered on ``s`` (backward: reduce-scatter); otherwise it
    goes through ``copy_to_tensor_model_parallel_region`` (backward: all-reduce of the input gradient over TP),
    overlapped with the weight-grad matmul unless --no-async-tensor-model-parallel-allreduce. ``vocab_size``: the
    true vocabulary ``V`` (columns ``>= V`` are padding); ``buffer``: where training logits may be written (CPU;
    ``megatron/model/output_logits.py``).
    """
    group = parallel.tp_group
    if parallel.sequence_parallel:
        hidden_states = gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=True, group=group
        )  # [s/p, b, h] -> [s, b, h]
    elif parallel.tp_size > 1:
        if parallel.async_tensor_model_parallel_allreduce:
            logits = linear_with_async_allreduce(
                hidden_states, weight, None, group
            )  # -> [s, b, vp]
            return mask_padded_vocab(logits, vocab_size, parallel.tp_rank)
        hidden_states = copy_to_tensor_model_parallel_region(hidden_states, group)
    vp = weight.shape[0]
    pad_from = min(vp, max(0, vocab_size - parallel.tp_rank * vp))  # first padded local column
    return local_logits(hidden_states, weight, pad_from, buffer)  # [s, b, h] -> [s, b, vp]


def logits_buffer(parallel: ParallelContext) -> LogitsBuffer:
    """The recycled training-logits buffer for a module on ``parallel.device``: on for CPU, off for CUDA."""
    return LogitsBuffer(enabled=torch.device(parallel.device or "cpu").type == "cpu")


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
