"""Memory and communication planner: bytes per rank, FLOPs and collective bytes per step, from the config alone.

    plan = RunPlan.build(cfg, world_size=16, device_type="cuda", true_vocab=50257)
    pc = PlannerConfig.from_configs(cfg.model, cfg.parallel, cfg.training)
    mp = plan_memory(pc, plan, build_ds_config(cfg, plan))
    mp.stages[k].total, mp.worst.total, mp.fits(80 * 2**30), largest_micro_batch(pc, plan, ds, 80 * 2**30)

Pure arithmetic (no torch, no process group), so the CLI (``tools/plan_memory.py``), the run's first log lines
(``pretrain``) and the tests compute the same numbers. ``benchmarks/bench_memory_plan.py`` measures them on CPU.

Notation: ``Psi`` parameters held by one rank (its TP shard of its pipeline stage's layers), ``N`` the
data-parallel size, ``pb`` bytes per model parameter (2 with --bf16/--fp16, else 4), ``a`` bytes per activation
element (the same), ``s b h`` sequence x micro-batch x hidden, ``t`` the TP size.

States per rank (DeepSpeed 0.19.8, a client torch Adam: two fp32 moments, 8 bytes/param; SGD: one momentum),
``P = Psi / N`` the partition, ``R`` the reduce bucket (``reduce_bucket_size`` elements, at most Psi)::

    stage  parameters             gradients                  optimizer (master + moments)   buckets
    0      pb Psi                 pb Psi (+ 4 Psi after, bf16) (4 Psi if pb = 2) + 8 Psi     pb R (DP > 1, after)
    1      pb Psi                 pb Psi (+ 4 P after, bf16)  (4 + 8) P                      pb R
    2      pb Psi                 pb P + 4 P after            (4 + 8) P                      pb R
    3      pb (Psi_s + Psi_p/N)   pb P (+ 4 P after, bf16)    (4 + 8) P                      pb R + pb Psi_p

DeepSpeed-MoE expert parameters (``stage_expert_param_count``: a rank's ``E / EP`` local experts) have the same rows
with ``N`` the expert-data-parallel size (``DP x TP / EP`` with whole experts, ``DP / EP`` TP-split; DeepSpeed
partitions each expert parameter group over it); one reduce bucket serves both. DeepSpeed's ZeRO optimizers keep an
fp32 clone of their partition even in fp32 runs; ZeRO-2 keeps the reduced gradient partition in a contiguous buffer
next to the fp32 partition's gradient. ZeRO-3 keeps tensors below ``stage3_param_persistence_threshold`` elements
whole (``Psi_s``) and was measured holding every partitioned one (``Psi_p``) gathered at the end of backward.
``--cpu-optimizer`` / ``offload_optimizer`` moves master weights, moments and the fp32 gradient partition to CPU;
``offload_param`` (ZeRO-3) the parameter partition too. ZeRO-1/2/3 allocate the reduce bucket at a micro-batch's
first gradient and keep it to the accumulation boundary, beside the next micro-batch's activations; what is marked
"after" exists only after backward (ZeRO-0's flat all-reduce copy; the fp32 gradients the optimizer steps on, which
DeepSpeed makes at the step for bf16 runs and fp32 ZeRO-2), so the peak takes the larger of it and the activations.
These rows were fitted to and checked against ``benchmarks/bench_memory_plan.py`` (fp32 and bf16, CPU).

Activations per layer per micro-batch, in bytes (measured on our layers, ``benchmarks/bench_memory_plan.py``):

    no recompute   a s b h (4 + 12/t) [4 + 12/t -> 16/t with SP] + MLP beyond 4h
                   + s b h x 2 hidden-dropout masks (/t with SP) with --hidden-dropout > 0: 1 byte each on
                     CUDA (a bool mask), a on CPU (scaled noise of the input's dtype)
                   + the attention: 8 bytes x b n s / t (flash: log-sum-exp), or with --attention-dropout > 0
                     (the math path) 12 bytes x b n s^2 / t + 2 a s b h / t
    selective      the same without the attention-score term
    full           a s b h (/t with SP) per checkpointed chunk, plus one chunk recomputed in backward and
                   the MLP's two gradient temporaries there, a s b (f + fc1 out) / t

Outside the layers: the logits ``4 s b v/t`` bytes (fp32 for the loss) and ``2 a s b h`` on the last stage, the
embedding output ``a s b h`` on the first. 1F1B: stage k of PP holds ``min(PP - k, m)`` micro-batches in flight
(``m`` = gradient accumulation steps), DeepSpeed's ``TrainSchedule.num_pipe_buffers``; the PipelineEngine's own
buffers are :func:`pipeline_buffer_bytes`.

Collective bytes are the sizes of the tensors handed to each call (all-gather: its output, reduce-scatter: its
input), per optimizer step, on one rank of the first stage: see :func:`collective_bytes`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from megatron.config import ModelConfig, RunPlan
from megatron.planning.collectives import collective_bytes
from megatron.planning.flops import flops_per_token
from megatron.planning.moe_plan import (
    expert_data_parallel_size,
    experts_of_layer,
    moe_mlp_activation_bytes,
)
from megatron.planning.params import (
    each_layer,
    fc1_width,
    in_flight_micro_batches,
    persistent_params,
    stage_expert_param_count,
    stage_layers,
    stage_param_count,
)
from megatron.planning.planner_config import PlannerConfig

GIB = 2**30

GPU_MEMORY_GB: dict[str, float] = {
    "A100-40GB": 40.0,
    "A100-80GB": 80.0,
    "H100-80GB": 80.0,
    "H200": 141.0,
}
"""Device memory of the --gpu-type choices, GB (10^9 bytes, as the data sheets give it)."""

# DeepSpeed 0.19.8 defaults (elements) of the bucket keys a user JSON may set.
_DS_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_param_persistence_threshold": 100_000,
}


@dataclass(frozen=True)
class StageMemory:
    """Device bytes of one rank of pipeline stage ``stage`` (every TP and DP rank of a stage alike)."""

    stage: int
    params: int
    """Parameter count Psi on this rank (its TP shard of the stage's layers; before ZeRO partitioning)."""
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    """fp32 master weights + optimizer moments on the device (0 when offloaded)."""
    activation_bytes: int
    """Saved activations of ``in_flight`` micro-batches."""
    bucket_bytes: int
    """DeepSpeed's communication buckets (gradient reduce / all-gather / ZeRO-3 live parameters)."""
    in_flight: int
    """Micro-batches whose activations are alive at once (1F1B)."""
    offloaded_bytes: int = 0
    """Optimizer states (and ZeRO-3 parameters) moved to CPU memory instead."""
    buckets_in_backward: bool = True
    """The buckets live while activations do (ZeRO-1/2/3 allocate theirs at a micro-batch's first gradient and keep
    them to the accumulation boundary); ZeRO-0's flat all-reduce copy comes after backward, so the peak takes the
    larger of it and the activations."""
    step_bytes: int = 0
    """Part of ``gradient_bytes`` that exists only around the optimizer step, when no activations do (the fp32
    gradients the optimizer steps on, in bf16 / fp16 runs and fp32 ZeRO-2)."""

    @property
    def states_bytes(self) -> int:
        """Parameters + gradients + optimizer states + buckets."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes + self.bucket_bytes

    @property
    def total(self) -> int:
        """The peak on the device."""
        states = self.parameter_bytes + self.gradient_bytes - self.step_bytes + self.optimizer_bytes
        if self.buckets_in_backward:
            return states + self.bucket_bytes + max(self.activation_bytes, self.step_bytes)
        return states + max(self.bucket_bytes + self.step_bytes, self.activation_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    """The planner's result for one run."""

    stages: tuple[StageMemory, ...]
    flops_per_step: float
    """Model FLOPs of one optimizer step, all ranks together (``flops.py``; no recompute credit)."""
    collective_bytes: Mapping[str, int]
    """Bytes per step per rank handed to collectives, by group (``tp``, ``sp``, ``pp``, ``dp``)."""
    caveats: tuple[str, ...] = ()
    """Parts of the model the arithmetic does not cover (reported under the plan, never silently wrong)."""

    @property
    def worst(self) -> StageMemory:
        """The stage with the largest device total."""
        return max(self.stages, key=lambda st: st.total)

    def fits(self, capacity_bytes: float) -> bool:
        """True when every stage's total fits ``capacity_bytes``."""
        return self.worst.total <= capacity_bytes


def _zero_section(ds_config: Mapping[str, Any]) -> Mapping[str, Any]:
    return ds_config.get("zero_optimization", {}) or {}


def _offload(ds_config: Mapping[str, Any], key: str) -> bool:
    section = _zero_section(ds_config).get(key) or {}
    return str(section.get("device", "none")).lower() in ("cpu", "nvme")


def _bucket(ds_config: Mapping[str, Any], key: str) -> int:
    return int(float(_zero_section(ds_config).get(key, _DS_DEFAULTS[key])))


def _state_bytes(
    pc: PlannerConfig,
    plan: RunPlan,
    psi: int,
    ds: Mapping[str, Any],
    *,
    persistent: int = 0,
    n: int | None = None,
    bucket_psi: int | None = None,
) -> dict[str, int]:
    """Parameter, gradient, optimizer, bucket and offloaded bytes for ``psi`` parameters (module docstring).

    Args:
        n: the ranks ZeRO partitions them over (default: DP x CP x Ulysses; experts:
            ``expert_data_parallel_size``).
        bucket_psi: the parameters the communication buckets are sized for (default ``psi``; 0: none).
    """
    stage = plan.zero_stage
    # ZeRO shards over DeepSpeed's sequence-data-parallel group: DP x CP x Ulysses (checkpointing.rules)
    n = (
        plan.data_parallel_size * plan.context_parallel_size * pc.ds_sequence_parallel_size
        if n is None
        else n
    )
    bucket_psi = psi if bucket_psi is None else bucket_psi
    pb = 4 if plan.precision == "fp32" else 2
    sgd = pc.optimizer == "sgd"
    moments = 0 if sgd and pc.sgd_momentum == 0 else (4 if sgd else 8)
    master = 0 if (pb == 4 and stage == 0) else 4
    opt_cpu = _offload(ds, "offload_optimizer") or pc.cpu_optimizer
    part = -(-psi // n)  # DeepSpeed pads the flat partition up
    if stage == 0:
        params, grads, opt = (
            pb * psi,
            pb * psi + (4 * psi if pb == 2 else 0),
            (master + moments) * psi,
        )
        # the fp32 gradients of a bf16 / fp16 run: made for the step (measured: never beside the activations)
        step = 4 * psi if pb == 2 else 0
        # DeepSpeedEngine all-reduces a flat copy of the gradients (skipped at DP = 1)
        buckets = pb * min(bucket_psi, _bucket(ds, "reduce_bucket_size")) if n > 1 else 0
    else:
        params = pb * psi  # ZeRO-3: below
        # the reduced gradient partition, and its fp32 copy for the optimizer (measured: ZeRO-3 in fp32 shares it
        # at the peak, flattening its copy only at the step; ZeRO-2 keeps a separate buffer). ZeRO-1 holds every
        # gradient whole until the boundary's reduce (measured: 4 Psi in fp32 at the end of backward).
        whole = psi if stage == 1 else part
        grads = pb * whole + (4 * part if pb == 2 or stage == 2 else 0)
        # measured: that fp32 copy is made at the step, after backward has freed every activation
        step = grads - pb * whole
        opt = (master + moments) * part
        # allocated at a micro-batch's first gradient, kept to the boundary (ZeRO-1 reduces only there; the next
        # micro-batch's forward runs beside it)
        buckets = pb * min(bucket_psi, _bucket(ds, "reduce_bucket_size"))
    if stage == 3:
        params = pb * (persistent + -(-(psi - persistent) // n))
        # Measured (benchmarks/bench_memory_plan.py): at the end of backward DeepSpeed 0.19.8 holds the whole shard
        # gathered, past stage3_max_live_parameters; the planner assumes so (conservative for large models).
        buckets += pb * (psi - persistent)
    offloaded = 0
    if opt_cpu and stage >= 1:
        # the fp32 gradient partition (a bf16 / fp16 run's step gradients) goes to CPU too
        moved = 4 * part if pb == 2 else 0
        offloaded += opt + moved
        grads, step, opt = grads - moved, step - moved, 0
    if stage == 3 and _offload(ds, "offload_param"):
        offloaded += params
        params = 0
    return {
        "params": params,
        "grads": grads,
        "opt": opt,
        "buckets": buckets,
        "offloaded": offloaded,
        "step": step,
    }


def _mask_bytes(plan: RunPlan) -> int:
    """Bytes per element of a saved dropout mask: CUDA's fused dropout keeps a bool mask; on CPU ``F.dropout``
    multiplies by a scaled noise tensor of the input's dtype (measured in fp32 and bf16)."""
    if plan.device_type == "cuda":
        return 1
    return 4 if plan.precision == "fp32" else 2


def layer_activation_bytes(
    pc: PlannerConfig, plan: RunPlan, micro_batch: int, layer: int | None = None
) -> int:
    """Saved activation bytes of one transformer layer for one micro-batch, without recomputation.

    ``layer`` (0-based; None: a dense layer) picks the MLP: a DeepSpeed-MoE layer's is ``moe_mlp_activation_bytes``.
    """
    m = pc.model
    t, a = plan.tensor_model_parallel_size, (4 if plan.precision == "fp32" else 2)
    s, b, h, n = m.seq_length, micro_batch, m.hidden_size, m.num_attention_heads
    sbh = s * b * h
    fc1_out = fc1_width(m)
    qkv = s * b * (n + 2 * m.num_query_groups) * m.head_dim
    experts = 1 if layer is None else experts_of_layer(m, layer)
    # sharded over TP: q, k, v; the attention context; fc1's output and the activation's output
    mlp = s * b * (fc1_out + m.ffn_size) if experts == 1 else 0
    context = s * b * n * m.head_dim  # [s, b, n*hn]: h unless --kv-channels differs
    sharded = a * (qkv + context + mlp)
    whole = a * 4 * sbh  # the two norms' inputs and outputs
    masks = 2 * _mask_bytes(plan) * sbh if m.hidden_dropout > 0 else 0
    sp = plan.sequence_parallel
    total = sharded // t + (whole // t if sp else whole) + (masks // t if sp else masks)
    if experts > 1:
        total += moe_mlp_activation_bytes(pc, plan, micro_batch, experts)
    if m.recompute_granularity != "selective":
        if m.attention_dropout > 0:
            total += (12 * b * n * s * s + 2 * a * sbh) // t
        else:
            total += 8 * b * n * s // t
    return total


def _outside_layers_bytes(m: ModelConfig, plan: RunPlan, stage: int, b: int) -> int:
    t, a, pp = (
        plan.tensor_model_parallel_size,
        (4 if plan.precision == "fp32" else 2),
        plan.pipeline_model_parallel_size,
    )
    sbh = m.seq_length * b * m.hidden_size
    total = 0
    if stage == 0:
        total += a * sbh + (_mask_bytes(plan) * sbh if m.hidden_dropout > 0 else 0)
    if stage == pp - 1:
        total += 4 * m.seq_length * b * plan.padded_vocab_size // t + 2 * a * sbh
    return total


def pipeline_buffer_bytes(
    m: ModelConfig, plan: RunPlan, stage: int, micro_batch: int, in_flight: int = 1
) -> int:
    """What DeepSpeed's PipelineEngine holds besides the autograd graph (measured at the peak): on the last stage
    four ``[s, b, h]`` receive / gradient buffers, plus the logits it keeps as the stage output and their gradient
    (2 x fp32 ``[s, b, v/t]``) with ``--no-cross-entropy-loss-fusion`` (the fused loss writes its gradient into the
    logits; in bf16 / fp16 the low-precision logits and their gradient stay); on the others each in-flight
    micro-batch's output, which it keeps for the backward, and one gradient buffer. 0 without a pipeline. Under
    context parallelism the pipe carries each rank's ``[s/cp, b, h]`` tokens (and ``s/cp`` logits)."""
    if not plan.pipeline_engine:
        return 0
    a = 4 if plan.precision == "fp32" else 2
    seq = m.seq_length // plan.context_parallel_size
    sbh = seq * micro_batch * m.hidden_size
    if stage < plan.pipeline_model_parallel_size - 1:
        return (in_flight + 1) * a * sbh
    logits = 4 * seq * micro_batch * plan.padded_vocab_size // plan.tensor_model_parallel_size
    # measured: the unfused loss keeps the logits and their gradient; the fused one writes its gradient into the
    # logits, but in bf16 / fp16 the low-precision logits and their gradient (around the fp32 cast) remain
    if not m.cross_entropy_loss_fusion:
        extra = 2 * logits
    else:
        extra = 0 if a == 4 else 2 * (logits * a // 4)
    return extra + 4 * a * sbh


def stage_activation_bytes(pc: PlannerConfig, plan: RunPlan, stage: int, micro_batch: int) -> int:
    """Saved activations of one micro-batch on ``stage`` (recompute setting applied), in bytes.

    DeepSpeed-Ulysses divides them by N: a rank holds ``s/N`` tokens, and attention's gathered q, k, v ``n/N`` heads
    (``benchmarks/bench_ulysses_memory.py`` measures 1.05/N: one extra ``[s/N, h]`` buffer per layer, not modelled).
    Context parallelism divides them by its degree too: a rank holds ``s/cp`` tokens and saves attention's
    inputs and outputs for those only (the K/V blocks it receives are transient, not modelled).
    """
    split = pc.ds_sequence_parallel_size * pc.context_parallel_size
    return _stage_activation_bytes(pc, plan, stage, micro_batch) // split


def _stage_activation_bytes(pc: PlannerConfig, plan: RunPlan, stage: int, micro_batch: int) -> int:
    m = pc.model
    layer_ids = stage_layers(m.num_layers, plan.pipeline_model_parallel_size, stage)
    layers = len(layer_ids)
    each = each_layer(m, layer_ids, lambda i: layer_activation_bytes(pc, plan, micro_batch, i))
    per_layer = max(each, default=0)  # the largest layer: what a recomputed chunk re-creates
    outside = _outside_layers_bytes(m, plan, stage, micro_batch)
    if m.recompute_granularity != "full":
        return sum(each) + outside
    a = 4 if plan.precision == "fp32" else 2
    sbh = m.seq_length * micro_batch * m.hidden_size
    chunk = max(1, m.recompute_num_layers)
    # the peak is in a recomputed chunk's backward, where the MLP's two gradient temporaries ([s, b, f] and
    # [s, b, fc1 out], TP-split) come on top of the chunk's activations (measured: the rest of the step is smaller)
    fc1_out = fc1_width(m)
    grads = (
        a * m.seq_length * micro_batch * (m.ffn_size + fc1_out) // plan.tensor_model_parallel_size
    )
    if m.recompute_method == "block":
        # the first `chunk` layers keep only their inputs, the rest everything
        recomputed = min(layers, chunk)
        return recomputed * a * sbh + sum(each[recomputed:]) + max(outside, per_layer + grads)
    inputs = -(-layers // chunk) * a * sbh
    if plan.sequence_parallel:
        inputs //= plan.tensor_model_parallel_size
    return inputs + max(outside, chunk * per_layer + grads)


def plan_memory(
    pc: PlannerConfig,
    plan: RunPlan,
    ds_config: Mapping[str, Any],
    *,
    micro_batch: int | None = None,
) -> MemoryPlan:
    """The :class:`MemoryPlan` of the model and flags in ``pc`` run as ``plan`` with DeepSpeed config ``ds_config``.

    Args:
        micro_batch: plan another micro-batch size than the run's (``largest_micro_batch`` searches with it).
    """
    b = micro_batch or plan.micro_batch_size
    pp, mb = plan.pipeline_model_parallel_size, plan.gradient_accumulation_steps
    stages = []
    threshold = _bucket(ds_config, "stage3_param_persistence_threshold")
    for k in range(pp):
        psi = stage_param_count(pc, plan, k)
        persistent = persistent_params(pc, plan, k, threshold) if plan.zero_stage == 3 else 0
        experts = stage_expert_param_count(pc, plan, k)
        st = _state_bytes(pc, plan, psi - experts, ds_config, persistent=persistent, bucket_psi=psi)
        if experts:  # partitioned over the expert-data-parallel group
            ex = _state_bytes(
                pc, plan, experts, ds_config, n=expert_data_parallel_size(pc, plan), bucket_psi=0
            )
            st = {key: st[key] + ex[key] for key in st}
        flight = in_flight_micro_batches(pp, k, mb) if pp > 1 else 1
        stages.append(
            StageMemory(
                stage=k,
                params=psi,
                parameter_bytes=st["params"],
                gradient_bytes=st["grads"],
                optimizer_bytes=st["opt"],
                activation_bytes=flight * stage_activation_bytes(pc, plan, k, b)
                + pipeline_buffer_bytes(pc.model, plan, k, b, flight),
                bucket_bytes=st["buckets"],
                in_flight=flight,
                offloaded_bytes=st["offloaded"],
                buckets_in_backward=plan.zero_stage >= 1,
                step_bytes=st["step"],
            )
        )
    flops = (
        flops_per_token(pc.model, plan.padded_vocab_size)
        * plan.global_batch_size
        * pc.model.seq_length
    )
    plan_b = plan if b == plan.micro_batch_size else replace(plan, micro_batch_size=b)
    return MemoryPlan(
        caveats=_caveats(pc.model),
        stages=tuple(stages),
        flops_per_step=flops,
        collective_bytes=collective_bytes(
            pc,
            plan_b,
            persistence_threshold=threshold,
            pipe_partitioned=bool((ds_config.get("pipeline") or {}).get("pipe_partitioned", True)),
        ),
    )


def _caveats(m: ModelConfig) -> tuple[str, ...]:
    """What the plan leaves out or assumes for model ``m``."""
    moe = m.moe
    out = []
    if moe.is_moe(m.num_layers) and not moe.moe_token_dropping:
        out.append(
            "--disable-moe-token-dropping: expert activations are planned at balanced routing (capacity "
            "topk x tokens / experts); DeepSpeed sizes every expert's buffer by the busiest expert, up to all "
            "the micro-batch's tokens"
        )
    if moe.num_experts_switch is not None:
        out.append(
            f"Switch MLP layers (--num-experts-switch {moe.num_experts_switch}): their parameters and states are "
            "counted, but their activations as one dense MLP's (the router's probabilities and the per-expert "
            "token gathers are not)"
        )
    return tuple(out)


def largest_micro_batch(
    pc: PlannerConfig,
    plan: RunPlan,
    ds_config: Mapping[str, Any],
    capacity_bytes: float,
    *,
    limit: int = 4096,
) -> int:
    """The largest micro-batch size (up to ``limit``) whose plan fits ``capacity_bytes``; 0 when none does."""
    best = 0
    for b in range(1, limit + 1):
        if not plan_memory(pc, plan, ds_config, micro_batch=b).fits(capacity_bytes):
            break
        best = b
    return best


def _gib(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB (a tiny model's plan stays readable)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


def format_plan(mp: MemoryPlan, plan: RunPlan) -> list[str]:
    """The planner's report, one line per item (the CLI prints it; ``pretrain`` logs it)."""
    lines = [
        f"memory plan: TP {plan.tensor_model_parallel_size} x PP {plan.pipeline_model_parallel_size} x "
        + (f"CP {plan.context_parallel_size} x " if plan.context_parallel_size > 1 else "")
        + f"DP {plan.data_parallel_size}, ZeRO-{plan.zero_stage}, {plan.precision}, micro-batch "
        f"{plan.micro_batch_size}, {plan.gradient_accumulation_steps} micro-batches per step"
    ]
    for st in mp.stages:
        lines.append(
            f"  stage {st.stage}: params {st.params:,} | parameters {_gib(st.parameter_bytes)} | gradients "
            f"{_gib(st.gradient_bytes)}"
            + (f" ({_gib(st.step_bytes)} of them at the step only)" if st.step_bytes else "")
            + f" | optimizer {_gib(st.optimizer_bytes)} | activations "
            f"{_gib(st.activation_bytes)} ({st.in_flight} in flight) | buckets {_gib(st.bucket_bytes)} | "
            f"total {_gib(st.total)}"
            + (f" | offloaded to CPU {_gib(st.offloaded_bytes)}" if st.offloaded_bytes else "")
        )
    comm = ", ".join(
        f"{k.upper()} {v / 2**20:.2f} MiB" for k, v in mp.collective_bytes.items() if v
    )
    lines.append(
        f"  FLOPs per step {mp.flops_per_step:.3e}; collective bytes per step per rank: {comm or 'none'}"
    )
    lines.extend(f"  not modeled: {c}" for c in mp.caveats)
    return lines


def capacity_of(gpu_type: str | None, memory_gb: float | None) -> float | None:
    """Device bytes from --memory-gb (GB = 10^9 bytes) or --gpu-type; None when neither is given.

    Raises:
        ValueError: an unknown --gpu-type, or a --memory-gb that is not a positive finite number (``nan``, and
            ``1e400`` which float() reads as ``inf``, would make every plan "fit" or none).
    """
    if memory_gb is not None:
        if not (math.isfinite(memory_gb) and memory_gb > 0):
            raise ValueError(
                f"--memory-gb ({memory_gb}) must be a positive finite number; give the device memory in "
                "GB, e.g. --memory-gb 80."
            )
        return memory_gb * 1e9
    if gpu_type is None:
        return None
    if gpu_type not in GPU_MEMORY_GB:
        raise ValueError(
            f"--gpu-type {gpu_type} is not known; use one of {', '.join(GPU_MEMORY_GB)} or give --memory-gb."
        )
    return GPU_MEMORY_GB[gpu_type] * 1e9


def format_fit(
    pc: PlannerConfig,
    plan: RunPlan,
    mp: MemoryPlan,
    capacity: float,
    ds_config: Mapping[str, Any],
) -> str:
    """One line: whether the plan fits ``capacity`` bytes, and the largest micro-batch that does."""
    limit = 4096
    best = largest_micro_batch(pc, plan, ds_config, capacity, limit=limit)
    verdict = "fits" if mp.fits(capacity) else "does NOT fit"
    return (
        f"  {verdict} in {capacity / 1e9:.1f} GB per device (worst stage {mp.worst.stage}: "
        f"{_gib(mp.worst.total)}); largest micro-batch that fits: "
        f"{'none' if not best else f'{best} or more' if best == limit else best}"
    )
