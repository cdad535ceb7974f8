"""Megatron-LM's Switch MLP (``--num-experts-switch N``): a top-1 router over ``N`` tensor-parallel expert MLPs.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``t = s*b`` tokens, ``N`` experts, ``p`` TP size.

This is the MoE of Megatron-DeepSpeed's ``SwitchMLP``, not DeepSpeed-MoE (``--num-experts``, ``model/moe.py``): no
expert parallelism, no capacity (no token is dropped), no load-balancing loss. Every rank holds every expert, each
split over TP like the dense MLP; every TP rank computes the same routing from the replicated router::

    x [s, b, h] -> router (Linear h -> N, with bias) -> softmax -> (prob, expert) = max over N      per token
      -> expert e runs on the tokens routed to it:  y = (expert_e(x) + bias_e) * prob
      -> [s, b, h]

State-dict keys are Megatron-DeepSpeed's: ``mlp.router.{weight,bias}``, ``mlp.experts.{e}.dense_h_to_4h.*``,
``mlp.experts.{e}.dense_4h_to_h.*``. Every tensor is drawn from ``(seed, its global name)`` (router bias zero), so
the model is the same on every TP / PP / DP layout. Megatron's ``--sequence-parallel`` is refused with it
(``config/moe_rules.py``): the router weight would then see different tokens on each TP rank.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.layout.names import layer_param_name
from megatron.model.mlp import ParallelMLP
from megatron.model.utils import init_seed
from megatron.mpu.context import ParallelContext
from megatron.mpu.random import param_seed


class SwitchMLP(nn.Module):
    """Top-1 routed MLP of one transformer layer (see the module docstring).

    Args:
        config: model config (``config.moe.num_experts_switch`` experts, each a ``ParallelMLP`` of this config).
        parallel: TP group the experts are split over, seed, dtype, device.
        layer_number: global 0-based layer index (names ``layers.{i}.mlp.*``).

    The forward returns ``(output [s, b, h], None)`` like ``ParallelMLP`` (the experts' biases are inside it).
    """

    def __init__(
        self, config: ModelConfig, parallel: ParallelContext, *, layer_number: int
    ) -> None:
        super().__init__()
        num = config.moe.num_experts_switch or 1
        self.router = nn.Linear(
            config.hidden_size,
            num,
            dtype=parallel.params_dtype,
            device=parallel.device,
        )
        seed = init_seed(config, parallel, layer_param_name(layer_number, "mlp.router.weight"))
        gen = torch.Generator().manual_seed(
            seed if seed is not None else param_seed(parallel.seed, f"switch.{layer_number}")
        )
        with torch.no_grad():
            drawn = torch.empty(num, config.hidden_size).normal_(
                0.0, config.init_method_std, generator=gen
            )
            self.router.weight.copy_(drawn.to(self.router.weight.dtype))
            self.router.bias.zero_()
        self.experts = nn.ModuleList(
            ParallelMLP(config, parallel, layer_number=layer_number, name=f"mlp.experts.{e}")
            for e in range(num)
        )

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``[s, b, h] -> ([s, b, h], None)``."""
        s, b, h = hidden_states.shape
        x = hidden_states.reshape(s * b, h)  # [s, b, h] -> [t, h]
        route = torch.softmax(self.router(x).float(), dim=-1)  # [t, N], fp32
        prob, expert = route.max(dim=-1)  # [t], [t]
        out = torch.zeros_like(x)  # [t, h]
        for e, mlp in enumerate(self.experts):
            idx = (expert == e).nonzero(as_tuple=True)[0]  # [t_e]
            # Every TP rank routes alike, so each expert's TP collectives run on every rank (even with t_e = 0).
            y, bias = mlp(x.index_select(0, idx).unsqueeze(1))  # [t_e, 1, h] -> [t_e, 1, h]
            y = y.squeeze(1) if bias is None else y.squeeze(1) + bias
            out = out.index_copy(0, idx, y)  # rows idx of [t, h]
        out = out * prob.unsqueeze(-1).to(out.dtype)  # [t, h] * [t, 1]
        return out.reshape(s, b, h), None  # [t, h] -> [s, b, h]
