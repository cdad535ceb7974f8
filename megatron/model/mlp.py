"""Tensor-parallel MLP: GeLU (tanh approximation) or SwiGLU.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``f`` ffn size, ``p`` TP size, ``fp = f/p``.

``dense_h_to_4h`` is column-parallel (``[h] -> [fp]``, or ``[2fp]`` with SwiGLU), ``dense_4h_to_h`` row-parallel
(``[fp] -> [h]``). SwiGLU: per TP rank the first half of the local ``dense_h_to_4h`` output is the gate, the second
half the up-projection: ``silu(gate) * up``. The weight is initialized with ``stride=2``, so TP rank ``t`` holds
``[gate rows t*fp..(t+1)*fp-1 ; up rows t*fp..(t+1)*fp-1]`` and the TP=1 full weight is ``[gate_full; up_full]``.

GeLU is the tanh approximation (Megatron's fused ``bias_gelu`` default, Hugging Face GPT-2's ``gelu_new``).

``dense_h_to_4h`` returns its bias unadded (``skip_bias_add``): the bias add and the activation run as one op,
``fused_kernels.bias_gelu`` / ``bias_swiglu`` (one kernel where built, unless ``--no-bias-gelu-fusion`` /
``--no-bias-swiglu-fusion``; the reference ``act(x + bias)`` otherwise: the same math either way).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron import fused_kernels
from megatron.config import ModelConfig
from megatron.layout.names import layer_param_name
from megatron.model.lora import maybe_add_lora
from megatron.model.utils import init_seed
from megatron.mpu.context import ParallelContext
from megatron.mpu.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    WeightInit,
    init_method_normal,
    scaled_init_method_normal,
)


class ParallelMLP(nn.Module):
    """MLP of one transformer layer.

    Args:
        config: ``hidden_size``, ``ffn_size``, ``swiglu``, ``add_bias_linear``, ``init_method_std``, ``num_layers``.
        parallel: the TP group the FFN width is split over; sequence parallelism (input and output
            ``[s/p, b, h]``); the seed; dtype, device.
        layer_number: global 0-based layer index (names/seeds ``layers.{i}.mlp.*``).
        name: the module's name in its layer, the prefix of its seed names (an MoE expert's is
            ``mlp.deepspeed_moe.experts.deepspeed_experts.{global expert id}``).

    The forward returns ``(output, bias)``: ``dense_4h_to_h``'s bias is not added (bias-dropout-add does it).
    """

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        *,
        layer_number: int,
        name: str = "mlp",
    ) -> None:
        super().__init__()
        self.swiglu = config.swiglu
        self.fused = config.bias_swiglu_fusion if config.swiglu else config.bias_gelu_fusion

        def seed_of(suffix: str) -> int | None:
            return init_seed(config, parallel, layer_param_name(layer_number, f"{name}.{suffix}"))

        ffn = config.ffn_size
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size,
            2 * ffn if self.swiglu else ffn,
            bias=config.add_bias_linear,
            gather_output=False,
            init=WeightInit(
                init_method_normal(config.init_method_std), seed_of("dense_h_to_4h.weight")
            ),
            stride=2 if self.swiglu else 1,
            skip_bias_add=True,
            tp=parallel.tp_settings,
        )
        self.dense_4h_to_h = RowParallelLinear(
            ffn,
            config.hidden_size,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            init=WeightInit(
                scaled_init_method_normal(config.init_method_std, config.num_layers),
                seed_of("dense_4h_to_h.weight"),
            ),
            skip_bias_add=True,
            tp=parallel.tp_settings,
        )
        if name == "mlp":  # not an expert's MLP (LoRA on MoE experts is refused by the config)
            for linear, target, local in (
                (self.dense_h_to_4h, "fc1", "dense_h_to_4h"),
                (self.dense_4h_to_h, "fc2", "dense_4h_to_h"),
            ):
                full_name = layer_param_name(layer_number, f"mlp.{local}")
                maybe_add_lora(linear, config.lora, target, name=full_name, parallel=parallel)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[s(/p), b, h] -> (output [s(/p), b, h], bias [h] or None)``."""
        # [s(/p), b, h] -> [s, b, fp] (or [s, b, 2fp]: gate | up), bias [fp] (or [2fp]) not yet added
        inter, bias = self.dense_h_to_4h(hidden_states)
        if self.swiglu:
            inter = fused_kernels.bias_swiglu(inter, bias, fused=self.fused)  # -> [s, b, fp]
        else:
            # inter feeds dense_4h_to_h alone, whose backward hands over a fresh gradient: the GeLU backward may
            # write its own over it
            inter = fused_kernels.bias_gelu(inter, bias, fused=self.fused, overwrite_grad=True)
        return self.dense_4h_to_h(inter)  # [s, b, fp] -> [s(/p), b, h]
