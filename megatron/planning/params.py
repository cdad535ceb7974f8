"""Parameter counts per pipeline stage and rank, from the planner's config and the run plan alone (the memory plan's
``Psi``).

Which layers a stage holds (``layers_of_stage``), the tensors of one layer on one TP rank, the parameters ZeRO-3 keeps
whole, the local experts' parameters and a stage's total.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from megatron.config import ModelConfig, RunPlan
from megatron.planning.moe_plan import experts_of_layer, layer_experts
from megatron.planning.planner_config import PlannerConfig

T = TypeVar("T")


def layers_of_stage(num_layers: int, pp: int, stage: int) -> int:
    """Transformer layers on ``stage`` (DeepSpeed's uniform split; the first stages take the remainder)."""
    base, extra = divmod(num_layers, pp)
    return base + (1 if stage < extra else 0)


def in_flight_micro_batches(pp: int, stage: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B: min(PP - stage, m)."""
    return max(1, min(pp - stage, micro_batches))


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """0-based indices of the transformer layers on ``stage`` (the split of :func:`layers_of_stage`)."""
    base, extra = divmod(num_layers, pp)
    first = stage * base + min(stage, extra)  # the layers of the stages before it, in O(1)
    return range(first, first + layers_of_stage(num_layers, pp, stage))


def each_layer(m: ModelConfig, layers: range, value: Callable[[int], T]) -> list[T]:
    """``value(layer)`` for each of ``layers``, computed once per expert count: layers with as many experts are
    alike (the planner is linear in --num-layers, with a small constant, for 100,000 layers)."""
    counts = layer_experts(m)
    known: dict[int, T] = {}
    out = []
    for layer in layers:
        experts = counts[layer]
        if experts not in known:
            known[experts] = value(layer)
        out.append(known[experts])
    return out


def fc1_width(m: ModelConfig) -> int:
    """Output columns of the MLP's first linear (SwiGLU's gate and up projections together), before TP."""
    return 2 * m.ffn_size if m.swiglu else m.ffn_size


def _mlp_tensors(m: ModelConfig, tp: int) -> list[int]:
    """Element counts of one MLP's (``ParallelMLP``) parameter tensors split over ``tp`` ranks."""
    h, ffn = m.hidden_size, m.ffn_size
    fc1_out = fc1_width(m) // tp
    sizes = [h * fc1_out, ffn // tp * h]
    return sizes + [fc1_out, h] if m.add_bias_linear else sizes


def layer_param_tensors(pc: PlannerConfig, tp: int, layer: int = 0) -> tuple[list[int], list[int]]:
    """Element counts of transformer layer ``layer``'s parameter tensors on one rank: (non-expert, expert).

    Experts are DeepSpeed-MoE's (``--num-experts``): a layer with ``E > 1`` holds the gate ``[E, h]`` (+ with
    ``--mlp-type residual`` a dense MLP and the ``[2, h]`` + ``[2]`` coefficient) and ``E / ep`` local experts,
    whole or TP-split (``--enable-expert-tensor-parallelism``). The other layers hold the dense MLP, or with
    ``--num-experts-switch N`` a router ``[N, h]`` + ``[N]`` and N TP-split expert MLPs (not expert-parallel, so
    counted as non-expert).
    """
    m = pc.model
    h, hn = m.hidden_size, m.head_dim
    qkv_out = (m.num_attention_heads + 2 * m.num_query_groups) * hn // tp
    norms = [h] * (4 if m.normalization == "layernorm" else 2)
    if m.qk_layernorm:  # q_layernorm, k_layernorm: [hn] each (+ bias with LayerNorm), replicated
        norms += [hn] * (4 if m.normalization == "layernorm" else 2)
    dense = [h * qkv_out, m.num_attention_heads * hn * h // tp, *norms]
    if m.qkv_bias:
        dense.append(qkv_out)
    if m.add_bias_linear:
        dense.append(h)
    experts = experts_of_layer(m, layer)
    if experts > 1:
        dense.append(experts * h)  # the gate
        if m.moe.mlp_type == "residual":
            dense += [*_mlp_tensors(m, tp), 2 * h, 2]
        expert_tp = tp if pc.enable_expert_tensor_parallelism else 1
        return dense, _mlp_tensors(m, expert_tp) * (experts // pc.moe_expert_parallel_size)
    switch = m.moe.num_experts_switch
    if switch is not None:
        return [*dense, switch * h, switch, *_mlp_tensors(m, tp) * switch], []
    return dense + _mlp_tensors(m, tp), []


def persistent_params(pc: PlannerConfig, plan: RunPlan, stage: int, threshold: int) -> int:
    """Parameters of ``stage`` that ZeRO-3 keeps whole on every rank (tensors below
    ``stage3_param_persistence_threshold`` elements)."""
    m, tp, pp = pc.model, plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size
    count = sum(
        each_layer(
            m,
            stage_layers(m.num_layers, pp, stage),
            lambda layer: sum(n for n in layer_param_tensors(pc, tp, layer)[0] if n < threshold),
        )
    )
    extra = []
    if stage == 0:
        extra.append(plan.padded_vocab_size // tp * m.hidden_size)
        if m.add_position_embedding and not m.use_rotary_position_embeddings:
            extra.append(m.max_positions * m.hidden_size)
    if stage == pp - 1:
        extra += [m.hidden_size] * (2 if m.normalization == "layernorm" else 1)
    return count + sum(n for n in extra if n < threshold)


def stage_expert_param_count(pc: PlannerConfig, plan: RunPlan, stage: int) -> int:
    """DeepSpeed-MoE expert parameters of one rank of pipeline stage ``stage`` (part of :func:`stage_param_count`;
    ZeRO partitions them over the expert-data-parallel group, ``expert_data_parallel_size`` ranks)."""
    m, tp = pc.model, plan.tensor_model_parallel_size
    layers = stage_layers(m.num_layers, plan.pipeline_model_parallel_size, stage)
    return sum(each_layer(m, layers, lambda layer: sum(layer_param_tensors(pc, tp, layer)[1])))


def stage_param_count(pc: PlannerConfig, plan: RunPlan, stage: int) -> int:
    """Parameters Psi of one TP rank of pipeline stage ``stage`` (its local experts included)."""
    m, tp, pp = pc.model, plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size
    h = m.hidden_size
    count = sum(
        each_layer(
            m,
            stage_layers(m.num_layers, pp, stage),
            lambda layer: sum(map(sum, layer_param_tensors(pc, tp, layer))),
        )
    )
    word = plan.padded_vocab_size // tp * h
    if stage == 0:
        count += word
        if m.add_position_embedding and not m.use_rotary_position_embeddings:
            count += m.max_positions * h
    if stage == pp - 1:
        count += h * (2 if m.normalization == "layernorm" else 1)
        if m.untie_embeddings_and_output_weights or pp > 1:
            count += (
                word  # the output layer, or the tied copy of the word embeddings on the last stage
            )
    return count
