"""Context parallelism (``--context-parallel-size N``): rank grid, data split, loss scale, flag rules, planner, and
layout parity against N = 1.

Parity: the same flags, seed, data and global batch as ``test_train_parity.py`` (4 layers, width 64, seq 32, dropout
0, fp32, 20 iterations, global batch 8); every run is ``megatron.training.pretrain(cfg)`` on spawned gloo ranks with
the real DeepSpeed engine, and the per-iteration LM loss must be within 1e-5 relative of the N = 1 run. With CP only
the order of reductions changes (the loss sum and token count over CP x Ulysses, the gradients summed over CP by
DeepSpeed's reduction and ``loss_func``'s backward scale, the attention over gathered K/V), about 1e-7 here.

Default run (one spawn of 2 ranks, about 35 s): the N = 1 baselines of both presets at DP 2 (themselves equal to the
one-rank run, ``test_train_parity.py``), then GPT-2 at CP 2 and LLaMA-GQA at CP 2 under ZeRO-3 (ZeRO-3 divides by
every rank of the reduction group: the path the backward scale must also hold on). The matrix (CP 4, CP 2 x TP 2
with --sequence-parallel, CP 2 x PP 2, CP 2 x Ulysses 2, CP 2 x DP 2 ZeRO-3, both presets) against one-rank
baselines, and resuming a CP 2 checkpoint at CP 2 / 1 / 4 plus generating from it, are ``-m slow``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.config import parse_args, validate
from megatron.data.batch import take_positions
from megatron.model.utils import loss_func
from megatron.mpu.parallel_state import rank_grid, validate_degrees
from megatron.testing import run_distributed
from megatron.training.data_iterators import SequenceSplit
from tests.training.test_train_parity import _argv, _layouts, _max_rel

RTOL = 1e-5
CP = "--context-parallel-size"
SP = "--ds-sequence-parallel-size"


# ---------------------------------------------------------------- rank grid (pure)


def test_rank_grid_two_level_worked_example() -> None:
    """The docstring's W = 16, p = 2, sp = 2, cp = 2 example, group by group."""
    g = rank_grid(16, 2, 1, ds_sequence_parallel_size=2, context_parallel_size=2)
    assert g.data_parallel_size == 2 and g.context_parallel_size == 2
    assert g.tensor_model_parallel == [[2 * i, 2 * i + 1] for i in range(8)]
    assert g.sequence_parallel == [
        [0, 2],
        [1, 3],
        [4, 6],
        [5, 7],
        [8, 10],
        [9, 11],
        [12, 14],
        [13, 15],
    ]
    assert g.context_parallel == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
        [8, 12],
        [9, 13],
        [10, 14],
        [11, 15],
    ]
    assert g.context_sequence_parallel == [
        [0, 2, 4, 6],
        [1, 3, 5, 7],
        [8, 10, 12, 14],
        [9, 11, 13, 15],
    ]
    assert g.data_parallel == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert g.sequence_data_parallel == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    assert g.model_parallel == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
        [8, 9],
        [10, 11],
        [12, 13],
        [14, 15],
    ]


def test_rank_grid_cp_with_pipeline() -> None:
    """W = 8, p = 2, pp = 2, cp = 2: CP sits between DP and TP; DeepSpeed's pipe "data" axis is DP x CP."""
    g = rank_grid(8, 2, 2, context_parallel_size=2)
    assert g.data_parallel_size == 1
    assert g.context_parallel == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.pipeline_model_parallel == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.sequence_data_parallel == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.embedding == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # cp = 1 leaves every group as before (TP fastest, then DP, then PP)
    old = rank_grid(8, 2, 2)
    assert old.context_parallel == [[r] for r in range(8)]
    assert old.data_parallel == [[0, 2], [1, 3], [4, 6], [5, 7]] == old.sequence_data_parallel


def test_validate_degrees_names_context() -> None:
    assert validate_degrees(8, 2, 1, context_parallel_size=2) == 2
    with pytest.raises(
        ValueError, match=r"--context-parallel-size 4\).*tensor x pipeline x context = 8"
    ):
        validate_degrees(4, 2, 1, context_parallel_size=4)
    with pytest.raises(ValueError, match=r"the context size must be a positive integer"):
        validate_degrees(4, 1, 1, context_parallel_size=0)


