"""The DeepSpeed-MoE terms of the memory planner (``memory_plan.py``): expert capacity, the saved activations of an
MoE layer, the expert-data-parallel size and the collectives MoE layers add. Pure arithmetic, like the planner.

What DeepSpeed 0.19.8 does in an MoE layer (``deepspeed/moe/sharded_moe.py``, sparse routing), ``S = s b`` tokens of
a micro-batch on one rank, ``E`` experts, ``k`` top-k, ``C`` capacity, ``t`` TP size, ``a`` activation bytes::

    gate (fp32) -> gather the routed tokens into an [E, C, h] buffer -> (t > 1) keep this TP rank's C / t slots
      -> all-to-all over EP -> (expert TP) all-gather the slots over TP -> experts -> (expert TP) keep C / t
      -> all-to-all back -> (t > 1) all-gather the slots over TP -> each token's k rows times its gates

Measured against real runs by ``benchmarks/bench_memory_plan.py`` (the ``moe-*`` layouts).
"""

from __future__ import annotations

import functools
import math

from megatron.config import ModelConfig, RunPlan
from megatron.config.moe import MoEConfig
from megatron.planning.planner_config import PlannerConfig


@functools.lru_cache(maxsize=8)
def _experts_per_layer(moe: MoEConfig, num_layers: int) -> tuple[int, ...]:
    # built once per model: the planner asks per layer, and rebuilding the L-long list each time made a plan
    # quadratic in --num-layers (100,000 layers: minutes)
    if not moe.is_moe(num_layers):
        return (1,) * num_layers
    return moe.experts_per_layer(num_layers)


def layer_experts(m: ModelConfig) -> tuple[int, ...]:
    """DeepSpeed-MoE experts of each transformer layer 0..L-1 (1: a dense layer), built once per model."""
    return _experts_per_layer(m.moe, m.num_layers)


def experts_of_layer(m: ModelConfig, layer: int) -> int:
    """DeepSpeed-MoE experts of transformer layer ``layer`` (0-based; 1: a dense layer)."""
    return layer_experts(m)[layer]


