"""``GPTModelPipe``: the same model as ``GPTModel`` as a DeepSpeed ``PipelineModule`` (pipeline + ZeRO-0/1).

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``p`` TP size, ``L`` layers, ``v`` padded vocab, ``vp = v/p``.

Layer list (indices follow Megatron-DeepSpeed, so checkpoint files ``layer_XX-model_YY-model_states.pt`` line up)::

    0        _check_pipe_inputs           ((input_ids, position_ids[, document_ids]))  -> same
    1        TiedLayerSpec('embed', EmbeddingPipe)      -> (hidden [s(/p), b, h], position_ids[, document_ids])
    2..L+1   ParallelTransformerLayerPipe(layer_number = idx-2)         -> (hidden, position_ids[, document_ids])
    L+2      LayerNormPipe / RMSNormPipe (final norm)                    -> hidden
    L+3      TiedLayerSpec('embed', forward_fn=_tied_logits)  or  LMHeadPipe (untied)  -> logits [s, b, vp]
    L+4      _logits_to_fp32                                            -> fp32 logits
    loss_fn  pipe_loss_fn(logits, (labels, loss_mask)) = masked mean of the vocab-parallel cross entropy

Pipe batch, as ``engine.train_batch`` pulls it from the data iterator per micro-batch:
``((input_ids [b, s], position_ids [b, s][, document_ids [b, S]]), (labels [b, s], loss_mask [b, s]))``. The causal
mask and the RoPE tables are computed inside the layers; ``position_ids`` (int64, no gradient) travel with the hidden
states. Packed documents (``--reset-attention-mask``) add ``document_ids`` (int64, the whole sequence's, no
gradient), carried from the first stage to every stage right after ``position_ids`` (as Megatron-DeepSpeed carries
its attention mask) and given to each layer's attention as ``PackedDocuments`` (no ``[s, s]`` tensor); an MoE
model's running loss (``moe_pipe.py``) comes after them. DeepSpeed sends every tensor of the tuple forward and the
gradient of the floating-point ones back, so the ids cost ``b * S`` int64 per micro-batch between stages.

Names and seeds: each parameter is drawn from ``param_seed(seed, GPTModel name)`` (layer ``i`` has the same name
on every stage), so ``GPTModelPipe`` and ``GPTModel`` start from identical weights on every layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import ProcessTopology
from torch import nn

from megatron import fused_kernels
from megatron.config import ModelConfig
from megatron.config.rules import padded_vocab_size
from megatron.model.language_model import (
    Embedding,
    build_output_layer,
    logits_buffer,
    parallel_lm_logits,
)
from megatron.model.moe_pipe import add_layer_moe_loss, record_moe_loss, with_moe_loss
from megatron.model.norms import LayerNorm, RMSNorm
from megatron.model.rotary import model_rotary
from megatron.model.token_layout import PackedDocuments
from megatron.model.transformer import ParallelTransformerLayer, checkpoint_chunk, norm_kwargs
from megatron.model.utils import check_tensor_parallel_shapes, loss_func
from megatron.mpu.context import ParallelContext
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.mpu.parallel_state import ProcessGroup

PipeActivation = tuple[torch.Tensor, ...]


class _VocabLogits:
    """What the logits need besides the weight (kept on the modules that produce logits)."""

    def __init__(self, vocab_size: int, parallel: ParallelContext) -> None:
        self.vocab_size = vocab_size
        self.parallel = parallel
        self.buffer = logits_buffer(parallel)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return parallel_lm_logits(
            hidden, weight, self.parallel, self.vocab_size, self.buffer
        )  # [s(/p), b, h] -> [s, b, vp]


class EmbeddingPipe(Embedding):
    """:class:`Embedding` taking and returning pipe tuples; also the tied output layer (``_tied_logits``)."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        *,
        padded_vocab: int,
        with_position_embeddings: bool = True,
    ) -> None:
        super().__init__(
            config,
            parallel,
            padded_vocab=padded_vocab,
            with_position_embeddings=with_position_embeddings,
        )
        self.vocab_logits = _VocabLogits(config.vocab_size, parallel)

    def forward(self, inputs: PipeActivation) -> PipeActivation:  # type: ignore[override]
        """``(input_ids [b, s], position_ids [b, s][, document_ids]) -> (hidden [s(/p), b, h], position_ids[,
        document_ids])``."""
        input_ids, position_ids, *documents = inputs
        return super().forward(input_ids, position_ids), position_ids, *documents


