"""``GPTStage``: the part of ``GPTModel`` one pipeline stage holds, for generation at the training layout.

Legend: ``s`` sequence (new tokens this forward), ``b`` batch, ``h`` hidden, ``p`` TP size, ``v`` padded vocab,
``vp = v/p``.

Pipeline stage ``k`` of ``P`` holds the transformer layers ``split_layers_for_pp(L, P)[k]`` (DeepSpeed's partition,
the same as training); the first stage also holds the embedding, the last the final norm and the output weights
(with tied embeddings the last stage holds its own copy of ``word_embeddings``, loaded from the same checkpoint
tensor)::

    first:  input_ids, position_ids [b, s] -> embedding -> layers[a:c]          -> hidden [s, b, h]
    middle: hidden [s, b, h]               -> layers[a:c]                       -> hidden [s, b, h]
    last:   hidden [s, b, h]               -> layers[a:c] -> final norm -> logits [s, b, vp] (padded columns -inf)

State-dict keys are ``GPTModel``'s Megatron names with the global layer index
(``language_model.encoder.layers.{i}.…``), so a stage loads the matching subset of a checkpoint's TP shard.
Sequence parallelism is off (generation feeds one token per step).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.config.rules import padded_vocab_size
from megatron.model.gpt_model import GPTModel
from megatron.model.inference import InferenceParams
from megatron.model.language_model import (
    Embedding,
    build_output_layer,
    parallel_lm_logits,
)
from megatron.model.norms import LayerNorm, RMSNorm
from megatron.model.rotary import model_rotary
from megatron.model.transformer import ParallelTransformerLayer, config_norm
from megatron.model.utils import check_tensor_parallel_shapes
from megatron.mpu.context import ParallelContext
from megatron.mpu.layers import ColumnParallelLinear

if TYPE_CHECKING:
    from megatron.model.gpt_model_pipe import GPTModelPipe

_M = TypeVar("_M", bound=nn.Module)


def _base_view(module: nn.Module, base: type[_M]) -> _M:
    """``module`` (an instance of a subclass of ``base``) seen as a plain ``base``: a new object sharing its
    parameters, buffers and submodules (the same dicts, not copies) whose ``forward`` is ``base.forward``.

    The view is for generation: it is in eval mode itself (no dropout of its own), while its submodules keep
    following ``module``'s owner, who puts the model in eval mode around generation."""
    view = base.__new__(base)
    view.__dict__.update(module.__dict__)
    view.training = False
    return view


class _Encoder(nn.Module):
    """``layers`` (keyed by global index) and, on the last stage, ``final_layernorm``."""

    def __init__(self, layers: dict[str, nn.Module], final_layernorm: nn.Module | None) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(layers)
        self.final_layernorm = final_layernorm


class _LanguageModel(nn.Module):
    """The ``language_model`` prefix of the Megatron names: what of it this stage holds."""

    def __init__(
        self,
        embedding: Embedding | None,
        encoder: _Encoder,
        output_layer: ColumnParallelLinear | None,
    ) -> None:
        super().__init__()
        self.embedding = embedding
        self.encoder = encoder
        self.output_layer = output_layer


