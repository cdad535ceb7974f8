"""An MoE checkpoint resumes at another expert-parallel (and data-parallel) size: ``--load`` of an fp32 ZeRO-0
DeepSpeed-MoE checkpoint converts it on the way in (``megatron/checkpointing/relayout_moe.py``): the weights load
by global expert id, each rank's optimizer state is rebuilt by parameter name from the saved EP ranks' files.

Slow (the acceptance of issue #34): a tiny LLaMA-MoE (4 experts in each of 2 layers, top-2, no token dropping,
dropout 0; the MoE parity flags of ``tests/training/test_moe_train.py``) trained 4 iterations, saved at 2. EP 2 x
DP 2 -> EP 1 on one rank and on two (DP 2), and EP 1 -> EP 2: the next losses (LM + MoE) against the run trained
from the start at the new layout; the EP 2 and EP 1 runs agree first (what makes the comparison meaningful), and a
resume with a fresh optimizer state (--no-load-optim) is shown to miss (the check can fail). Default suite: the
name mapping on real torch AdamW states, the rules' rows, a missing file (no process group).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
import torch

from megatron.config import ModelConfig
from megatron.config.moe import MoEConfig
from megatron.testing import run_distributed
from tests.training.test_moe_train import _argv as moe_argv

SAVED_AT = 2
ITERS = 4
TOL = 1e-5
TAG = f"global_step{SAVED_AT}"

CFG = ModelConfig(
    num_layers=2, hidden_size=4, num_attention_heads=1, seq_length=8, vocab_size=16, ffn_hidden_size=6,
    moe=MoEConfig(num_experts=(4,), expert_interval=1),
)  # fmt: skip
LAYER = "language_model.encoder.layers.{}."
EXPERT = LAYER + "mlp.deepspeed_moe.experts.deepspeed_experts.{}.{}"


def _model_names(ep: int, ep_rank: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(local name, global name, shape) of a model's parameters on EP rank ``ep_rank`` of ``ep``, in model order."""
    out = [("language_model.embedding.word_embeddings.weight",) * 2 + ((16, 4),)]
    for i in range(2):
        out.append(((LAYER + "input_norm.weight").format(i),) * 2 + ((4,),))
        out.append(((LAYER + "mlp.deepspeed_moe.gate.wg.weight").format(i),) * 2 + ((4, 4),))
        local = 4 // ep
        for j in range(local):
            for linear, shape in (
                ("dense_h_to_4h.weight", (6, 4)),
                ("dense_4h_to_h.weight", (4, 6)),
            ):
                g = ep_rank * local + j
                out.append((EXPERT.format(i, j, linear), EXPERT.format(i, g, linear), shape))
    out.append(("language_model.encoder.final_norm.weight",) * 2 + ((4,),))
    return out


def _trained(ep: int, ep_rank: int, steps: int) -> tuple[torch.optim.AdamW, list[list[str]], dict]:
    """AdamW over the model's parameters in two groups (matrices, vectors), ``steps`` steps with gradients that
    depend on the global name only; (optimizer, its groups as global names, global name -> parameter)."""
    names = _model_names(ep, ep_rank)
    params = {}
    for _, global_name, shape in names:
        gen = torch.Generator().manual_seed(
            int(hashlib.sha256(global_name.encode()).hexdigest()[:8], 16)
        )
        params[global_name] = torch.nn.Parameter(torch.randn(shape, generator=gen))
    groups = [
        [n for n in params if params[n].dim() == 2],
        [n for n in params if params[n].dim() == 1],
    ]
    opt = torch.optim.AdamW(
        [
            {"params": [params[n] for n in g], "weight_decay": wd}
            for g, wd in zip(groups, (0.01, 0.0))
        ],
        lr=1e-2,
    )
    for step in range(steps):
        for n, p in params.items():
            seed = int(hashlib.sha256(f"{step} {n}".encode()).hexdigest()[:8], 16)
            gen = torch.Generator().manual_seed(seed)
            p.grad = torch.randn(p.shape, generator=gen) + p.detach()
        opt.step()
    return opt, groups, params