def _tied_logits(embedding: EmbeddingPipe, hidden: Any) -> Any:
    """Output layer tied to the word embeddings: ``[s(/p), b, h] -> [s, b, vp]`` (padded columns ``-inf``); an MoE
    model's ``(hidden, moe_loss)`` -> ``(logits, moe_loss)``."""
    if isinstance(hidden, tuple):
        return _tied_logits(embedding, hidden[0]), hidden[1]
    return embedding.vocab_logits.logits(hidden, embedding.word_embeddings.weight)


class ParallelTransformerLayerPipe(ParallelTransformerLayer):
    """:class:`ParallelTransformerLayer` on pipe tuples; RoPE tables from ``position_ids`` (never sent)."""

    def __init__(
        self, config: ModelConfig, parallel: ParallelContext, *, layer_number: int
    ) -> None:
        super().__init__(config, parallel, layer_number=layer_number)
        self.moe_model = config.moe.is_moe(config.num_layers)
        self.config = config

    def forward(self, inputs: PipeActivation) -> PipeActivation:  # type: ignore[override]
        """``(hidden [s(/p), b, h], position_ids [b, s][, document_ids [b, S]]) -> same`` (causal attention, within
        each document when ``document_ids`` travel along).

        MoE models carry one more tensor, the running MoE loss ``[1]`` fp32 (``--moe-loss-coeff`` x aux losses of
        the layers so far), through the pipeline; layer 0 starts it (``megatron/model/moe_pipe.py``).
        """
        hidden, position_ids, *rest = inputs
        documents, moe_loss = split_pipe_extras(rest)
        rotary = model_rotary(self.config, position_ids, hidden.dtype)  # 2 x [s, b, 1, d] or None
        mask = None if documents is None else PackedDocuments(documents)
        out = super().forward(hidden, rotary, mask)
        carried = (position_ids,) if documents is None else (position_ids, documents)
        if not self.moe_model:
            return out, *carried
        return out, *carried, add_layer_moe_loss(self.mlp, moe_loss, out)


