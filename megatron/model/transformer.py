"""Pre-LN transformer layer and the encoder stack (layers + final norm), Megatron names.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``p`` TP size; activations are ``[s, b, h]``, or
``[s/p, b, h]`` between TP regions under sequence parallelism.

    x -> input_layernorm -> self_attention -> (+bias, dropout) + x
      -> post_attention_layernorm -> mlp -> (+bias, dropout) + x

Bias-dropout-add: the row-parallel bias is replicated over TP; under sequence parallelism each rank adds it to its
own sequence slice, so its gradient must be summed over TP. ``RowParallelLinear`` (``skip_bias_add=True``) already
returns it wrapped in ``copy_to_tensor_model_parallel_region`` in that case, so it is added here as returned.
Hidden dropout uses the default RNG when activations are replicated over TP (all TP ranks draw the same mask) and
the model-parallel tracker fork under sequence parallelism (each rank owns different tokens), as in Megatron.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.model.attention import AttentionMask, ParallelAttention
from megatron.model.inference import InferenceParams
from megatron.model.mlp import ParallelMLP
from megatron.model.norms import norm_class
from megatron.model.switch_mlp import SwitchMLP
from megatron.mpu.context import ParallelContext
from megatron.mpu.parallel_state import ProcessGroup
from megatron.mpu.random import checkpoint, get_cuda_rng_tracker

Rotary = tuple[torch.Tensor, torch.Tensor]


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    *,
    p: float,
    training: bool,
    sequence_parallel: bool,
) -> torch.Tensor:
    """``residual + dropout(x + bias)``; all ``[s(/p), b, h]``, bias ``[h]`` as ``RowParallelLinear`` returns it.

    ``sequence_parallel`` selects the dropout RNG: the tracker fork (tokens differ per TP rank) or the default.
    """
    if bias is not None:
        x = x + bias
    if training and p > 0.0:
        rng = get_cuda_rng_tracker().fork() if sequence_parallel else contextlib.nullcontext()
        with rng:
            x = F.dropout(x, p=p, training=True)
    return residual + x


def norm_kwargs(config: ModelConfig, parallel: ParallelContext) -> dict[str, Any]:
    """The keyword arguments of the model's norms (``LayerNorm`` / ``RMSNorm`` after ``hidden_size``)."""
    return {
        "eps": config.layernorm_epsilon,
        "apply_layernorm_1p": config.apply_layernorm_1p,
        "sequence_parallel": parallel.sequence_parallel,
        "group": parallel.tp_group,
        "params_dtype": parallel.params_dtype,
        "device": parallel.device,
        "fused": config.persist_layer_norm,
    }


def config_norm(config: ModelConfig, parallel: ParallelContext) -> nn.Module:
    """The model's norm (``--normalization``, ``--layernorm-epsilon``) over ``[*, h]``."""
    return norm_class(config.normalization)(config.hidden_size, **norm_kwargs(config, parallel))


def checkpoint_chunk(
    function: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
    *,
    group: ProcessGroup | None,
    use_deepspeed: bool,
) -> torch.Tensor:
    """``function(hidden_states)`` (a chunk of layers, ``[s(/p), b, h] -> [s(/p), b, h]``) with full recomputation.

    ``use_deepspeed`` (--deepspeed-activation-checkpointing): ``deepspeed.checkpointing.checkpoint``, with the
    options the trainer configured once (partitioned over DeepSpeed's mpu TP group, contiguous buffers, CPU
    copies); otherwise ``mpu.random.checkpoint`` on ``group``. Both restore the CPU/CUDA default RNG states and
    the same tracker (DeepSpeed's is Trident's, see ``megatron/training/activation_checkpointing.py``), so the
    recomputed dropout masks, and hence losses and gradients, are the same either way.

    Raises:
        RuntimeError: ``use_deepspeed`` but DeepSpeed's checkpointing was never configured.
    """
    if not use_deepspeed:
        return checkpoint(function, False, hidden_states, group=group)
    import deepspeed

    if not deepspeed.checkpointing.is_configured():
        raise RuntimeError(
            "--deepspeed-activation-checkpointing: deepspeed.checkpointing is not configured; call "
            "megatron.training.activation_checkpointing.configure_deepspeed_checkpointing(model_config) first"
        )
    return deepspeed.checkpointing.checkpoint(function, hidden_states)