def test_optimizer_state_follows_the_experts_by_name(tmp_path: Path) -> None:
    """EP 2 -> EP 1 and EP 1 -> EP 2 (rank 1): every parameter's Adam state is the one the same parameter had at
    the saved size, bit for bit; the saved order is derived from the run's groups (expert_order_at); a file of
    another EP size or other groups is refused with a line naming it."""
    from megatron.checkpointing.relayout_moe import (
        read_saved_optimizers,
        rebuilt_optimizer_state,
        saved_states_by_name,
    )
    from megatron.layout.experts import expert_order_at

    ep1 = _trained(1, 0, 2)
    ep2 = [_trained(2, r, 2) for r in range(2)]
    for r, (_, groups, _) in enumerate(ep2):  # the saved order, derived from the EP 1 run's groups
        assert [expert_order_at(g, CFG, ep=2, ep_rank=r) for g in ep1[1]] == groups

    def converted(saved: list[dict], ep: int, ep_rank: int) -> tuple[torch.optim.AdamW, dict]:
        fresh, groups, params = _trained(ep, ep_rank, 0)
        by_name = saved_states_by_name(saved, groups, CFG, tmp_path)
        shapes = {n: p.shape for n, p in params.items()}
        fresh.load_state_dict(rebuilt_optimizer_state(fresh.state_dict(), groups, by_name, shapes))
        return fresh, params

    for saved, (ep, ep_rank), want in (
        ([o.state_dict() for o, _, _ in ep2], (1, 0), ep1),
        ([ep1[0].state_dict()], (2, 1), ep2[1]),
    ):
        fresh, params = converted(saved, ep, ep_rank)
        assert len(fresh.state) == len(params) == len(want[2])
        for name, p in params.items():
            got, ref = fresh.state[p], want[0].state[want[2][name]]
            assert set(got) == set(ref) == {"step", "exp_avg", "exp_avg_sq"}, name
            assert all(torch.equal(got[k], ref[k]) for k in got), name

    one_rank = [ep2[0][0].state_dict()]  # EP rank 0's file taken for a whole EP 1 checkpoint
    with pytest.raises(
        ValueError, match="group 0 of EP rank 0 .* holds 11 parameters; the model at .* has 19"
    ):
        saved_states_by_name(one_rank, ep1[1], CFG, tmp_path)
    with pytest.raises(ValueError, match="holds 2 parameter groups; this run has 1"):
        saved_states_by_name(one_rank, ep1[1][:1], CFG, tmp_path)
    with pytest.raises(
        FileNotFoundError, match="expp_rank_1_mp_rank_00_optim_states.pt is missing"
    ):
        torch.save(
            {"optimizer": ep1[0].state_dict()}, tmp_path / "expp_rank_0_mp_rank_00_optim_states.pt"
        )
        read_saved_optimizers(tmp_path, 2, 0)


def test_zero_partitions_join_by_name() -> None:
    """ZeRO-1/2 files of EP 2 x DP 2: a dense parameter split over both DP ranks' partitions joins in DP-rank
    order; each rank's (unpartitioned: expert-DP size 1) local expert 0 is global expert 0 or 2."""
    from deepspeed.utils.tensor_fragment import fragment_address

    from megatron.checkpointing.relayout_moe import zero_states_by_name

    dense, x0 = (
        "language_model.embedding.word_embeddings.weight",
        EXPERT.format(0, 0, "dense_h_to_4h.weight"),
    )

    def partition(d: int) -> dict[str, object]:
        flat = [torch.arange(4.0) + 10 * d, torch.arange(3.0) + 100 * d]  # [dense piece, expert 0]
        state = {
            g: {"step": torch.tensor(2.0), "exp_avg": t, "exp_avg_sq": 2 * t}
            for g, t in enumerate(flat)
        }
        groups = [{"params": [g]} for g in range(2)]
        own = (
            4 if d == 0 else 2
        )  # the dense parameter has 6 elements: 4 in rank 0's partition, 2 in rank 1's
        return {
            "base_optimizer_state": {"state": state, "param_groups": groups},
            "param_slice_mappings": [
                {dense: fragment_address(numel=own, start=0)},
                {x0: fragment_address(numel=3, start=0)},
            ],
        }

    full, step = zero_states_by_name([partition(0), partition(1)], CFG, saved_ep=2)
    assert sorted(full) == sorted([dense, x0, EXPERT.format(0, 2, "dense_h_to_4h.weight")])
    assert full[dense]["exp_avg"].tolist() == [0, 1, 2, 3, 10, 11]
    assert full[dense]["exp_avg_sq"].tolist() == [0, 2, 4, 6, 20, 22]
    assert full[EXPERT.format(0, 2, "dense_h_to_4h.weight")]["exp_avg"].tolist() == [100, 101, 102]
    assert float(step) == 2.0


