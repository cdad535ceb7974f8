"""DeepSpeed-MoE layer in place of a transformer layer's MLP (``--num-experts``), experts = our ``ParallelMLP``.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``f`` ffn size, ``p`` TP size, ``E`` experts of the layer,
``ep`` expert-parallel size, ``El = E/ep`` local experts, ``C`` expert capacity (tokens per expert).

    x [s, b, h] -> gate (wg [E, h], fp32 logits, top-k) -> dispatch [E, C, h] -> (TP > 1: split C over TP ranks)
      -> all-to-all over the EP group -> local experts (El ParallelMLPs) -> all-to-all back -> (gather over TP)
      -> combine [s, b, h];   + l_aux (load-balancing loss of this micro-batch on this rank), exp_counts [E]

``MoEMLP`` is a thin subclass of ``deepspeed.moe.layer.MoE``, so its state-dict keys are DeepSpeed's and
Megatron-DeepSpeed's: ``mlp.deepspeed_moe.gate.wg.weight``,
``mlp.deepspeed_moe.experts.deepspeed_experts.{j}.dense_h_to_4h.weight`` with ``j`` the LOCAL expert index (global
id ``ep_rank * El + j``), and with ``--mlp-type residual`` (PR-MoE) ``mlp.mlp.*`` (a dense TP ``ParallelMLP``) and
``mlp.coefficient.{weight,bias}`` (``[2, h]``, ``[2]``). DeepSpeed would deep-copy one template expert; each local
expert is built from its own global name instead, so every expert tensor is f(seed,
``...deepspeed_experts.{global id}...``): the same model on every EP/TP/DP layout. The gate and the residual
coefficient are drawn from their names too. Experts (and the residual MLP) add their output bias (DeepSpeed drops a
returned one).

Experts are whole on every TP rank (DeepSpeed drops the duplicate tokens over TP before the all-to-all), or TP-split
like the dense MLP with ``--enable-expert-tensor-parallelism``. The layer's aux loss and expert counts of the last
forward stay on the module (``last_aux_loss``, ``last_expert_counts``), and the routed / dropped token counts of the
training forwards since the last ``read_load()``; ``moe_aux_loss`` sums the layers' MoE terms.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from deepspeed.moe.layer import MoE
from torch import nn

from megatron.config import ModelConfig
from megatron.deepspeed_internals import patch_moe_gather_tokens, set_moe_mpu
from megatron.layout.names import layer_param_name
from megatron.model.mlp import ParallelMLP
from megatron.mpu.context import ParallelContext
from megatron.mpu.expert_parallel import single_rank_group
from megatron.mpu.mappings import all_gather_first_dim
from megatron.mpu.random import param_seed

EXPERT_NAME = "mlp.deepspeed_moe.experts.deepspeed_experts"
"""Name of an MoE layer's experts in its transformer layer (``.{j}`` follows)."""


def expert_context(parallel: ParallelContext) -> ParallelContext:
    """The context experts are built with: the layer's TP group with expert TP, else a group of this rank alone
    (whole experts: TP size 1 inside a TP > 1 run)."""
    if parallel.expert_tensor_parallel or parallel.tp_group is None:
        return parallel
    return replace(parallel, tp_group=single_rank_group(), sequence_parallel=False)


