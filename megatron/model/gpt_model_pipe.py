"""``GPTModelPipe``: the same model as ``GPTModel`` as a DeepSpeed ``PipelineModule`` (pipeline + ZeRO-0/1).

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``p`` TP size, ``L`` layers, ``v`` padded vocab, ``vp = v/p``.

Layer list (indices follow Megatron-DeepSpeed, so checkpoint files ``layer_XX-model_YY-model_states.pt`` line up)::

    0        _check_pipe_inputs           ((input_ids, position_ids))  -> same
    1        TiedLayerSpec('embed', EmbeddingPipe)                      -> (hidden [s(/p), b, h], position_ids)
    2..L+1   ParallelTransformerLayerPipe(layer_number = idx-2)         -> (hidden, position_ids)
    L+2      LayerNormPipe / RMSNormPipe (final norm)                    -> hidden
    L+3      TiedLayerSpec('embed', forward_fn=_tied_logits)  or  LMHeadPipe (untied)  -> logits [s, b, vp]
    L+4      _logits_to_fp32                                            -> fp32 logits
    loss_fn  pipe_loss_fn(logits, (labels, loss_mask)) = masked mean of the vocab-parallel cross entropy

Pipe batch, as ``engine.train_batch`` pulls it from the data iterator per micro-batch:
``((input_ids [b, s], position_ids [b, s]), (labels [b, s], loss_mask [b, s]))``. The causal mask and the RoPE
tables are computed inside the layers; ``position_ids`` (int64, no gradient) travel with the hidden states.

Names and seeds: each parameter is drawn from ``param_seed(seed, GPTModel name)`` (layer ``i`` has the same name
on every stage), so ``GPTModelPipe`` and ``GPTModel`` start from identical weights on every layout.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import ProcessTopology
from torch import nn

from megatron.config import ModelConfig
from megatron.model.language_model import (
    Embedding,
    build_output_layer,
    mask_padded_vocab,
    parallel_lm_logits,
)
from megatron.model.norms import LayerNorm, RMSNorm
from megatron.model.rotary import rotary_cos_sin
from megatron.model.transformer import ParallelTransformerLayer
from megatron.model.utils import (
    FINAL_NORM_PREFIX,
    OUTPUT_LAYER_NAME,
    check_tensor_parallel_shapes,
    layer_param_name,
    loss_func,
    padded_vocab_size,
    tensor_parallel_rank_and_size,
)
from megatron.mpu import parallel_state
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.mpu.random import checkpoint

PipeActivation = tuple[torch.Tensor, torch.Tensor]


class _VocabInfo:
    """What the logits need besides the weight (kept on the modules that produce logits)."""

    def __init__(
        self, vocab_size: int, tp_rank: int, tp_size: int, sequence_parallel: bool
    ) -> None:
        self.vocab_size = vocab_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.sequence_parallel = sequence_parallel

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = parallel_lm_logits(
            hidden, weight, sequence_parallel=self.sequence_parallel, tp_size=self.tp_size
        )  # [s(/p), b, h] -> [s, b, vp]
        return mask_padded_vocab(out, self.vocab_size, self.tp_rank)


class EmbeddingPipe(Embedding):
    """:class:`Embedding` taking and returning pipe tuples; also the tied output layer (``_tied_logits``)."""

    def __init__(self, config: ModelConfig, *, vocab_info: _VocabInfo, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.vocab_info = vocab_info

    def forward(self, inputs: PipeActivation) -> PipeActivation:  # type: ignore[override]
        """``(input_ids [b, s], position_ids [b, s]) -> (hidden [s(/p), b, h], position_ids)``."""
        input_ids, position_ids = inputs
        return super().forward(input_ids, position_ids), position_ids


def _tied_logits(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """Output layer tied to the word embeddings: ``[s(/p), b, h] -> [s, b, vp]`` (padded columns ``-inf``)."""
    return embedding.vocab_info.logits(hidden, embedding.word_embeddings.weight)


class ParallelTransformerLayerPipe(ParallelTransformerLayer):
    """:class:`ParallelTransformerLayer` on pipe tuples; RoPE tables from ``position_ids`` (never sent)."""

    def __init__(self, config: ModelConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.rope = config.use_rotary_position_embeddings
        self.head_dim = config.head_dim
        self.theta = config.rotary_position_embeddings_theta

    def forward(self, inputs: PipeActivation) -> PipeActivation:  # type: ignore[override]
        """``(hidden [s(/p), b, h], position_ids [b, s]) -> (hidden, position_ids)`` (causal attention)."""
        hidden, position_ids = inputs
        rotary = None
        if self.rope:
            rotary = rotary_cos_sin(position_ids, self.head_dim, self.theta, hidden.dtype)
        return super().forward(hidden, rotary, None), position_ids


class LayerNormPipe(LayerNorm):
    """Final LayerNorm on the pipe tuple: ``(hidden, position_ids) -> hidden``."""

    def forward(self, inputs: PipeActivation) -> torch.Tensor:  # type: ignore[override]
        return super().forward(inputs[0])


class RMSNormPipe(RMSNorm):
    """Final RMSNorm on the pipe tuple: ``(hidden, position_ids) -> hidden``."""

    def forward(self, inputs: PipeActivation) -> torch.Tensor:  # type: ignore[override]
        return super().forward(inputs[0])


class LMHeadPipe(nn.Module):
    """Untied output layer (``lm_head``, column-parallel ``[vp, h]``): ``[s(/p), b, h] -> [s, b, vp]``."""

    def __init__(self, config: ModelConfig, *, vocab_info: _VocabInfo, **kwargs: Any) -> None:
        super().__init__()
        self.vocab_info = vocab_info
        self.lm_head = build_output_layer(config, tp_rank=vocab_info.tp_rank, **kwargs)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.vocab_info.logits(hidden, self.lm_head.weight)


def _check_pipe_inputs(inputs: PipeActivation) -> PipeActivation:
    """First pipe layer: the micro-batch must be ``(input_ids [b, s], position_ids [b, s])``."""
    if (
        not isinstance(inputs, (tuple, list))
        or len(inputs) != 2
        or inputs[0].dim() != 2
        or inputs[0].shape != inputs[1].shape
    ):
        got = (
            [tuple(t.shape) for t in inputs]
            if isinstance(inputs, (tuple, list))
            else type(inputs).__name__
        )
        raise ValueError(
            "GPTModelPipe expects each micro-batch as ((input_ids [b, s], position_ids [b, s]), "
            f"(labels [b, s], loss_mask [b, s])); the inputs part was {got}."
        )
    input_ids, position_ids = inputs
    return input_ids, position_ids


def _logits_to_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Last pipe layer: the cross entropy runs in fp32."""
    return logits.float()