_BASE: dict[str, object] = {
    "load_dir": "ck", "tag": "global_step2", "saved_tp": 1, "saved_pp": 1, "saved_dp": 2, "saved_stage": 0,
    "saved_precision": "fp32", "run_tp": 1, "run_pp": 1, "run_dp": 2, "run_stage": 0, "requested_stage": 0,
    "run_precision": "fp32", "weights_only": False, "optimizer_state": True, "saved_ep": 2, "run_ep": 1,
}  # fmt: skip
CONVERTS = [
    # (change from EP 2 x DP 2 -> EP 1 x DP 2 at fp32 ZeRO-0, converted on load?, the error otherwise)
    ({}, True, None),
    ({"run_dp": 1}, True, None),
    ({"saved_ep": 1, "run_ep": 2}, True, None),
    ({"run_ep": 2}, False, None),  # same EP: a regular load
    ({"run_ep": 2, "run_dp": 4}, False, None),  # ZeRO-0 at another DP: a regular load
    ({"optimizer_state": False}, False, None),  # --no-load-optim: weights by global expert id
    ({"saved_stage": 1, "run_stage": 1, "requested_stage": 1}, True, None),
    ({"saved_stage": 1, "run_stage": 2, "requested_stage": 2, "run_dp": 1}, True, None),
    (
        {"saved_stage": 2, "run_stage": 1, "requested_stage": 1, "run_ep": 2, "run_dp": 4},
        True,
        None,
    ),
    ({"saved_stage": 1, "run_stage": 1, "requested_stage": 1, "run_ep": 2}, False, None),  # same
    ({"run_stage": 1}, False, "stores differently"),
    ({"run_precision": "bf16", "saved_precision": "bf16"}, False, "bf16/fp16 optimizers"),
    ({"run_tp": 2, "run_dp": 1}, False, "converted on load only in fp32 at TP = PP = 1"),
    (
        {"saved_tp": 2, "run_tp": 2, "saved_dp": 1, "run_dp": 1},
        False,
        "span the tensor-parallel ranks",
    ),
    ({"saved_pp": 2, "run_pp": 2, "saved_dp": 1, "run_dp": 1}, False, "PP = 1"),
]


@pytest.mark.parametrize("change,converts,error", CONVERTS)
def test_which_moe_loads_convert(
    change: dict[str, object], converts: bool, error: str | None
) -> None:
    from megatron.checkpointing.rules import (
        ResumeCase,
        check_resume_compatibility,
        converts_on_load,
    )

    case = ResumeCase(**{**_BASE, **change})  # type: ignore[arg-type]
    assert converts_on_load(case) is converts
    if error is None:
        check_resume_compatibility(case)
    else:
        with pytest.raises(ValueError, match=error):
            check_resume_compatibility(case)


# --- slow: the acceptance runs ------------------------------------------------------------------------------------


def _argv(ep: int, *extra: str) -> list[str]:
    return moe_argv(2, ep=ep, extra=("--train-iters", str(ITERS), *extra))


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run(argv: list[str]) -> list[float]:
    """``pretrain`` on this rank: the per-iteration LM + MoE loss."""
    from megatron.config import parse_args
    from megatron.training import pretrain

    result = pretrain(parse_args(argv))
    assert result.exit_code == 0 and result.iteration == ITERS, result
    return [lm + moe for lm, moe in zip(result.losses, result.moe_losses, strict=True)]


def _resumed(ck: str, argv: list[str]) -> dict[str, object]:
    """The next losses of ``argv`` loading ``ck`` at SAVED_AT; the conversion's log lines; the source intact."""
    lines = _Lines()
    logger = logging.getLogger("megatron.checkpointing.relayout_moe")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    before = _tree_digest(Path(ck))
    losses = _run([*argv, "--load", ck, "--load-tag", TAG])
    logger.removeHandler(lines)
    return {
        "losses": losses,
        "log": [line for line in lines.lines if "convert" in line],
        "source_unchanged": before == _tree_digest(Path(ck)),
    }


def _two_ranks(tmp: str) -> dict[str, object]:
    """EP 2 x DP 2 and EP 1 x DP 2 from the start (each saving at SAVED_AT), then each resumed at the other."""
    save = ["--save-interval", str(SAVED_AT), "--save"]
    return {
        "ep2": _run(_argv(2, *save, f"{tmp}/ep2")),
        "ep1": _run(_argv(1, *save, f"{tmp}/ep1")),
        "ep2 -> ep1": _resumed(f"{tmp}/ep2", _argv(1)),
        "ep1 -> ep2": _resumed(f"{tmp}/ep1", _argv(2)),
    }


def _one_rank(tmp: str) -> dict[str, object]:
    """EP 1 on one rank from the start; the EP 2 x DP 2 checkpoint resumed there, with and without its
    optimizer state."""
    return {
        "ep1": _run(_argv(1)),
        "ep2 -> ep1": _resumed(f"{tmp}/ep2", _argv(1)),
        "fresh optimizer": _run(
            _argv(1, "--no-load-optim", "--load", f"{tmp}/ep2", "--load-tag", TAG)
        ),
    }


