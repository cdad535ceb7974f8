"""The memory planner (``megatron/planning/memory_plan.py``) on hand-computed cases, and ``tools/plan_memory.py``.

The small model: 2 layers, h 64, 4 heads, s 32, vocab 100 -> 128 rows; biases, LayerNorm, tied embeddings.
Per layer: QKV 64 x 192 + 192, dense 64 x 64 + 64, fc1 64 x 256 + 256, fc2 256 x 64 + 64, two LayerNorms 4 x 64
= 49,984; embeddings 128 x 64 + 32 x 64 (positions); final norm 128: Psi = 110,336 (DP 4: partition 27,584).
"""

from __future__ import annotations

import pytest

from megatron.config import RunPlan, TridentConfig, parse_args, validate
from megatron.model import GPTModel
from megatron.mpu.context import ParallelContext
from megatron.planning import memory_plan as mpl
from megatron.planning import moe_plan
from megatron.planning.planner_config import PlannerConfig
from tools import plan_memory

SMALL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--vocab-size", "100", "--micro-batch-size", "1", "--train-iters", "1",
]  # fmt: skip
PSI, PART = 110_336, 27_584


def _planner(cfg: TridentConfig) -> PlannerConfig:
    return PlannerConfig.from_configs(cfg.model, cfg.parallel, cfg.training)


def _plan(*extra: str, world: int = 4) -> tuple[PlannerConfig, RunPlan]:
    """(the planner's config, the run plan) of SMALL + ``extra`` on ``world`` CUDA ranks."""
    cfg = parse_args([*SMALL, *extra])
    validate(cfg, world_size=world, device_type="cuda")
    return _planner(cfg), RunPlan.build(cfg, world_size=world, device_type="cuda", true_vocab=100)