def expert_capacity(m: ModelConfig, plan: RunPlan, micro_batch: int, experts: int) -> int:
    """DeepSpeed's training capacity C (tokens per expert) of an MoE layer with ``experts`` experts: ``ceil(S / E x
    factor x topk)``, at least ``--moe-min-capacity``, for the ``S = s b`` tokens of one micro-batch on a rank.
    Without token dropping DeepSpeed sizes C by the busiest expert (up to S); planned here at balanced routing,
    ``ceil(S topk / E)`` rounded up to a multiple of TP (see ``_caveats``)."""
    moe = m.moe
    tokens = m.seq_length * micro_batch
    if not moe.moe_token_dropping:
        t = plan.tensor_model_parallel_size
        balanced = -(-tokens * moe.topk // experts)
        return -(-balanced // t) * t
    # DeepSpeed: ceil((S / E) * factor) in floating point (x 2 for top-2), then the minimum
    capacity = math.ceil(tokens / experts * (moe.moe_train_capacity_factor * moe.topk))
    return max(capacity, moe.moe_min_capacity)


def moe_mlp_activation_bytes(
    pc: PlannerConfig, plan: RunPlan, micro_batch: int, experts: int
) -> int:
    """Saved bytes of a DeepSpeed-MoE layer's MLP (DeepSpeed 0.19.8's sparse routing) for one micro-batch.

    With ``S = s b`` tokens, ``k`` top-k, ``E`` experts, capacity ``C`` (``expert_capacity``), ``a`` activation
    bytes::

        gate        4 S E (1 + k)          fp32 softmax and the k fp32 route masks (+ 4 S h: the fp32 input, if a < 4)
        dispatch    8 (E C + 1)            the slot -> token index of the gather into the [E, C, h] buffer
        experts     a E C' (h + f1 + f)    each rank's experts see E C' tokens (the all-to-all keeps E x C rows):
                                           C' = C / t with whole experts (DeepSpeed splits the TP-replicated slots
                                           over TP), f1 / f the expert MLP's fc1 / activation widths (/ t with
                                           --enable-expert-tensor-parallelism)
        combine     a k S h + 12 k S       each token's k expert rows (TP-gathered) times their fp32 gates
        residual    a S (f1 + f) / t + 2 a S h   PR-MoE (--mlp-type residual): the dense MLP and the mixing products
    """
    m, moe = pc.model, pc.model.moe
    t, a = plan.tensor_model_parallel_size, (4 if plan.precision == "fp32" else 2)
    tokens, h, k = m.seq_length * micro_batch, m.hidden_size, moe.topk
    capacity = expert_capacity(m, plan, micro_batch, experts)
    expert_tp = pc.enable_expert_tensor_parallelism
    rows = experts * (capacity if expert_tp or t == 1 else capacity // t)
    f = m.ffn_size // t if expert_tp else m.ffn_size
    f1 = 2 * f if m.swiglu else f
    total = 4 * tokens * experts * (1 + k) + (4 * tokens * h if a < 4 else 0)
    total += 8 * (experts * capacity + 1)
    total += a * rows * (h + f1 + f)
    total += a * k * tokens * h + 12 * k * tokens
    if moe.mlp_type == "residual":
        dense_f1 = 2 * m.ffn_size if m.swiglu else m.ffn_size
        total += a * tokens * (dense_f1 + m.ffn_size) // t + 2 * a * tokens * h
    return total


def expert_data_parallel_size(pc: PlannerConfig, plan: RunPlan) -> int:
    """The ranks ZeRO partitions an expert's states over (DeepSpeed's expert-data-parallel group,
    ``megatron.mpu.expert_parallel``): ``DP x TP / EP`` with whole experts (the TP ranks hold copies of the same
    experts: EP groups run over them first), ``DP / EP`` with ``--enable-expert-tensor-parallelism``."""
    copies = plan.data_parallel_size
    if not pc.enable_expert_tensor_parallelism:
        copies *= plan.tensor_model_parallel_size
    return max(1, copies // pc.moe_expert_parallel_size)


def _dp_bytes(pb: int, psi: int, zero_stage: int, micro_batches: int) -> int:
    """Gradient (and ZeRO-1/2 parameter) collective bytes of ``psi`` parameters over a group of more than one rank
    (MoE runs refuse ZeRO-3)."""
    return {0: pb * psi, 1: 2 * pb * psi, 2: (micro_batches + 1) * pb * psi}.get(
        zero_stage, 2 * pb * psi
    )


def moe_collective_bytes(
    pc: PlannerConfig, plan: RunPlan, layers: range, expert_psi: int
) -> dict[str, int]:
    """What the MoE layers among ``layers`` (one rank's, holding ``expert_psi`` expert parameters) change in the
    planner's per-step collective bytes (added to its dict).

    Per MoE layer and micro-batch, ``F`` forward passes (2 with full recomputation, else 1), ``slots`` = ``E C h``:

    - ``ep`` (EP > 1): ``2 F + 2`` all-to-alls of ``[E, C / t, h]`` (two per forward, two in backward).
    - ``tp`` (t > 1), whole experts: the dense MLP's ``F + 1`` all-reduces of ``[s, b, h]`` are gone; ``F + 1``
      all-gathers of the slots come (after the experts in forward, before them in backward). TP-split experts
      (``--enable-expert-tensor-parallelism``): ``2 F + 2`` all-gathers of the slots (also around the first
      all-to-all), and the MLP's ``F + 1`` all-reduces are of ``[E C, h]`` instead of ``[s, b, h]``.
    - ``dp``: expert gradients run over the expert-data-parallel group (``expert_data_parallel_size`` ranks), not
      the data-parallel one: the planner counted them over DP; corrected here.
    """
    m = pc.model
    t, mb = plan.tensor_model_parallel_size, plan.gradient_accumulation_steps
    a = 4 if plan.precision == "fp32" else 2
    sbh = m.seq_length * plan.micro_batch_size * m.hidden_size
    passes = 2 if m.recompute_granularity == "full" else 1
    out = {"ep": 0, "tp": 0, "dp": 0}
    for layer in layers:
        experts = experts_of_layer(m, layer)
        if experts == 1:
            continue
        slots = experts * expert_capacity(m, plan, plan.micro_batch_size, experts) * m.hidden_size
        if pc.moe_expert_parallel_size > 1:
            out["ep"] += (2 * passes + 2) * a * (slots // t) * mb
        if t > 1 and pc.enable_expert_tensor_parallelism:
            out["tp"] += ((2 * passes + 2) * slots + (passes + 1) * (slots - sbh)) * a * mb
        elif t > 1:
            out["tp"] += (passes + 1) * (slots - sbh) * a * mb
    pb = 4 if plan.precision == "fp32" else 2
    if plan.data_parallel_size > 1:
        out["dp"] -= _dp_bytes(pb, expert_psi, plan.zero_stage, mb)
    if expert_data_parallel_size(pc, plan) > 1:
        out["dp"] += _dp_bytes(pb, expert_psi, plan.zero_stage, mb)
    return out