# ---------------------------------------------------------------- data split and loss (one process)


def test_sequence_split_positions_and_batch() -> None:
    """CP 2 x Ulysses 2 over S = 16: every rank its S/4 tokens; together a permutation; document ids whole."""
    seen = []
    for cp_rank in range(2):
        for sp_rank in range(2):
            split = SequenceSplit(cp_rank=cp_rank, cp_size=2, sp_rank=sp_rank, sp_size=2)
            seen.append(split.positions(16).tolist())
    # CP rank 0 holds chunks 0 and 3 (0-3, 12-15), CP rank 1 chunks 1 and 2; Ulysses halves each contiguously
    assert seen == [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]
    text = torch.arange(32).view(2, 16)
    batch = {
        "tokens": text,
        "labels": text + 100,
        "loss_mask": torch.ones(2, 16),
        "position_ids": torch.arange(16).expand(2, 16),
        "document_ids": torch.zeros(2, 16, dtype=torch.long),
    }
    mine = SequenceSplit(cp_rank=1, cp_size=2).apply(batch)
    assert mine["tokens"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27]]
    assert mine["position_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # global positions
    assert mine["document_ids"] is batch["document_ids"]  # the whole sequence's ids, on every rank
    assert take_positions(batch, torch.tensor([0]))["labels"].tolist() == [[100], [116]]
    assert SequenceSplit().apply(batch) is batch
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 4 chunks"):
        SequenceSplit(cp_size=2).positions(10)


def test_loss_backward_scaled_by_cp_value_not() -> None:
    """DeepSpeed averages gradients over DP x CP; ``loss_func`` multiplies the backward by cp, never the value."""
    per_token = torch.rand(2, 8, requires_grad=True)
    mask = (torch.rand(2, 8) > 0.3).float()
    plain = loss_func(per_token, mask)
    (grad_plain,) = torch.autograd.grad(plain, per_token)
    scaled = loss_func(per_token, mask, context_parallel_size=4)
    (grad_scaled,) = torch.autograd.grad(scaled, per_token)
    assert scaled.item() == plain.item()
    torch.testing.assert_close(grad_scaled, 4 * grad_plain)


# ---------------------------------------------------------------- flag rules (no process group)

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "1", "--train-iters", "2", "--mock-data",
    "--attention-dropout", "0",
]  # fmt: skip


def _validate(*extra: str, world: int = 4) -> None:
    validate(parse_args([*BASE, *extra]), world_size=world)


def test_valid_layouts_pass() -> None:
    _validate(CP, "4")
    _validate(CP, "2", SP, "2")
    _validate(CP, "2", "--tensor-model-parallel-size", "2", "--sequence-parallel")
    _validate(CP, "2", "--pipeline-model-parallel-size", "2")
    cfg = parse_args([*BASE, CP, "2"])
    assert cfg.parallel.context_parallel_size == 2 and cfg.parallel.data_parallel_size(8) == 4