def split_pipe_extras(
    rest: list[torch.Tensor] | tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The optional pipe tensors after ``(hidden, position_ids)``: ``(document_ids [b, S] int64 or None, running
    MoE loss [1] fp32 or None)``, told apart by dtype (ids are integers, the MoE loss is floating point)."""
    documents = next((t for t in rest if not t.is_floating_point()), None)
    moe_loss = next((t for t in rest if t.is_floating_point()), None)
    return documents, moe_loss


class LayerNormPipe(LayerNorm):
    """Final LayerNorm on the pipe tuple: ``(hidden, position_ids) -> hidden`` (MoE: ``(.., moe_loss) ->
    (hidden, moe_loss)``)."""

    def forward(self, inputs: PipeActivation) -> Any:  # type: ignore[override]
        return with_moe_loss(super().forward(inputs[0]), inputs)


class RMSNormPipe(RMSNorm):
    """Final RMSNorm on the pipe tuple: ``(hidden, position_ids) -> hidden`` (MoE: ``(.., moe_loss) ->
    (hidden, moe_loss)``)."""

    def forward(self, inputs: PipeActivation) -> Any:  # type: ignore[override]
        return with_moe_loss(super().forward(inputs[0]), inputs)


class LMHeadPipe(nn.Module):
    """Untied output layer (``lm_head``, column-parallel ``[vp, h]``): ``[s(/p), b, h] -> [s, b, vp]``."""

    def __init__(
        self, config: ModelConfig, parallel: ParallelContext, *, padded_vocab: int
    ) -> None:
        super().__init__()
        self.vocab_logits = _VocabLogits(config.vocab_size, parallel)
        self.lm_head = build_output_layer(config, parallel, padded_vocab=padded_vocab)

    def forward(self, hidden: Any) -> Any:
        if isinstance(hidden, tuple):  # an MoE model's (hidden, moe_loss)
            return self.forward(hidden[0]), hidden[1]
        return self.vocab_logits.logits(hidden, self.lm_head.weight)


def _pipe_inputs_ok(inputs: Any) -> bool:
    if not isinstance(inputs, (tuple, list)) or len(inputs) not in (2, 3):
        return False
    ids, positions, *documents = inputs
    if ids.dim() != 2 or ids.shape != positions.shape:
        return False
    # document ids cover the whole sequence (S >= s: context parallelism keeps them unsplit)
    return all(
        d.dim() == 2 and d.shape[0] == ids.shape[0] and not d.is_floating_point() for d in documents
    )


def _check_pipe_inputs(inputs: PipeActivation) -> PipeActivation:
    """First pipe layer: the micro-batch must be ``(input_ids [b, s], position_ids [b, s][, document_ids [b, S]
    integer])``."""
    if not _pipe_inputs_ok(inputs):
        got = (
            [(tuple(t.shape), str(t.dtype)) for t in inputs]
            if isinstance(inputs, (tuple, list))
            else type(inputs).__name__
        )
        raise ValueError(
            "GPTModelPipe expects each micro-batch as ((input_ids [b, s], position_ids [b, s][, document_ids "
            f"[b, S] int64]), (labels [b, s], loss_mask [b, s])); the inputs part was {got}."
        )
    return tuple(inputs)


def _logits_to_fp32(logits: Any) -> Any:
    """Last pipe layer: the cross entropy runs in fp32 (an MoE model's moe_loss passes along)."""
    if isinstance(logits, tuple):
        return logits[0].float(), logits[1]
    return logits.float()


def pipe_loss_fn(
    logits: torch.Tensor,
    labels_and_mask: tuple[torch.Tensor, torch.Tensor],
    *,
    group: ProcessGroup | None = None,
    fused: bool = False,
    moe_losses: list[torch.Tensor] | None = None,
    sequence_group: ProcessGroup | None = None,
    context_parallel_size: int = 1,
    reduction: Literal["mean", "sum"] = "mean",
) -> torch.Tensor:
    """``loss_fn`` of the pipeline: masked mean of the vocab-parallel cross entropy (+ an MoE model's MoE term,
    appended to ``moe_losses`` for the log).

    Args:
        logits: ``[s, b, vp]`` fp32 (padded columns ``-inf``).
        labels_and_mask: ``(labels [b, s] int64, loss_mask [b, s])``.
        group: the TP group the vocabulary is split over (``GPTModelPipe`` binds its context's).
        fused: the fused cross-entropy kernels where built (``--cross-entropy-loss-fusion``); they write the
            gradient over ``logits``.
        sequence_group, context_parallel_size: context parallelism (``loss_func``): the loss is the mean over the
            whole sequence, split over ``sequence_group``; the pipe carries this rank's ``[s/cp, b, h]`` tokens.
        reduction: ``loss_func``'s: ``"sum"`` when the loss mask holds --sft's global per-token weights.
    """
    if isinstance(logits, tuple):  # an MoE model: (logits, moe_loss [1])
        logits, moe_loss = logits
        lm = pipe_loss_fn(logits, labels_and_mask, group=group, fused=fused, reduction=reduction)
        return lm + record_moe_loss(moe_loss, moe_losses)
    labels, loss_mask = labels_and_mask
    kernels = fused_kernels.cross_entropy_kernels(logits) if fused else None
    per_token = vocab_parallel_cross_entropy(
        logits, labels.transpose(0, 1).contiguous(), group=group, local_kernels=kernels
    )  # [s, b]
    return loss_func(
        per_token.transpose(0, 1),
        loss_mask,
        sequence_parallel_group=sequence_group,
        context_parallel_size=context_parallel_size,
        reduction=reduction,
    )  # [s, b] -> [b, s] -> scalar


def _checkpoint_chunk(
    function: Callable[..., PipeActivation],
    hidden: torch.Tensor,
    *rest: torch.Tensor,
    group: ProcessGroup | None = None,
    use_deepspeed: bool = False,
) -> PipeActivation:
    """Activation checkpointing of a chunk of transformer layers on ``(hidden, position_ids[, document_ids][,
    moe_loss])``.

    Only ``hidden`` is saved and differentiated; the rest (ids without gradient) is passed through. Uses
    :func:`~megatron.model.transformer.checkpoint_chunk` (``mpu.random.checkpoint`` on the model's TP ``group``,
    or DeepSpeed's with ``use_deepspeed``), which restores the CPU/CUDA and tracker RNG states for the
    recomputation.
    """
    out = checkpoint_chunk(
        lambda h: function(h, *rest)[0], hidden, group=group, use_deepspeed=use_deepspeed
    )
    return cast(PipeActivation, (out, *rest))


def _check_topology(topology: ProcessTopology, parallel: ParallelContext) -> None:
    """DeepSpeed's topology must place this rank where the context's TP group does (the pipeline coordinates are
    checked against ``parallel_state`` by the trainer once the engine exists)."""
    rank = dist.get_rank()
    coord = topology.get_coord(rank)
    tp_size, tp_rank = parallel.tp_size, parallel.tp_rank
    if (topology.get_dim("model"), coord.model) != (tp_size, tp_rank):
        raise RuntimeError(
            f"GPTModelPipe topology (model={topology.get_dim('model')}; rank {rank} at model {coord.model}) "
            f"disagrees with its ParallelContext (tp={tp_size}, tp rank {tp_rank}); build it as "
            "PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp) over the same TP groups."
        )


class GPTModelPipe(PipelineModule):
    """GPT/LLaMA as a DeepSpeed pipeline (see the module docstring for layers, batch format and loss).

    Args:
        config: architecture (``vocab_size`` set).
        parallel: the TP group, sequence parallelism, seed (the same values as ``GPTModel`` for every parameter),
            dtype and device of the parameters (DeepSpeed moves the module to the accelerator anyway). With TP > 1
            and sequence parallelism set the DeepSpeed config's ``pipeline.pipe_partitioned`` /
            ``grad_partitioned`` to false (they assume TP-replicated activations).
        topology: ``PipeModelDataParallelTopology(num_pp, num_mp=tp, num_dp)``, over the same TP groups.
        activation_checkpoint_interval: layers per checkpointed chunk (0 = off); only chunks made entirely of
            ``ParallelTransformerLayerPipe`` are checkpointed, through ``_checkpoint_chunk``.
        loss_reduction: ``"sum"`` when the loss mask holds per-token weights that already normalize (--sft's
            global per-token mean, ``training/token_weights.py``); ``"mean"``: the masked mean per micro-batch.

    Raises:
        ValueError: bad shapes for the TP size; RuntimeError: topology and ``parallel`` disagree.
    """

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        *,
        topology: ProcessTopology,
        activation_checkpoint_interval: int = 0,
        loss_reduction: Literal["mean", "sum"] = "mean",
    ) -> None:
        check_tensor_parallel_shapes(config, parallel.tp_size)
        _check_topology(topology, parallel)
        padded = padded_vocab_size(
            config.vocab_size, config.make_vocab_size_divisible_by, parallel.tp_size
        )

        def tied_embedding(**extra: Any) -> TiedLayerSpec:
            # the word embeddings of the first stage and the output layer of the last share one weight
            return TiedLayerSpec(
                "embed",
                EmbeddingPipe,
                config,
                parallel,
                padded_vocab=padded,
                tied_weight_attr=["word_embeddings.weight"],
                **extra,
            )

        untied = config.untie_embeddings_and_output_weights
        norm_cls = RMSNormPipe if config.normalization == "rmsnorm" else LayerNormPipe
        specs: list = [
            _check_pipe_inputs,
            LayerSpec(EmbeddingPipe, config, parallel, padded_vocab=padded)
            if untied
            else tied_embedding(),
            *(
                LayerSpec(ParallelTransformerLayerPipe, config, parallel, layer_number=i)
                for i in range(config.num_layers)
            ),
            LayerSpec(norm_cls, config.hidden_size, **norm_kwargs(config, parallel)),
            LayerSpec(LMHeadPipe, config, parallel, padded_vocab=padded)
            if untied
            else tied_embedding(with_position_embeddings=False, forward_fn=_tied_logits),
        ]
        specs.append(_logits_to_fp32)
        moe_losses: list[torch.Tensor] = []  # each micro-batch's MoE term (last stage), logged
        super().__init__(
            layers=specs,
            topology=topology,
            loss_fn=functools.partial(
                pipe_loss_fn,
                group=parallel.tp_group,
                fused=config.cross_entropy_loss_fusion,
                moe_losses=moe_losses,
                sequence_group=parallel.sequence_group,
                context_parallel_size=parallel.cp_size,
                reduction=loss_reduction,
            ),
            partition_method="type:transformer",
            activation_checkpoint_interval=activation_checkpoint_interval,
            activation_checkpoint_func=functools.partial(
                _checkpoint_chunk,
                group=parallel.tp_group,
                use_deepspeed=config.deepspeed_activation_checkpointing,
            ),
            checkpointable_layers=["ParallelTransformerLayerPipe"],
        )
        self.config = config
        self.parallel = parallel
        self.padded_vocab = padded
        self.moe_losses = moe_losses