class ParallelTransformerLayer(nn.Module):
    """One pre-LN decoder layer (state-dict keys ``input_layernorm``, ``self_attention``,
    ``post_attention_layernorm``, ``mlp``).

    Args:
        config: model config.
        parallel: TP group, sequence parallelism, seed (parameter values = f(seed, global name)), dtype, device.
        layer_number: global 0-based index (the same on every pipeline layout; names and seeds use it).
    """

    def __init__(
        self, config: ModelConfig, parallel: ParallelContext, *, layer_number: int
    ) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = parallel.sequence_parallel
        self.input_layernorm = config_norm(config, parallel)
        self.self_attention = ParallelAttention(config, parallel, layer_number=layer_number)
        self.post_attention_layernorm = config_norm(config, parallel)
        num_experts = config.moe.experts_per_layer(config.num_layers)[layer_number]
        # an MoE layer where --num-experts / --expert-interval make one (megatron/model/moe.py); else a Switch
        # MLP with --num-experts-switch (megatron/model/switch_mlp.py), as Megatron-DeepSpeed; else the dense MLP
        self.mlp: nn.Module
        if num_experts > 1:
            # MoEMLP subclasses DeepSpeed's MoE: DeepSpeed is imported only where MoE is built
            from megatron.model.moe import MoEMLP

            self.mlp = MoEMLP(config, parallel, layer_number=layer_number, num_experts=num_experts)
        elif config.moe.num_experts_switch is not None:
            self.mlp = SwitchMLP(config, parallel, layer_number=layer_number)
        else:
            self.mlp = ParallelMLP(config, parallel, layer_number=layer_number)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: Rotary | None = None,
        attention_mask: AttentionMask = None,
        inference_params: InferenceParams | None = None,
    ) -> torch.Tensor:
        """``[s(/p), b, h] -> [s(/p), b, h]``; ``rotary`` = (cos, sin) ``[s, b, 1, hn]`` or None;
        ``inference_params``: the generation KV cache (None in training)."""
        attn_out, attn_bias = self.self_attention(
            self.input_layernorm(hidden_states), rotary, attention_mask, inference_params
        )
        hidden_states = bias_dropout_add(
            attn_out,
            attn_bias,
            hidden_states,
            p=self.hidden_dropout,
            training=self.training,
            sequence_parallel=self.sequence_parallel,
        )
        mlp_out, mlp_bias = self.mlp(self.post_attention_layernorm(hidden_states))
        return bias_dropout_add(
            mlp_out,
            mlp_bias,
            hidden_states,
            p=self.hidden_dropout,
            training=self.training,
            sequence_parallel=self.sequence_parallel,
        )


class ParallelTransformer(nn.Module):
    """The encoder of ``GPTModel``: ``layers.{i}`` and ``final_layernorm``.

    Args:
        config: model config (``recompute_granularity == "full"`` checkpoints, through :func:`checkpoint_chunk`,
            every chunk of ``recompute_num_layers`` layers (``recompute_method`` uniform) or each of the first
            ``recompute_num_layers`` layers (block); ``deepspeed_activation_checkpointing`` picks DeepSpeed's
            checkpoint function).
        parallel: as :class:`ParallelTransformerLayer`.
    """

    def __init__(self, config: ModelConfig, parallel: ParallelContext) -> None:
        super().__init__()
        self.tp_group = parallel.tp_group
        self.recompute = config.recompute_granularity == "full"
        self.recompute_method = config.recompute_method or "uniform"
        self.recompute_num_layers = max(1, config.recompute_num_layers)
        self.deepspeed_checkpointing = config.deepspeed_activation_checkpointing
        self.layers = nn.ModuleList(
            ParallelTransformerLayer(config, parallel, layer_number=i)
            for i in range(config.num_layers)
        )
        self.final_layernorm = config_norm(config, parallel)

    def _run_chunk(
        self,
        start: int,
        end: int,
        rotary: Rotary | None,
        attention_mask: AttentionMask,
        inference_params: InferenceParams | None = None,
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(hidden: torch.Tensor) -> torch.Tensor:
            for layer in self.layers[start:end]:
                hidden = layer(hidden, rotary, attention_mask, inference_params)
            return hidden

        return run

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: Rotary | None = None,
        attention_mask: AttentionMask = None,
        inference_params: InferenceParams | None = None,
    ) -> torch.Tensor:
        """``[s(/p), b, h] -> [s(/p), b, h]``: all layers, then the final norm (``inference_params``: KV cache)."""
        num = len(self.layers)
        recompute = self.recompute and self.training
        # uniform: every chunk of recompute_num_layers layers is checkpointed; block: each of the first
        # recompute_num_layers layers is, the rest keep their activations (Megatron's two methods).
        block = recompute and self.recompute_method == "block"
        step = 1 if block else self.recompute_num_layers if recompute else num
        for start in range(0, num, max(step, 1)):
            run = self._run_chunk(
                start, min(start + step, num), rotary, attention_mask, inference_params
            )
            if recompute and (not block or start < self.recompute_num_layers):
                hidden_states = checkpoint_chunk(
                    run,
                    hidden_states,
                    group=self.tp_group,
                    use_deepspeed=self.deepspeed_checkpointing,
                )
            else:
                hidden_states = run(hidden_states)
        return self.final_layernorm(hidden_states)