@pytest.mark.parametrize(
    ("extra", "world", "match"),
    [
        (
            [CP, "2", "--seq-length", "30", "--max-position-embeddings", "32"],
            4,
            r"--seq-length \(30\) must be divisible by 2 x --context-parallel-size \(2\) = 4.*\(e\.g\. 32\)",
        ),
        (
            [CP, "2", SP, "2", "--seq-length", "20", "--max-position-embeddings", "32"],
            4,
            r"--seq-length \(20\) must be divisible by 2 x --context-parallel-size \(2\) x "
            r"--ds-sequence-parallel-size \(2\) = 8",
        ),
        (
            [
                CP,
                "2",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--seq-length",
                "28",
            ],
            4,
            r"x --tensor-model-parallel-size \(2\) under --sequence-parallel = 8",
        ),
        ([CP, "2", "--attention-dropout", "0.1"], 2, r"has no dropout; pass --attention-dropout 0"),
        ([CP, "2", "--num-experts", "2"], 2, r"MoE is not built with context parallelism"),
        (
            [CP, "4"],
            6,
            r"world size \(6\) must be divisible by .*--context-parallel-size \(4\) = 4.*1 or 2",
        ),
        ([CP, "0"], 4, r"--context-parallel-size \(0\) must be a positive integer"),
    ],
)
def test_refused_layouts(extra: list[str], world: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _validate(*extra, world=world)


def test_pipeline_batch_and_planner_count_cp() -> None:
    """The pipeline grid counts CP ranks as DP (DeepSpeed's batch x cp); the planner divides activations by cp."""
    from megatron.config import RunPlan
    from megatron.planning.collectives import collective_bytes
    from megatron.planning.memory_plan import pipeline_buffer_bytes, stage_activation_bytes
    from megatron.planning.planner_config import PlannerConfig
    from megatron.training.ds_config import build_ds_config

    def plan_of(cp: int, pp: int) -> tuple[object, RunPlan, PlannerConfig]:
        cfg = parse_args([*BASE, CP, str(cp), "--pipeline-model-parallel-size", str(pp)])
        world = 2 * cp * pp
        validate(cfg, world_size=world)
        plan = RunPlan.build(cfg, world_size=world, true_vocab=300)
        return cfg, plan, PlannerConfig.from_configs(cfg.model, cfg.parallel, cfg.training)

    cfg, plan, pc = plan_of(2, 2)
    assert plan.context_parallel_size == 2 and plan.data_parallel_size == 2
    ds = build_ds_config(cfg, plan)
    assert ds["train_batch_size"] == 2 * plan.global_batch_size
    assert ds["gradient_accumulation_steps"] == plan.gradient_accumulation_steps
    # the K/V of the whole sequence per layer, forward and backward: 32 tokens x 2 x 8 heads x 8 channels x 4 B
    assert (
        collective_bytes(pc, plan)["cp"]
        == 2 * 1 * (4 * 32 * 2 * 8 * 8) * plan.gradient_accumulation_steps
    )
    _, plan1, pc1 = plan_of(1, 2)
    assert "cp" not in collective_bytes(pc1, plan1)
    for stage in (0, 1):
        whole = stage_activation_bytes(pc1, plan1, stage, 1)
        assert stage_activation_bytes(pc, plan, stage, 1) == whole // 2
        assert pipeline_buffer_bytes(pc.model, plan, stage, 1) * 2 == pipeline_buffer_bytes(
            pc1.model, plan1, stage, 1
        )


# ---------------------------------------------------------------- parity (spawned ranks)


def test_context_parallel_parity_default() -> None:
    """2 ranks: GPT-2 and LLaMA-GQA at CP 1 x DP 2 (the baselines), GPT-2 at CP 2, LLaMA-GQA at CP 2 ZeRO-3."""
    gpt2, llama, gpt2_cp, llama_cp = _layouts(
        2,
        [
            _argv("gpt2", 1, 1),
            _argv("llama", 1, 1),
            _argv("gpt2", 1, 1, CP, "2"),
            _argv("llama", 1, 1, CP, "2", "--zero-stage", "3"),
        ],
    )
    assert (
        gpt2[-1] < gpt2[0] - 0.05 and llama[-1] < llama[0] - 0.05
    )  # it learns: parity is not vacuous
    diffs = {"gpt2 cp2": _max_rel(gpt2_cp, gpt2), "llama cp2 zero3": _max_rel(llama_cp, llama)}
    print(diffs)
    assert all(d < RTOL for d in diffs.values()), diffs


@pytest.fixture(scope="module")
def baselines() -> dict[str, list[float]]:
    gpt2, llama = _layouts(1, [_argv("gpt2", 1, 1), _argv("llama", 1, 1)])
    return {"gpt2": gpt2, "llama": llama}


MATRIX = [
    # (name, world, tp, pp, extra flags)
    ("gpt2 cp2", 2, 1, 1, [CP, "2"]),
    ("gpt2 cp4", 4, 1, 1, [CP, "4"]),
    ("gpt2 cp2 tp2 sp", 4, 2, 1, [CP, "2", "--sequence-parallel"]),
    ("gpt2 cp2 pp2", 4, 1, 2, [CP, "2"]),
    ("gpt2 cp2 dp2 zero3", 4, 1, 1, [CP, "2", "--zero-stage", "3"]),
    ("llama cp4 zero1", 4, 1, 1, [CP, "4", "--zero-stage", "1"]),
    ("llama cp2 tp2 sp", 4, 2, 1, [CP, "2", "--sequence-parallel"]),
    ("llama cp2 pp2", 4, 1, 2, [CP, "2"]),
    ("llama cp2 ulysses2", 4, 1, 1, [CP, "2", SP, "2"]),
    ("llama cp2 ulysses2 zero3", 4, 1, 1, [CP, "2", SP, "2", "--zero-stage", "3"]),
    ("llama cp2 dp2 zero3", 4, 1, 1, [CP, "2", "--zero-stage", "3"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_parity_matrix(baselines: dict[str, list[float]], world: int) -> None:
    cases = [(n, tp, pp, extra) for n, w, tp, pp, extra in MATRIX if w == world]
    runs = _layouts(world, [_argv(n.split()[0], tp, pp, *extra) for n, tp, pp, extra in cases])
    diffs = {n: _max_rel(r, baselines[n.split()[0]]) for (n, _, _, _), r in zip(cases, runs)}
    print(diffs)
    assert all(d < RTOL for d in diffs.values()), diffs


# ---------------------------------------------------------------- checkpoints across CP sizes, generation

RESUME = ["--train-iters", "6", "--zero-stage", "0"]


def _train_and_save(tmp: str) -> dict[str, list[float]]:
    from megatron.training import pretrain

    cp2 = _argv("gpt2", 1, 1, CP, "2", *RESUME)
    full = pretrain(parse_args(cp2)).losses
    pretrain(parse_args([*cp2, "--train-iters", "3", "--save", f"{tmp}/cp2"]))
    resumed = pretrain(parse_args([*cp2, "--load", f"{tmp}/cp2"])).losses
    cp1 = _argv("gpt2", 1, 1, *RESUME, "--load", f"{tmp}/cp2")  # CP 1 x DP 2
    dp2 = pretrain(parse_args(cp1)).losses
    pretrain(
        parse_args([*_argv("gpt2", 1, 1, *RESUME), "--train-iters", "3", "--save", f"{tmp}/cp1"])
    )
    return {"full": full, "resumed": resumed, "cp1 dp2": dp2}


def _resume_at(tmp: str, cp: int) -> list[float]:
    from megatron.training import pretrain

    argv = _argv("gpt2", 1, 1, CP, str(cp), *RESUME, "--load", f"{tmp}/cp2")
    return pretrain(parse_args(argv)).losses


@pytest.mark.slow
def test_context_parallel_resume_and_generate(tmp_path: Path) -> None:
    """Save at CP 2 (iteration 3 of 6); resume at CP 2 (bit-identical), at CP 1 x DP 2, at CP 4 and at CP 1 on one
    rank (within 1e-5 of the CP 2 run); generate from the CP 2 checkpoint at CP = 1: the same greedy tokens and
    logits as from the same 3 steps trained at CP 1."""
    from megatron.text_generation.generation import TextGenerator
    from megatron.text_generation.sampling import SamplingParams

    r = run_distributed(_train_and_save, 2, str(tmp_path), init_process_group=False, timeout=900)[0]
    assert r["resumed"] == r["full"][3:], r
    others = {"cp1 dp2": r["cp1 dp2"]}
    others["cp4"] = run_distributed(
        _resume_at, 4, str(tmp_path), 4, init_process_group=False, timeout=900
    )[0]
    others["cp1"] = run_distributed(
        _resume_at, 1, str(tmp_path), 1, init_process_group=False, timeout=900
    )[0]
    for name, losses in others.items():
        assert (
            len(losses) == 3 and max(abs(a - b) / b for a, b in zip(losses, r["full"][3:])) < RTOL
        ), (name, r)
    tokens = {}
    for name in ("cp2", "cp1"):
        gen = TextGenerator.from_checkpoint(tmp_path / name, device="cpu")
        out = gen.generate(
            "",
            max_new_tokens=8,
            params=SamplingParams(greedy=True),
            generator=torch.Generator(),
            stop_at_eod=False,
            return_log_probs=True,
        )
        tokens[name] = out
    assert tokens["cp2"].tokens == tokens["cp1"].tokens and len(tokens["cp2"].tokens) == 8
    torch.testing.assert_close(
        torch.tensor(tokens["cp2"].log_probs),
        torch.tensor(tokens["cp1"].log_probs),
        rtol=1e-4,
        atol=1e-5,
    )