def pipe_loss_fn(
    logits: torch.Tensor, labels_and_mask: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """``loss_fn`` of the pipeline: masked mean of the vocab-parallel cross entropy.

    Args:
        logits: ``[s, b, vp]`` fp32 (padded columns ``-inf``).
        labels_and_mask: ``(labels [b, s] int64, loss_mask [b, s])``.
    """
    labels, loss_mask = labels_and_mask
    per_token = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous())  # [s, b]
    return loss_func(per_token.transpose(0, 1), loss_mask)  # [s, b] -> [b, s] -> scalar


def _checkpoint_chunk(
    function: Callable[..., PipeActivation], hidden: torch.Tensor, *rest: torch.Tensor
) -> PipeActivation:
    """Activation checkpointing of a chunk of transformer layers on ``(hidden, position_ids)``.

    Only ``hidden`` is saved and differentiated; ``position_ids`` (no gradient) is passed through. Uses
    ``mpu.random.checkpoint``, which restores the CPU/CUDA and tracker RNG states for the recomputation.
    """
    out = checkpoint(lambda h: function(h, *rest)[0], False, hidden)
    return (out, *rest)


def pipe_to_megatron_name(key: str, num_layers: int) -> str:
    """Map a ``GPTModelPipe`` state-dict key to its ``GPTModel`` (Megatron) name.

    ``tied_modules.embed.word_embeddings.weight`` -> ``language_model.embedding.word_embeddings.weight``,
    ``3.self_attention.dense.weight`` -> ``language_model.encoder.layers.1.self_attention.dense.weight``,
    ``{L+2}.weight`` -> ``language_model.encoder.final_layernorm.weight``,
    ``{L+3}.lm_head.weight`` -> ``language_model.output_layer.weight``.

    Raises:
        ValueError: for a key that is not part of ``GPTModelPipe``.
    """
    if key.startswith("tied_modules.embed."):
        return "language_model.embedding." + key[len("tied_modules.embed.") :]
    m = re.fullmatch(r"(\d+)\.(.+)", key)
    if m:
        idx, rest = int(m.group(1)), m.group(2)
        if idx == 1:
            return "language_model.embedding." + rest
        if 2 <= idx < num_layers + 2:
            return layer_param_name(idx - 2, rest)
        if idx == num_layers + 2:
            return f"{FINAL_NORM_PREFIX}.{rest}"
        if idx == num_layers + 3 and rest == "lm_head.weight":
            return OUTPUT_LAYER_NAME
    raise ValueError(f"{key!r} is not a GPTModelPipe parameter of a {num_layers}-layer model.")