class GPTStage(nn.Module):
    """Layers ``[start, stop)`` of ``GPTModel``, with the embedding on the first stage and the head on the last.

    Args:
        config: the architecture (``vocab_size`` set).
        parallel: the TP group of this stage (sequence parallelism must be off).
        layers: ``(start, stop)``, global transformer-layer indices.
        pre_process: this is the first stage (holds the embedding, takes token ids).
        post_process: this is the last stage (holds the final norm and output weights, returns logits).

    Raises:
        ValueError: heads/groups/ffn not divisible by the TP size, an empty layer range, or sequence parallelism.
    """

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        *,
        layers: tuple[int, int],
        pre_process: bool,
        post_process: bool,
    ) -> None:
        super().__init__()
        check_tensor_parallel_shapes(config, parallel.tp_size)
        start, stop = layers
        if not 0 <= start < stop <= config.num_layers:
            raise ValueError(
                f"a pipeline stage needs layers within [0, {config.num_layers}); got [{start}, {stop})."
            )
        if parallel.sequence_parallel:
            raise ValueError(
                "generation runs without --sequence-parallel; build the stage without it."
            )
        self.config = config
        self.parallel = parallel
        self.pre_process = pre_process
        self.post_process = post_process
        self.padded_vocab = padded_vocab_size(
            config.vocab_size, config.make_vocab_size_divisible_by, parallel.tp_size
        )
        tied_head = post_process and not config.untie_embeddings_and_output_weights
        embedding = None
        if pre_process or tied_head:
            embedding = Embedding(
                config,
                parallel,
                padded_vocab=self.padded_vocab,
                with_position_embeddings=pre_process,
            )
        layer_modules: dict[str, nn.Module] = {
            str(i): ParallelTransformerLayer(config, parallel, layer_number=i)
            for i in range(start, stop)
        }
        output_layer = None
        if post_process and config.untie_embeddings_and_output_weights:
            output_layer = build_output_layer(config, parallel, padded_vocab=self.padded_vocab)
        self.language_model = _LanguageModel(
            embedding,
            _Encoder(layer_modules, config_norm(config, parallel) if post_process else None),
            output_layer,
        )

    @classmethod
    def from_model(cls, model: GPTModel) -> GPTStage:
        """A single stage (first and last) sharing ``model``'s modules (no copy of the weights)."""
        lm = model.language_model
        stage = cls.__new__(cls)
        nn.Module.__init__(stage)
        stage.config = model.config
        stage.parallel = lm.parallel
        stage.pre_process = stage.post_process = True
        stage.padded_vocab = lm.padded_vocab
        layers: dict[str, nn.Module] = {str(i): layer for i, layer in enumerate(lm.encoder.layers)}
        stage.language_model = _LanguageModel(
            lm.embedding, _Encoder(layers, lm.encoder.final_layernorm), lm.output_layer
        )
        return stage

    @classmethod
    def from_pipe(cls, pipe: GPTModelPipe) -> GPTStage:
        """This rank's stage of a DeepSpeed ``GPTModelPipe`` (the training model at PP > 1), sharing its modules.

        DeepSpeed registers the pipe's modules under their index in the layer list (``gpt_model_pipe.py``: 1 the
        embedding, ``2 + i`` transformer layer ``i``, then the final norm and the untied head; the tied embedding
        under ``tied_modules.embed``, on the first and the last stage); the stage keys them as ``GPTModel`` does.
        A pipe module takes and returns pipe tuples, so each is seen through its base class (the same parameters,
        the base class's ``forward``). The parameter dtype is the module's own (DeepSpeed casts it for
        --bf16/--fp16), so the engine receives hidden states in it.

        Raises:
            ValueError: the pipe was built with sequence parallelism (generation runs without it).
        """
        from megatron.model.gpt_model_pipe import (
            EmbeddingPipe,
            LayerNormPipe,
            LMHeadPipe,
            ParallelTransformerLayerPipe,
        )

        if pipe.parallel.sequence_parallel:
            raise ValueError(
                "generation runs without --sequence-parallel; the pipe was built with it."
            )
        embedding: Embedding | None = None
        norm: nn.Module | None = None
        output_layer: ColumnParallelLinear | None = None
        layers: dict[str, nn.Module] = {}
        for fn in pipe.forward_funcs:
            if isinstance(fn, EmbeddingPipe):
                embedding = _base_view(fn, Embedding)
            elif isinstance(fn, ParallelTransformerLayerPipe):
                layers[str(fn.layer_number)] = _base_view(fn, ParallelTransformerLayer)
            elif isinstance(fn, (LayerNorm, RMSNorm)):
                norm = _base_view(fn, LayerNorm if isinstance(fn, LayerNormPipe) else RMSNorm)
            elif isinstance(fn, LMHeadPipe):
                output_layer = fn.lm_head
        pre_process, post_process = embedding is not None, norm is not None
        if post_process and output_layer is None and embedding is None:
            embedding = _base_view(pipe.tied_modules["embed"], Embedding)  # the tied head's weight
        stage = cls.__new__(cls)
        nn.Module.__init__(stage)
        stage.config = pipe.config
        dtype = next(pipe.parameters()).dtype
        stage.parallel = dataclasses.replace(pipe.parallel, params_dtype=dtype)
        stage.pre_process, stage.post_process = pre_process, post_process
        stage.padded_vocab = pipe.padded_vocab
        stage.language_model = _LanguageModel(embedding, _Encoder(layers, norm), output_layer)
        return stage

    def output_weight(self) -> torch.Tensor:
        """The ``[vp, h]`` logits matrix (last stage): the untied output layer's, else the word embeddings'."""
        lm = self.language_model
        if lm.output_layer is not None:
            return lm.output_layer.weight
        if lm.embedding is not None:
            return lm.embedding.word_embeddings.weight
        raise ValueError("only the last pipeline stage has output weights.")

    def forward(
        self,
        inputs: torch.Tensor,
        position_ids: torch.Tensor,
        inference_params: InferenceParams | None = None,
        *,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Run this stage on ``s`` new tokens.

        Args:
            inputs: token ids ``[b, s]`` int64 on the first stage, else the previous stage's hidden ``[s, b, h]``.
            position_ids: ``[b, s]`` absolute positions (learned table index, or RoPE angle).
            inference_params: the KV cache of this batch (its offset = tokens already cached).
            last_only: the last stage computes the logits of the last position only (``s`` = 1 in the output;
                what sampling needs after a prefill).

        Returns:
            hidden ``[s, b, h]``, or on the last stage vocab-parallel logits ``[s, b, vp]`` (padded columns
            ``-inf``).
        """
        lm = self.language_model
        if self.pre_process and lm.embedding is not None:
            hidden = lm.embedding(inputs, position_ids)  # [b, s] -> [s, b, h]
        else:
            hidden = inputs  # [s, b, h] from the previous stage
        rotary = model_rotary(self.config, position_ids, hidden.dtype)  # 2 x [s, b, 1, d] or None
        for layer in lm.encoder.layers.values():
            hidden = layer(hidden, rotary, None, inference_params)  # [s, b, h]
        norm = lm.encoder.final_layernorm
        if not self.post_process or norm is None:
            return hidden
        if last_only:
            hidden = hidden[-1:]  # [s, b, h] -> [1, b, h]
        hidden = norm(hidden)
        return parallel_lm_logits(
            hidden, self.output_weight(), self.parallel, self.config.vocab_size
        )  # [s, b, h] -> [s, b, vp]