def _draw_(weight: torch.Tensor, seed: int, name: str, std: float) -> None:
    """Fill ``weight`` with N(0, std) drawn from ``param_seed(seed, name)`` (layout-invariant)."""
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    with torch.no_grad():
        drawn = torch.empty(weight.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
        weight.copy_(drawn.to(weight.dtype))


class ExpertMLP(ParallelMLP):
    """One expert: ``ParallelMLP`` (the same parameters and names) whose output includes its ``dense_4h_to_h``
    bias (DeepSpeed's ``Experts`` would drop a returned bias)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``[..., h] -> [..., h]`` (DeepSpeed hands each expert its ``[ep, 1, C, h]`` slots)."""
        out, bias = super().forward(hidden_states)
        return out if bias is None else out + bias


class MoEMLP(MoE):
    """DeepSpeed's ``MoE`` with ``ParallelMLP`` experts, built for one transformer layer.

    Args:
        config: model config (``config.moe``: top-k, capacity factors, min capacity, token dropping, 2nd-expert
            sampling, mlp type).
        parallel: TP group, ``expert_parallel_size`` / ``expert_parallel_rank`` / ``expert_tensor_parallel``, seed.
        layer_number: global 0-based layer index.
        num_experts: ``E`` of this layer (divisible by ``parallel.expert_parallel_size``).

    The forward takes ``[s, b, h]`` (whole on every TP rank) and returns ``(output [s, b, h], None)`` like
    ``ParallelMLP`` (the experts' output bias is inside the output).
    """

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        *,
        layer_number: int,
        num_experts: int,
    ) -> None:
        moe, ep = config.moe, parallel.expert_parallel_size
        patch_moe_gather_tokens(all_gather_first_dim)  # DeepSpeed's TP token gather, made gloo-safe
        experts_ctx = expert_context(parallel)
        # DeepSpeed deep-copies its template expert (our linears hold process groups, which do not copy): give
        # it a placeholder, then put the real experts in its place, each built from its global name.
        super().__init__(
            config.hidden_size,
            nn.Identity(),
            num_experts=num_experts,
            ep_size=ep,
            k=moe.topk,
            capacity_factor=moe.moe_train_capacity_factor,
            eval_capacity_factor=moe.moe_eval_capacity_factor,
            min_capacity=moe.moe_min_capacity,
            use_residual=moe.mlp_type == "residual",
            drop_tokens=moe.moe_token_dropping,
            enable_expert_tensor_parallelism=parallel.expert_tensor_parallel,
            top2_2nd_expert_sampling=moe.moe_top2_2nd_expert_sampling,
        )
        self.layer_number = layer_number
        self.loss_coeff = moe.moe_loss_coeff
        local = num_experts // ep
        first = parallel.expert_parallel_rank * local
        experts = self.deepspeed_moe.experts
        experts.deepspeed_experts = nn.ModuleList(
            ExpertMLP(config, experts_ctx, layer_number=layer_number, name=f"{EXPERT_NAME}.{g}")
            for g in range(first, first + local)
        )
        for expert in experts.deepspeed_experts:
            for param in expert.parameters():
                param.allreduce = False  # DeepSpeed's expert markers
                param.group_name = self.expert_group_name
        wg = self.deepspeed_moe.gate.wg.weight
        name = layer_param_name(layer_number, "mlp.deepspeed_moe.gate.wg.weight")
        _draw_(wg, parallel.seed, name, config.init_method_std)
        if self.use_residual:
            self.mlp = ExpertMLP(config, parallel, layer_number=layer_number, name="mlp.mlp")
            name = layer_param_name(layer_number, "mlp.coefficient.weight")
            _draw_(self.coefficient.weight, parallel.seed, name, config.init_method_std)
            with torch.no_grad():
                self.coefficient.bias.zero_()
        self.to(dtype=parallel.params_dtype, device=parallel.device)
        self.last_aux_loss: torch.Tensor | None = None
        self.last_expert_counts: torch.Tensor | None = None
        # training forwards since the last read_load(): tokens routed to each expert, and dropped
        self.load_counts = torch.zeros(num_experts, dtype=torch.float64)
        self.load_dropped = 0.0

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``[s, b, h] -> ([s, b, h], None)``; keeps this micro-batch's aux loss and expert counts."""
        out, l_aux, counts = super().forward(hidden_states)
        self.last_aux_loss = l_aux
        self.last_expert_counts = counts
        if self.training:
            routed = counts.detach().to("cpu", torch.float64)
            self.load_counts += routed
            cap = self.capacity(hidden_states.numel() // hidden_states.shape[-1])
            if cap is not None:
                self.load_dropped += float((routed - cap).clamp(min=0).sum())
        return out, None

    def read_load(self) -> tuple[torch.Tensor, float]:
        """(tokens routed to each expert ``[E]``, tokens dropped) over this rank's training forwards since the last
        call, then reset. Routed counts each (token, chosen expert) pair: top-2 routes every token twice."""
        out = (self.load_counts.clone(), self.load_dropped)
        self.load_counts.zero_()
        self.load_dropped = 0.0
        return out

    def capacity(self, num_tokens: int) -> int | None:
        """Expert capacity ``C`` for ``num_tokens`` local tokens with token dropping (None: no dropping)."""
        gate = self.deepspeed_moe.gate
        if not gate.drop_tokens:
            return None
        factor = gate.capacity_factor if self.training else gate.eval_capacity_factor
        factor *= gate.k
        cap = int(torch.ceil(torch.tensor(num_tokens / self.num_experts * factor)).item())
        return max(cap, gate.min_capacity)


def moe_layers(model: nn.Module) -> list[MoEMLP]:
    """The MoE layers of ``model``, in module order (layer order)."""
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The MoE loss term of the last forward: ``--moe-loss-coeff`` x the sum of ``model``'s MoE layers' aux losses
    (a differentiable fp32 scalar; None when no MoE layer ran). It is added to the LM loss."""
    terms = [
        m.loss_coeff * m.last_aux_loss.float().reshape(())
        for m in moe_layers(model)
        if m.last_aux_loss is not None
    ]
    return torch.stack(terms).sum() if terms else None


def clear_moe_state(model: nn.Module) -> None:
    """Forget the last forward's aux losses and counts (so a later sum never sees a stale layer)."""
    for m in moe_layers(model):
        m.last_aux_loss = None


def set_moe_groups(model: nn.Module, mpu: Any) -> None:
    """Create DeepSpeed's EP/EDP groups for ``model`` without an engine (conversion, generation); the engine does
    this itself in ``deepspeed.initialize``. ``mpu``: the run's ``megatron.mpu`` (DeepSpeed reads its TP/DP groups
    from it), passed by the caller."""
    set_moe_mpu(mpu)
    for layer in moe_layers(model):
        if layer.deepspeed_moe.ep_group is None:
            layer.set_deepspeed_parallelism()
