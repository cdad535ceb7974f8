"""Bytes handed to each collective per optimizer step, from the planner's config and the run plan alone.

Sizes of the tensors handed to each call (all-gather: its output, reduce-scatter: its input), per optimizer step,
on one rank of the first stage, by group (``tp``, ``sp``, ``pp``, ``dp``, ``cp``; MoE adds its all-to-alls).
"""

from __future__ import annotations

from megatron.config import RunPlan
from megatron.planning.moe_plan import moe_collective_bytes
from megatron.planning.params import (
    layers_of_stage,
    persistent_params,
    stage_expert_param_count,
    stage_layers,
    stage_param_count,
)
from megatron.planning.planner_config import PlannerConfig


def _context_parallel_bytes(pc: PlannerConfig, plan: RunPlan, layers: int) -> dict[str, int]:
    """``{"cp": bytes}``: attention's K/V of the whole sequence ``[S, b, 2 g/t, hn]`` per layer, forward, backward
    (and the recomputed forward), every micro-batch; ``{}`` without context parallelism."""
    if plan.context_parallel_size == 1:
        return {}
    m = pc.model
    a = 4 if plan.precision == "fp32" else 2
    groups = m.num_query_groups // plan.tensor_model_parallel_size
    kv = a * m.seq_length * plan.micro_batch_size * 2 * groups * m.head_dim
    passes = (
        3 if m.recompute_granularity == "full" else 2
    )  # forward, (recomputed forward,) backward
    return {"cp": passes * layers * kv * plan.gradient_accumulation_steps}


def collective_bytes(
    pc: PlannerConfig,
    plan: RunPlan,
    *,
    persistence_threshold: int = 100_000,
    pipe_partitioned: bool | None = None,
) -> dict[str, int]:
    """Bytes handed to collectives per optimizer step on one rank, by group (tensor sizes as passed).

    TP (no SP): 2 all-reduces of [s, b, h] per layer forward, 2 in backward, plus the embedding's forward
    all-reduce and the output layer's backward one. SP: each becomes an all-gather or reduce-scatter of the same
    [s, b, h]. PP: [s, b, h] sent and received once per micro-batch forward and once backward. DP: the gradients
    (all-reduce at ZeRO-0, reduce-scatter at 1/2, plus the updated parameters' all-gather; ZeRO-3 also gathers
    the parameters for forward and backward). CP: each rank's activations are ``[s/cp, b, h]`` (the sizes above
    shrink), the gradients are reduced over DP x CP x Ulysses, and attention moves the K/V of the whole sequence
    (``[S, b, 2 g/t, hn]``, all-gathered forward and reduce-scattered backward, per layer; a ring exchange moves
    ``(cp-1)/cp`` of it).
    """
    m = pc.model
    a = 4 if plan.precision == "fp32" else 2
    t, pp, mb = (
        plan.tensor_model_parallel_size,
        plan.pipeline_model_parallel_size,
        plan.gradient_accumulation_steps,
    )
    cp = plan.context_parallel_size
    sbh_bytes = a * (m.seq_length // cp) * plan.micro_batch_size * m.hidden_size
    layers = layers_of_stage(m.num_layers, pp, 0)
    out: dict[str, int] = {"tp": 0, "sp": 0, "pp": 0, "dp": 0}
    out.update(_context_parallel_bytes(pc, plan, layers))  # {"cp": ...} under CP
    if pipe_partitioned is None:
        pipe_partitioned = not plan.sequence_parallel
    if t > 1 and plan.sequence_parallel:
        # per layer: forward 2 all-gathers + 2 reduce-scatters; backward 2 reduce-scatters, 2 re-gathers of the
        # kept [s/p, b, h] inputs (weight gradients) and 2 all-gathers; the embedding's reduce-scatter and the
        # final all-gather before the logits, each with its backward
        per_mb = (10 * layers + 4) * sbh_bytes
        if m.recompute_granularity == "full":
            per_mb += 4 * layers * sbh_bytes  # the recomputed forward repeats its collectives
        out["sp"] = per_mb * mb
    elif t > 1:
        per_mb = (4 * layers + 2) * sbh_bytes
        if m.recompute_granularity == "full":
            per_mb += 2 * layers * sbh_bytes  # the recomputed forward repeats its collectives
        out["tp"] = per_mb * mb
    if pp > 1:
        # a middle stage receives and sends forward and backward; the end stages half of that. DeepSpeed's
        # pipe_partitioned / grad_partitioned (on unless SP) send 1/t of each message and all-gather it over TP.
        messages = (4 if pp > 2 else 2) * mb
        partitioned = pipe_partitioned and t > 1
        out["pp"] = messages * (sbh_bytes // t if partitioned else sbh_bytes)
        out["pp"] += (
            messages // 2 * 8 * (m.seq_length // cp) * plan.micro_batch_size
        )  # int64 position ids, forward
        if partitioned:
            out["tp"] += messages // 2 * sbh_bytes  # the receiver's all-gather of each message
        if (
            not m.untie_embeddings_and_output_weights
        ):  # the tied embedding's gradient, first + last stage
            pb = 4 if plan.precision == "fp32" else 2
            out["pp"] += pb * plan.padded_vocab_size // t * m.hidden_size
    if (
        plan.data_parallel_size * cp * pc.ds_sequence_parallel_size > 1
    ):  # DeepSpeed's reduction group
        pb = 4 if plan.precision == "fp32" else 2
        psi = stage_param_count(pc, plan, 0)
        gathered = psi - persistent_params(pc, plan, 0, persistence_threshold)
        out["dp"] = {
            0: pb * psi,  # one all-reduce at the accumulation boundary
            1: 2 * pb * psi,  # the same, then the updated partitions all-gathered
            2: (mb + 1) * pb * psi,  # reduced after every micro-batch, then the all-gather
            # reduce-scatter per micro-batch; one gather of the partitioned weights per micro-batch (measured:
            # backward finds them still gathered)
            3: mb * pb * psi + mb * pb * gathered,
        }[plan.zero_stage]
    if m.moe.is_moe(m.num_layers):
        first = stage_layers(m.num_layers, pp, 0)
        moe = moe_collective_bytes(pc, plan, first, stage_expert_param_count(pc, plan, 0))
        for group, size in moe.items():
            out[group] = out.get(group, 0) + size
    return out