def _check_topology(topology: ProcessTopology, tp_rank: int, tp_size: int) -> None:
    rank = dist.get_rank()
    coord = topology.get_coord(rank)
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if (
        topology.get_dim("model"),
        topology.get_dim("pipe"),
        coord.model,
        coord.pipe,
    ) != (tp_size, pp_size, tp_rank, pp_rank):
        raise RuntimeError(
            f"GPTModelPipe topology (pipe={topology.get_dim('pipe')}, model={topology.get_dim('model')}; "
            f"rank {rank} at pipe {coord.pipe}, model {coord.model}) disagrees with "
            f"megatron.mpu.parallel_state (pp={pp_size}, tp={tp_size}; pipe rank {pp_rank}, tp rank "
            f"{tp_rank}); build it as PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp) "
            "after initialize_model_parallel(tp, pp)."
        )


class GPTModelPipe(PipelineModule):
    """GPT/LLaMA as a DeepSpeed pipeline (see the module docstring for layers, batch format and loss).

    Args:
        config: architecture (``vocab_size`` set).
        seed: the run's seed (same values as ``GPTModel`` for every parameter).
        topology: ``PipeModelDataParallelTopology(num_pp, num_mp=tp, num_dp)``, matching ``parallel_state``.
        params_dtype, device: of the parameters (DeepSpeed moves the module to the accelerator anyway).
        sequence_parallel: Megatron SP (no-op at TP = 1). With TP > 1 and SP set the DeepSpeed config's
            ``pipeline.pipe_partitioned`` / ``grad_partitioned`` to false (they assume TP-replicated activations).
        activation_checkpoint_interval: layers per checkpointed chunk (0 = off); only chunks made entirely of
            ``ParallelTransformerLayerPipe`` are checkpointed, through ``mpu.random.checkpoint``.

    Raises:
        ValueError: bad shapes for the TP size; RuntimeError: topology and ``parallel_state`` disagree.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        seed: int,
        topology: ProcessTopology,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        sequence_parallel: bool = False,
        activation_checkpoint_interval: int = 0,
    ) -> None:
        tp_rank, tp_size = tensor_parallel_rank_and_size()
        check_tensor_parallel_shapes(config, tp_size)
        _check_topology(topology, tp_rank, tp_size)
        sp = sequence_parallel and tp_size > 1
        padded = padded_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, tp_size)
        info = _VocabInfo(config.vocab_size, tp_rank, tp_size, sp)
        common = {"seed": seed, "params_dtype": params_dtype, "device": device}
        embed = {"padded_vocab": padded, "sequence_parallel": sp, "vocab_info": info, **common}
        specs: list = [_check_pipe_inputs]
        if config.untie_embeddings_and_output_weights:
            specs.append(LayerSpec(EmbeddingPipe, config, **embed))
        else:
            specs.append(
                TiedLayerSpec(
                    "embed",
                    EmbeddingPipe,
                    config,
                    tied_weight_attr=["word_embeddings.weight"],
                    **embed,
                )
            )
        specs += [
            LayerSpec(
                ParallelTransformerLayerPipe, config, layer_number=i, sequence_parallel=sp, **common
            )
            for i in range(config.num_layers)
        ]
        norm_cls = RMSNormPipe if config.normalization == "rmsnorm" else LayerNormPipe
        specs.append(
            LayerSpec(
                norm_cls,
                config.hidden_size,
                eps=config.layernorm_epsilon,
                sequence_parallel=sp,
                params_dtype=params_dtype,
                device=device,
            )
        )
        if config.untie_embeddings_and_output_weights:
            specs.append(
                LayerSpec(LMHeadPipe, config, padded_vocab=padded, vocab_info=info, **common)
            )
        else:
            specs.append(
                TiedLayerSpec(
                    "embed",
                    EmbeddingPipe,
                    config,
                    with_position_embeddings=False,
                    forward_fn=_tied_logits,
                    tied_weight_attr=["word_embeddings.weight"],
                    **embed,
                )
            )
        specs.append(_logits_to_fp32)
        super().__init__(
            layers=specs,
            topology=topology,
            loss_fn=pipe_loss_fn,
            partition_method="type:transformer",
            activation_checkpoint_interval=activation_checkpoint_interval,
            activation_checkpoint_func=_checkpoint_chunk,
            checkpointable_layers=["ParallelTransformerLayerPipe"],
        )
        self.config = config
        self.padded_vocab = padded
