"""``GPTModel``: the whole GPT/LLaMA decoder on one pipeline stage (the no-pipeline path, ZeRO 0-3).

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``p`` TP size, ``v`` padded vocab, ``vp = v/p``.

    input_ids, position_ids [b, s]
      -> language_model.embedding                 [s(/p), b, h]
      -> language_model.encoder.layers.{i}        [s(/p), b, h]
      -> language_model.encoder.final_layernorm   [s(/p), b, h]
      -> logits (tied word embeddings, or language_model.output_layer)   [s, b, vp], padded columns -inf
      -> labels given: per-token vocab-parallel cross entropy [b, s] fp32; else logits [b, s, vp]

State-dict keys are Megatron's (``language_model.embedding.word_embeddings.weight``, ...; ``megatron.layout.names``).
Every parameter's full value is a function of ``(seed, global name)``, so any TP layout starts from the same model.
The TP group and the build settings come from the ``ParallelContext`` the model is given, never from globals.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron import fused_kernels
from megatron.config import ModelConfig
from megatron.config.rules import padded_vocab_size
from megatron.model.attention import AttentionMask
from megatron.model.inference import InferenceParams
from megatron.model.language_model import (
    Embedding,
    build_output_layer,
    logits_buffer,
    parallel_lm_logits,
)
from megatron.model.rotary import model_rotary
from megatron.model.transformer import ParallelTransformer
from megatron.model.utils import check_tensor_parallel_shapes
from megatron.mpu.context import ParallelContext
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy


def check_batch(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    sequence_parallel: bool,
    tp_size: int,
) -> None:
    """Shapes of a model input batch (all ``[b, s]``; ``s`` divisible by ``p`` under sequence parallelism).

    Raises:
        ValueError: naming the tensors and shapes.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [b, s]; got shape {tuple(input_ids.shape)}.")
    for name, t in (("position_ids", position_ids), ("labels", labels)):
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(
                f"{name} {tuple(t.shape)} must have the shape of input_ids {tuple(input_ids.shape)}."
            )
    if sequence_parallel and input_ids.shape[1] % tp_size:
        raise ValueError(
            f"--sequence-parallel needs the sequence length ({input_ids.shape[1]}) divisible by "
            f"--tensor-model-parallel-size ({tp_size})."
        )


class TransformerLanguageModel(nn.Module):
    """``embedding``, ``encoder`` and (untied) ``output_layer``; returns masked vocab-parallel logits ``[s, b, vp]``.

    Args: as :class:`GPTModel`.
    """

    def __init__(self, config: ModelConfig, parallel: ParallelContext) -> None:
        super().__init__()
        check_tensor_parallel_shapes(config, parallel.tp_size)
        self.config = config
        self.parallel = parallel
        self.padded_vocab = padded_vocab_size(
            config.vocab_size, config.make_vocab_size_divisible_by, parallel.tp_size
        )
        self.embedding = Embedding(config, parallel, padded_vocab=self.padded_vocab)
        self.logits_buffer = logits_buffer(parallel)  # CPU: the training logits reuse their memory
        self.encoder = ParallelTransformer(config, parallel)
        self.output_layer = None
        if config.untie_embeddings_and_output_weights:
            self.output_layer = build_output_layer(config, parallel, padded_vocab=self.padded_vocab)

    def output_weight(self) -> torch.Tensor:
        """The ``[vp, h]`` matrix of the logits: the untied output layer's, else the word embeddings'."""
        if self.output_layer is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: AttentionMask = None,
        inference_params: InferenceParams | None = None,
    ) -> torch.Tensor:
        """``[b, s]`` ids and positions -> logits ``[s, b, vp]`` (padded columns ``-inf``)."""
        hidden = self.embedding(input_ids, position_ids)  # [b, s] -> [s(/p), b, h]
        rotary = model_rotary(self.config, position_ids, hidden.dtype)  # 2 x [s, b, 1, d] or None
        hidden = self.encoder(hidden, rotary, attention_mask, inference_params)  # [s(/p), b, h]
        return parallel_lm_logits(
            hidden, self.output_weight(), self.parallel, self.config.vocab_size, self.logits_buffer
        )  # [s(/p), b, h] -> [s, b, vp]


class GPTModel(nn.Module):
    """GPT/LLaMA decoder (no pipeline parallelism), tensor-parallel over the group of its ``ParallelContext``.

    Args:
        config: architecture (``config.vocab_size`` = the tokenizer's true vocabulary, must be set).
        parallel: the TP group (``ParallelContext.from_parallel_state`` for the run's; the default, no group, is
            one process without torch.distributed), sequence parallelism (a no-op at TP = 1), the run's seed
            (parameter values = f(seed, global Megatron name): layout-invariant init), the parameters' dtype (drawn
            in fp32, then cast) and device.

    Raises:
        ValueError: unset vocab size or heads/groups/ffn not divisible by the TP size.
    """

    def __init__(self, config: ModelConfig, parallel: ParallelContext) -> None:
        super().__init__()
        self.config = config
        self.language_model = TransformerLanguageModel(config, parallel)

    @property
    def padded_vocab_size(self) -> int:
        """The padded vocabulary ``v`` at this TP size."""
        return self.language_model.padded_vocab

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: AttentionMask = None,
        labels: torch.Tensor | None = None,
        inference_params: InferenceParams | None = None,
    ) -> torch.Tensor:
        """Run the model on one micro-batch.

        Args:
            input_ids: ``[b, s]`` int64 token ids in ``[0, vocab_size)``.
            position_ids: ``[b, s]`` int64 positions (learned table index, or RoPE angle).
            attention_mask: None = causal (recommended); bool ``[b or 1, 1, s, s]``, True = masked; or
                ``PackedDocuments(document_ids [b, S])`` for packed documents (no ``[s, s]`` tensor).
            labels: ``[b, s]`` int64 targets, or None.
            inference_params: KV cache for generation (``megatron.model.inference``): ``input_ids`` are then only
                the new tokens and ``position_ids`` their absolute positions; the caller advances the offset.

        Returns:
            labels given: per-token loss ``[b, s]`` fp32 (mask/average with :func:`loss_func`); else vocab-parallel
            logits ``[b, s, vp]`` with padded-vocab columns ``-inf``.
        """
        lm = self.language_model
        parallel = lm.parallel
        check_batch(
            input_ids,
            position_ids,
            labels,
            sequence_parallel=parallel.sequence_parallel,
            tp_size=parallel.tp_size,
        )
        logits = lm(input_ids, position_ids, attention_mask, inference_params)  # [s, b, vp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [s, b, vp] -> [b, s, vp]
        logits = logits.float()
        kernels = (
            fused_kernels.cross_entropy_kernels(logits)
            if self.config.cross_entropy_loss_fusion
            else None
        )
        loss = vocab_parallel_cross_entropy(
            logits, labels.transpose(0, 1), group=parallel.tp_group, local_kernels=kernels
        )  # [s, b]; the fused path writes its gradient over the logits
        return loss.transpose(0, 1).contiguous()  # [s, b] -> [b, s]