def test_param_count_matches_a_built_model() -> None:
    for extra in ([], ["--swiglu", "--normalization", "rmsnorm", "--use-rotary-position-embeddings",
                       "--no-position-embedding", "--disable-bias-linear", "--num-key-value-heads", "2",
                       "--untie-embeddings-and-output-weights"],
                  # issue #31: QKV bias alone, QK-norm (LayerNorm: weight and bias), head dim 24 != 64 / 4
                  ["--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm", "--kv-channels", "24",
                   "--use-rotary-position-embeddings", "--no-position-embedding"]):  # fmt: skip
        cfg, plan = _plan(*extra, world=1)
        model = GPTModel(
            cfg.model.__class__(**{**cfg.model.__dict__, "vocab_size": 100}),
            ParallelContext(seed=1),
        )
        built = sum(p.numel() for p in model.parameters())
        assert mpl.stage_param_count(cfg, plan, 0) == built, extra
    cfg, plan = _plan(world=1)
    assert mpl.stage_param_count(cfg, plan, 0) == PSI


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        (
            0,
            (4 * PSI, 4 * PSI, 8 * PSI, 4 * PSI),
        ),  # optimizer: Adam's moments; bucket: the flat all-reduce
        # fp32 partition clone + moments, over 4; every gradient whole until the boundary's reduce
        (1, (4 * PSI, 4 * PSI, 12 * PART, 4 * PSI)),
        (2, (4 * PSI, 8 * PART, 12 * PART, 4 * PSI)),  # a separate contiguous gradient partition
        # ZeRO-3 with threshold 10,000: the 2 x (QKV 12,288 + fc1 16,384 + fc2 16,384) = 90,112 weights are
        # partitioned, the other 20,224 stay whole; buckets: reduce (Psi) + the gathered weights
        (3, (4 * (20_224 + 90_112 // 4), 4 * PART, 12 * PART, 4 * PSI + 4 * 90_112)),
    ],
)
def test_zero_stage_bytes_fp32(stage: int, expected: tuple[int, int, int, int]) -> None:
    cfg, plan = _plan("--zero-stage", str(stage))
    ds = {"zero_optimization": {"stage3_param_persistence_threshold": 10_000}}
    st = mpl.plan_memory(cfg, plan, ds).stages[0]
    assert (st.parameter_bytes, st.gradient_bytes, st.optimizer_bytes, st.bucket_bytes) == expected
    states = sum(expected[:3])
    act = st.activation_bytes
    # ZeRO-0 all-reduces after backward: the peak takes the larger of its flat copy and the activations. ZeRO-1/2/3
    # keep their reduce bucket from the first gradient to the boundary, beside the next micro-batch's activations;
    # ZeRO-2's fp32 gradient copy (4 PART) exists only at the step, when the activations do not.
    peak = {
        0: states + max(expected[3], act),
        1: states + expected[3] + act,
        2: states - 4 * PART + expected[3] + max(act, 4 * PART),
        3: states + expected[3] + act,
    }[stage]
    assert (st.step_bytes, st.total) == (4 * PART if stage == 2 else 0, peak)


def test_bf16_master_weights_and_offload() -> None:
    cfg, plan = _plan("--zero-stage", "1", "--bf16")
    st = mpl.plan_memory(cfg, plan, {}).stages[0]
    # bf16 parameters; whole bf16 gradients + the fp32 gradient partition; fp32 master + 2 moments over 4 ranks
    assert (st.parameter_bytes, st.gradient_bytes, st.optimizer_bytes) == (
        2 * PSI,
        2 * PSI + 4 * PART,
        12 * PART,
    )
    # the fp32 partition is made at the step: it counts against the activations, not beside them
    assert st.step_bytes == 4 * PART
    assert st.total == 2 * PSI + 2 * PSI + 12 * PART + st.bucket_bytes + max(
        st.activation_bytes, 4 * PART
    )
    off = mpl.plan_memory(
        cfg, plan, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    )
    assert off.stages[0].optimizer_bytes == 0
    assert off.stages[0].offloaded_bytes == 16 * PART
    assert (off.stages[0].gradient_bytes, off.stages[0].step_bytes) == (2 * PSI, 0)
    # ZeRO-0: bf16 gradients + their fp32 copy for the step, of the whole model
    st = mpl.plan_memory(*_plan("--zero-stage", "0", "--bf16"), {}).stages[0]
    assert (st.gradient_bytes, st.step_bytes) == (6 * PSI, 4 * PSI)


def test_dropout_mask_bytes_by_device() -> None:
    """A hidden-dropout mask is a bool on CUDA, the input's dtype on CPU (F.dropout's scaled noise)."""
    sbh = 32 * 64
    for device, bf16, mask in (("cuda", False, 1), ("cpu", False, 4), ("cpu", True, 2)):
        flags = [
            "--hidden-dropout",
            "0.1",
            "--attention-dropout",
            "0",
            *(["--bf16"] if bf16 else []),
        ]
        cfg = parse_args([*SMALL, *flags])
        plan = RunPlan.build(cfg, world_size=1, device_type=device, true_vocab=100)
        cfg0 = parse_args([*SMALL, *flags[:1], "0", *flags[2:]])
        plan0 = RunPlan.build(cfg0, world_size=1, device_type=device, true_vocab=100)
        diff = mpl.layer_activation_bytes(_planner(cfg), plan, 1) - mpl.layer_activation_bytes(
            _planner(cfg0), plan0, 1
        )
        assert diff == 2 * mask * sbh, device


def test_one_f_one_b_in_flight() -> None:
    assert [mpl.in_flight_micro_batches(4, k, 8) for k in range(4)] == [4, 3, 2, 1]
    assert [mpl.in_flight_micro_batches(4, k, 2) for k in range(4)] == [2, 2, 2, 1]
    cfg, plan = _plan(
        "--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--zero-stage", "1",
        world=4,
    )  # fmt: skip
    stages = mpl.plan_memory(cfg, plan, {}).stages
    assert [s.in_flight for s in stages] == [2, 1]
    assert [s.params for s in stages] == [49_984 + 128 * 64 + 32 * 64, 49_984 + 128 + 128 * 64]


def test_activations_by_recompute_and_sequence_parallel() -> None:
    none = mpl.plan_memory(*_plan(), {}).stages[0].activation_bytes
    sel = mpl.plan_memory(*_plan("--recompute-granularity", "selective"), {}).stages[0]
    full = mpl.plan_memory(*_plan("--recompute-granularity", "full"), {}).stages[0]
    assert full.activation_bytes < sel.activation_bytes < none
    tp = mpl.plan_memory(*_plan("--tensor-model-parallel-size", "2"), {}).stages[0]
    sp = mpl.plan_memory(
        *_plan("--tensor-model-parallel-size", "2", "--sequence-parallel"), {}
    ).stages[0]
    assert sp.activation_bytes < tp.activation_bytes < none
    # one layer, no dropout masks of attention (--attention-dropout 0): hand count at TP 1, fp32, s 32, b 1
    cfg, plan = _plan("--attention-dropout", "0", "--hidden-dropout", "0")
    sbh = 32 * 64
    assert mpl.layer_activation_bytes(cfg, plan, 1) == 4 * 16 * sbh + 8 * 4 * 32
    # full recompute, one layer per chunk: both layers' inputs + one layer recomputed + the MLP's two [s, b, 4h]
    # gradient temporaries (larger than the logits + final norm outside the layers: 4 x 32 x 128 + 8 sbh)
    cfg, plan = _plan(
        "--attention-dropout", "0", "--hidden-dropout", "0", "--recompute-granularity", "full",
        "--recompute-num-layers", "1",
    )  # fmt: skip
    layer = 4 * 16 * sbh + 8 * 4 * 32
    assert mpl.stage_activation_bytes(cfg, plan, 0, 1) == 2 * 4 * sbh + layer + 2 * 4 * 4 * sbh


def test_collective_bytes_hand_counts() -> None:
    cfg, plan = _plan("--tensor-model-parallel-size", "2", "--zero-stage", "0", world=4)
    sbh_bytes = 4 * 32 * 64
    comm = mpl.collective_bytes(cfg, plan)
    assert (
        comm["tp"] == (4 * 2 + 2) * sbh_bytes
    )  # 2 layers: 4 all-reduces each, + embedding + output
    assert comm["dp"] == 4 * mpl.stage_param_count(cfg, plan, 0)
    cfg, plan = _plan("--zero-stage", "2", "--global-batch-size", "8")  # 2 micro-batches per rank
    assert mpl.collective_bytes(cfg, plan)["dp"] == 3 * 4 * PSI
    cfg, plan = _plan("--tensor-model-parallel-size", "2", "--sequence-parallel", world=2)
    assert mpl.collective_bytes(cfg, plan) == {
        "tp": 0,
        "sp": (10 * 2 + 4) * sbh_bytes,
        "pp": 0,
        "dp": 0,
    }
    # PP 2, DP 2, 4 micro-batches: [s, b, h] out (with int64 position ids) and its gradient back per micro-batch,
    # + the tied embedding's gradient all-reduce
    cfg, plan = _plan(
        "--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--zero-stage", "1"
    )
    assert mpl.collective_bytes(cfg, plan)["pp"] == 2 * 4 * sbh_bytes + 4 * 8 * 32 + 4 * 128 * 64


def test_pipeline_engine_buffers() -> None:
    cfg, plan = _plan(
        "--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--zero-stage", "1"
    )
    sbh = 32 * 64
    # first stage: each in-flight micro-batch's output + one gradient buffer
    assert mpl.pipeline_buffer_bytes(cfg.model, plan, 0, 1) == 2 * 4 * sbh
    assert mpl.pipeline_buffer_bytes(cfg.model, plan, 0, 1, in_flight=2) == 3 * 4 * sbh
    # last stage: receive / gradient buffers; the logits and their gradient only without the fused loss
    assert mpl.pipeline_buffer_bytes(cfg.model, plan, 1, 1) == 4 * 4 * sbh
    cfg, plan = _plan(
        "--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--zero-stage", "1",
        "--no-cross-entropy-loss-fusion",
    )  # fmt: skip
    assert mpl.pipeline_buffer_bytes(cfg.model, plan, 1, 1) == 2 * 4 * 32 * 128 + 4 * 4 * sbh
    # bf16, fused loss: the bf16 logits and their gradient beside the fp32 ones
    cfg, plan = _plan(
        "--pipeline-model-parallel-size",
        "2",
        "--global-batch-size",
        "8",
        "--zero-stage",
        "1",
        "--bf16",
    )
    assert mpl.pipeline_buffer_bytes(cfg.model, plan, 1, 1) == 2 * 2 * 32 * 128 + 4 * 2 * sbh
    cfg, plan = _plan()
    assert mpl.pipeline_buffer_bytes(cfg.model, plan, 0, 1) == 0


def test_tool_prints_the_plan_and_fits(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_memory.main(["--world-size", "4", "--memory-gb", "80", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "TP 1 x PP 1 x DP 4, ZeRO-0" in out
    assert "stage 0: params 110,336" in out
    assert "FLOPs per step" in out
    assert "fits in 80.0 GB" in out and "largest micro-batch that fits: 4096 or more" in out
    assert plan_memory.main(["--world-size", "4", "--memory-gb", "0.001", *SMALL]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit in 0.0 GB" in out and "largest micro-batch that fits: none" in out


def test_tool_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_memory.main(["--world-size", "3", *SMALL, "--tensor-model-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: ")
        and "--tensor-model-parallel-size" in err
        and len(err.splitlines()) == 1
    )
    assert plan_memory.main(["--gpu-type", "Z80", *SMALL]) == 2
    assert "--gpu-type" in capsys.readouterr().err
    for bad in ("-1.0", "nan", "inf"):
        with pytest.raises(
            ValueError, match=rf"--memory-gb \({bad}\) must be a positive finite number"
        ):
            mpl.capacity_of(None, float(bad))
    # nan / 1e400 (read as inf) used to "fit in inf GB"; --world-size 0 was taken as "not given"
    for flags, wrong in (
        (["--memory-gb", "nan"], "'nan' is not a positive finite number"),
        (["--memory-gb", "1e400"], "'1e400' is not a positive finite number"),
        (["--world-size", "0"], "--world-size (0) must be at least 1"),
    ):
        assert plan_memory.main([*flags, *SMALL]) == 2, flags
        err = capsys.readouterr().err
        assert err.startswith("error: ") and wrong in err and len(err.splitlines()) == 1, err


@pytest.mark.timeout(60)
def test_plan_is_linear_in_num_layers(capsys: pytest.CaptureFixture[str]) -> None:
    """100,000 layers plan in well under 2 s of CPU, dense and MoE (the expert list was rebuilt per layer:
    8,000 layers took 19 s, 100,000 no answer in minutes), and the sum is the per-layer count times L."""
    import time

    many = [*SMALL[2:], "--num-layers", "100000", "--world-size", "1"]
    for extra in ([], ["--num-experts", "4", "--expert-interval", "2"]):
        start = time.process_time()
        assert plan_memory.main([*many, *extra]) == 0
        took = time.process_time() - start
        assert took < 2.0, (extra, took)
    out = capsys.readouterr().out
    assert f"stage 0: params {100_000 * 49_984 + 128 * 64 + 32 * 64 + 128:,}" in out, out


def test_largest_micro_batch() -> None:
    cfg, plan = _plan()
    capacity = mpl.plan_memory(cfg, plan, {}, micro_batch=3).worst.total
    assert mpl.largest_micro_batch(cfg, plan, {}, capacity) == 3
    assert mpl.largest_micro_batch(cfg, plan, {}, capacity - 1) == 2
    assert mpl.largest_micro_batch(cfg, plan, {}, 1) == 0


# SMALL with --num-experts 4: layer 2 of 2 is an MoE layer. Its attention and norms hold 16,896, the gate 4 x 64 =
# 256; each expert (fc1 64 x 256 + 256, fc2 256 x 64 + 64) 33,088. At EP 2 a rank holds 2 experts = 66,176
# (partitioned by ZeRO over the DP / EP = 2 expert-data-parallel ranks), and 49,984 + 17,152 + 10,240 + 128 =
# 77,504 other parameters (over DP = 4).
MOE = ("--num-experts", "4", "--moe-expert-parallel-size", "2", "--create-moe-param-group")
MOE_DENSE, MOE_EXPERT = 77_504, 66_176


def test_expert_params_match_built_models() -> None:
    """Per rank, the planner counts what a built MoE / PR-MoE / Switch MLP model holds (EP rank 0 of 2 and 1 of 1)."""
    cases = [
        (MOE, 2),
        (("--num-experts", "4", "--mlp-type", "residual", "--swiglu", "--topk", "2"), 1),
        (
            (
                "--num-experts",
                "2",
                "4",
                "--expert-interval",
                "1",
                "--moe-expert-parallel-size",
                "2",
            ),
            2,
        ),
        (("--num-experts-switch", "3", "--swiglu"), 1),
    ]
    for extra, ep in cases:
        cfg, plan = _plan(*extra, world=4)
        model = GPTModel(
            cfg.model.__class__(**{**cfg.model.__dict__, "vocab_size": 100}),
            ParallelContext(seed=1, expert_parallel_size=ep, expert_parallel_rank=0),
        )
        built = sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for n, p in model.named_parameters() if "deepspeed_experts" in n)
        assert mpl.stage_param_count(cfg, plan, 0) == built, extra
        assert mpl.stage_expert_param_count(cfg, plan, 0) == experts, extra
    cfg, plan = _plan(*MOE)
    assert mpl.stage_param_count(cfg, plan, 0) == MOE_DENSE + MOE_EXPERT
    assert mpl.stage_expert_param_count(cfg, plan, 0) == MOE_EXPERT


def test_expert_states_partition_over_expert_data_parallel() -> None:
    """ZeRO-1, DP 4, EP 2: other parameters' states over 4 ranks, the experts' over 2; expert TP splits experts."""
    cfg, plan = _plan(*MOE, "--zero-stage", "1")
    st = mpl.plan_memory(cfg, plan, {}).stages[0]
    dense_part, expert_part = MOE_DENSE // 4, MOE_EXPERT // 2
    assert st.parameter_bytes == 4 * (MOE_DENSE + MOE_EXPERT)
    assert st.gradient_bytes == 4 * (MOE_DENSE + MOE_EXPERT)  # whole until the boundary's reduce
    assert st.optimizer_bytes == 12 * (dense_part + expert_part)
    assert st.bucket_bytes == 4 * (
        MOE_DENSE + MOE_EXPERT
    )  # one reduce bucket, sized for everything
    # TP 2: whole experts on each TP rank, unless --enable-expert-tensor-parallelism halves them
    whole = _plan(*MOE, "--tensor-model-parallel-size", "2")
    split = _plan(*MOE, "--tensor-model-parallel-size", "2", "--enable-expert-tensor-parallelism")
    assert mpl.stage_expert_param_count(*whole, 0) == MOE_EXPERT
    assert mpl.stage_expert_param_count(*split, 0) == 2 * (64 * 128 + 128 * 64 + 128 + 64)


def test_moe_layer_activations_and_collectives() -> None:
    """SMALL with 4 experts in layer 2, EP 2, fp32, s 32 x b 1 = S 32 tokens: hand counts of the MoE terms (the
    formulas were fitted to real runs, ``python -m benchmarks.bench_memory_plan --only moe-...``: within 4 %)."""
    cfg, plan = _plan(*MOE, "--attention-dropout", "0", "--hidden-dropout", "0")
    dense = mpl.layer_activation_bytes(cfg, plan, 1, 0)
    # top-1, capacity factor 1: C = ceil(32 / 4) = 8, so E C = 32 slots; f = 256
    gate, dispatch, combine = 4 * 32 * 4 * 2, 8 * (4 * 8 + 1), 4 * 32 * 64 + 12 * 32
    experts = 4 * 32 * (64 + 256 + 256)
    mlp = (
        4 * 32 * (256 + 256)
    )  # the dense MLP's fc1 and activation outputs, which an MoE layer does not have
    assert (
        mpl.layer_activation_bytes(cfg, plan, 1, 1)
        == dense - mlp + gate + dispatch + experts + combine
    )
    # top-2: C = 16; TP 2 with whole experts: each TP rank's experts see C / 2 of the slots
    top2 = _plan(*MOE, "--topk", "2", "--tensor-model-parallel-size", "2", world=8)
    assert moe_plan.expert_capacity(top2[0].model, top2[1], 1, 4) == 16
    assert moe_plan.moe_mlp_activation_bytes(*top2, 1, 4) == (
        4 * 32 * 4 * 3 + 8 * (4 * 16 + 1) + 4 * 4 * 8 * (64 + 512) + 2 * 4 * 32 * 64 + 12 * 2 * 32
    )
    # collectives per step (1 micro-batch): EP 4 all-to-alls of [E, C / t, h]; TP: two all-gathers of [E, C, h] for
    # the dense MLP's two [s, b, h] all-reduces; experts' gradients over DP x TP / EP = 4 ranks, like the rest
    comm = mpl.collective_bytes(*top2)
    slots, sbh = 4 * 16 * 64, 32 * 64
    assert comm["ep"] == 4 * 4 * slots // 2
    assert comm["tp"] == 4 * ((4 * 2 + 2) * sbh + 2 * (slots - sbh))
    assert moe_plan.expert_data_parallel_size(*top2) == 4
    assert comm["dp"] == 4 * mpl.stage_param_count(*top2, 0)
    # TP-split experts, world 4 (DP 2): 4 all-gathers of the slots, the MLP all-reduces [E C, h]; the experts'
    # gradients over DP / EP = 1 rank: no traffic
    split = _plan(*MOE, "--topk", "2", "--tensor-model-parallel-size", "2",
                  "--enable-expert-tensor-parallelism", world=4)  # fmt: skip
    comm = mpl.collective_bytes(*split)
    assert comm["tp"] == 4 * ((4 * 2 + 2) * sbh + 4 * slots + 2 * (slots - sbh))
    assert moe_plan.expert_data_parallel_size(*split) == 1
    psi, experts_psi = mpl.stage_param_count(*split, 0), mpl.stage_expert_param_count(*split, 0)
    assert comm["dp"] == 4 * (psi - experts_psi)


def test_expert_layers_caveat(capsys: pytest.CaptureFixture[str]) -> None:
    """The plan says under its numbers what it assumes for MoE without token dropping and for Switch MLPs."""
    assert not mpl.plan_memory(*_plan(), {}).caveats
    assert not mpl.plan_memory(*_plan(*MOE), {}).caveats
    argv = ["--world-size", "4", *SMALL, "--num-experts", "4", "--disable-moe-token-dropping"]
    assert plan_memory.main(argv) == 0
    out = capsys.readouterr().out
    assert "--disable-moe-token-dropping: expert activations are planned at balanced routing" in out
    switch = mpl.plan_memory(*_plan("--num-experts-switch", "2"), {})
    assert len(switch.caveats) == 1 and "--num-experts-switch 2" in switch.caveats[0]