def _worst(resumed: object, straight: object) -> float:
    a = resumed["losses"]  # type: ignore[index]
    b = straight[SAVED_AT:]  # type: ignore[index]
    assert len(a) == len(b) == ITERS - SAVED_AT, (a, b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_moe_checkpoint_resumes_at_another_expert_parallel_size(tmp_path: Path) -> None:
    """EP 2 x DP 2 -> EP 1 (one rank; two ranks, DP 2) and EP 1 x DP 2 -> EP 2 x DP 2: the next losses within
    1e-5 of the run trained at the new layout from the start; the log names both layouts and the time; the source
    checkpoint unchanged."""
    two = run_distributed(_two_ranks, 2, str(tmp_path), init_process_group=False, timeout=900)[0]
    one = run_distributed(_one_rank, 1, str(tmp_path), init_process_group=False, timeout=900)[0]
    parity = max(abs(x - y) for x, y in zip(two["ep2"], one["ep1"], strict=True))
    worst = {
        "EP2 DP2 -> EP1 DP1": _worst(one["ep2 -> ep1"], one["ep1"]),
        "EP2 DP2 -> EP1 DP2": _worst(two["ep2 -> ep1"], two["ep1"]),
        "EP1 DP2 -> EP2 DP2": _worst(two["ep1 -> ep2"], two["ep2"]),
    }
    fresh = _worst({"losses": one["fresh optimizer"]}, one["ep1"])
    print(
        f"EP 2 vs EP 1 from the start: {parity:.3g}; resumed: {worst}; fresh optimizer: {fresh:.3g}"
    )
    for result in (one["ep2 -> ep1"], two["ep2 -> ep1"], two["ep1 -> ep2"]):
        print(*result["log"], sep="\n")
        assert result["source_unchanged"], result
        assert any("converted checkpoint" in line and " s (" in line for line in result["log"]), (
            result
        )
    assert parity <= TOL and max(worst.values()) <= TOL, (parity, worst)
    assert fresh > 100 * TOL, fresh  # the optimizer state matters: a wrong one would be seen
    assert "from EP2 TP1 PP1 DP2 ZeRO-0 to EP1 TP1 PP1 DP1 ZeRO-0" in one["ep2 -> ep1"]["log"][0]


Z1 = ("--zero-stage", "1", "--create-moe-param-group")
Z2 = ("--zero-stage", "2", "--create-moe-param-group")


def _zero_two_ranks(tmp: str) -> dict[str, object]:
    """ZeRO-1: EP 2 x DP 2 saving at SAVED_AT, EP 1 x DP 2 from the start; the EP 2 checkpoint resumed at EP 1
    with ZeRO-1 and with ZeRO-2."""
    save = ["--save-interval", str(SAVED_AT), "--save", f"{tmp}/z-ep2"]
    return {
        "ep2": _run(_argv(2, *Z1, *save)),
        "ep1": _run(_argv(1, *Z1)),
        "ep2 -> ep1": _resumed(f"{tmp}/z-ep2", _argv(1, *Z1)),
        "ep2 -> ep1 zero2": _resumed(f"{tmp}/z-ep2", _argv(1, *Z2)),
    }


def _zero_one_rank(tmp: str) -> dict[str, object]:
    """ZeRO-1: EP 1 on one rank from the start; the EP 2 x DP 2 checkpoint resumed there."""
    return {"ep1": _run(_argv(1, *Z1)), "ep2 -> ep1": _resumed(f"{tmp}/z-ep2", _argv(1, *Z1))}


@pytest.mark.slow
def test_zero1_moe_checkpoint_resumes_at_another_expert_and_data_parallel_size(
    tmp_path: Path,
) -> None:
    """ZeRO-1 (--create-moe-param-group): EP 2 x DP 2 -> EP 1 x DP 2 (ZeRO-1 and ZeRO-2) and EP 1 x DP 1: the
    next losses within 1e-5 of the run trained at the new layout from the start."""
    two = run_distributed(_zero_two_ranks, 2, str(tmp_path), init_process_group=False, timeout=900)[
        0
    ]
    one = run_distributed(_zero_one_rank, 1, str(tmp_path), init_process_group=False, timeout=900)[
        0
    ]
    parity = max(abs(x - y) for x, y in zip(two["ep2"], one["ep1"], strict=True))
    worst = {
        "EP2 DP2 -> EP1 DP1": _worst(one["ep2 -> ep1"], one["ep1"]),
        "EP2 DP2 -> EP1 DP2": _worst(two["ep2 -> ep1"], two["ep1"]),
        "EP2 DP2 -> EP1 DP2 ZeRO-2": _worst(two["ep2 -> ep1 zero2"], two["ep1"]),
    }
    print(f"ZeRO-1: EP 2 vs EP 1 from the start {parity:.3g}; resumed: {worst}")
    for result in (one["ep2 -> ep1"], two["ep2 -> ep1"], two["ep2 -> ep1 zero2"]):
        print(*result["log"], sep="\n")
        assert result["source_unchanged"], result
    assert parity <= TOL and max(worst.values()) <= TOL, (parity, worst)
    assert "from EP2 TP1 PP1 DP2 ZeRO-1 to EP1 TP1 PP1 DP1 ZeRO-1" in one["ep2 -> ep1"]["log"][0]
