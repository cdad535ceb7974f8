"""``MoEConfig``: DeepSpeed-MoE settings of the model (``ModelConfig.moe``), with Megatron-DeepSpeed's flags.

Which layers are MoE layers follows Megatron-DeepSpeed: ``--num-experts`` is one value (every MoE layer has that
many experts) or one value per MoE layer, and layer ``l`` (1-based, counted over the whole model) is an MoE layer
when ``l % --expert-interval == 0``. With 4 layers, ``--num-experts 8 --expert-interval 2``: layers 2 and 4 hold 8
experts, layers 1 and 3 the dense MLP; ``--expert-interval 1`` (Mixtral) makes every layer an MoE layer. A layer whose
count is 1 is dense. The expert-parallel degree is ``ParallelConfig.moe_expert_parallel_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-Experts (DeepSpeed-MoE) layers in place of the MLP."""

    num_experts: tuple[int, ...] = (1,)
    """Experts per MoE layer: one value for every MoE layer, or one per MoE layer (1: a dense model)."""
    expert_interval: int = 2
    """Every expert-interval-th layer (1-based: layers k, 2k, ...) is an MoE layer."""
    topk: Literal[1, 2] = 1
    """Experts each token is routed to (top-k gating)."""
    moe_train_capacity_factor: float = 1.0
    """Expert capacity while training: factor x tokens / experts (x topk for top-2), per rank's local batch."""
    moe_eval_capacity_factor: float = 1.0
    """Expert capacity in evaluation (as --moe-train-capacity-factor)."""
    moe_min_capacity: int = 4
    """Least tokens an expert accepts, whatever the capacity factor."""
    moe_token_dropping: bool = True
    """Tokens beyond an expert's capacity are dropped (off: capacity grows to the busiest expert's load)."""
    moe_top2_2nd_expert_sampling: bool = True
    """Top-2 gating samples the second expert with Gumbel noise (off: the second-best expert by argmax)."""
    moe_loss_coeff: float = 0.1
    """Weight of the load-balancing (auxiliary) loss, summed over MoE layers, added to the LM loss."""
    create_moe_param_group: bool = False
    """Separate optimizer parameter groups for expert parameters (needed by ZeRO; turned on by ZeRO with MoE)."""
    num_experts_switch: int | None = None
    """Megatron-LM's Switch MLP in every layer without DeepSpeed-MoE experts: a top-1 router over this many
    TP-split expert MLPs (no expert parallelism, no token dropping, no load-balancing loss; model/switch_mlp.py)."""
    mlp_type: Literal["standard", "residual"] = "standard"
    """MoE layer type: standard, or residual (PR-MoE: a dense MLP plus the experts, mixed by a learned coefficient)."""

    def experts_per_layer(self, num_layers: int) -> tuple[int, ...]:
        """Experts of each layer 0..L-1 (1: dense), Megatron-DeepSpeed's rule (see the module docstring).

        The caller guarantees the ``num_experts`` length checked by ``validate`` (1 or L // expert_interval).
        """
        moe_layers = num_layers // self.expert_interval
        counts = self.num_experts * moe_layers if len(self.num_experts) == 1 else self.num_experts
        return tuple(
            counts[(n - 1) // self.expert_interval] if n % self.expert_interval == 0 else 1
            for n in range(1, num_layers + 1)
        )

    def is_moe(self, num_layers: int) -> bool:
        """Whether any layer of an L-layer model has more than one expert."""
        if len(self.num_experts) not in (1, num_layers // max(self.expert_interval, 1)):
            return any(n > 1 for n in self.num_experts)
        return any(n > 1 for n in self.experts_per_layer(num_layers))

    def moe_layer_numbers(self, num_layers: int) -> tuple[int, ...]:
        """0-based indices of the MoE layers."""
        return tuple(i for i, n in enumerate(self.experts_per_layer(num_layers)) if n > 1)
