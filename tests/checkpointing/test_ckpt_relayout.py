"""Resume at a new layout in one step: ``--load`` of a regular checkpoint saved at another TP / PP / DP size or ZeRO
stage converts it on the way in (``megatron/checkpointing/relayout.py``): the next losses match the run continuing
at its old layout and the offline universal-checkpoint path (``tools/checkpoint/to_universal`` +
``--universal-checkpoint``); the conversion is logged; the source checkpoint is unchanged and the temporary copy
gone.

Default suite: one process, ZeRO-1 -> ZeRO-3 (a relayout at world size 1). Slow: the acceptance matrix of issue #34,
TP2 x PP2 (ZeRO-1) -> TP1 x PP2 x DP2 on 4 ranks, and ZeRO-1 -> ZeRO-3 at DP 2. Dropout is 0: a conversion starts
fresh RNG states where the layout changes (as the universal path does), and the runs compare fp32 losses that
differ only in reduction order.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
from test_ckpt_resume import TINY

from megatron.testing import run_distributed

SAVED_AT = 2
ITERS = 4
TOL = 1e-5

FLAGS = [
    *TINY, "--train-iters", str(ITERS), "--attention-dropout", "0", "--hidden-dropout", "0",
    "--eval-interval", "100",
]  # fmt: skip
TAG = f"global_step{SAVED_AT}"


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


def _reference(ck: str, layout: list[str]) -> list[float]:
    """The run at its old layout, saving at SAVED_AT and going on to ITERS: the losses a resume must repeat."""
    from megatron.config import parse_args
    from megatron.training import pretrain

    argv = [*FLAGS, *layout, "--save", ck, "--save-interval", str(SAVED_AT)]
    return pretrain(parse_args(argv)).losses[SAVED_AT:]


def _converted(ck: str, layout: list[str], universal_tag: str | None) -> dict[str, object]:
    """The next losses at ``layout``: converted on load (no flag), and (``universal_tag``) through the offline
    universal checkpoint."""
    from megatron.config import parse_args
    from megatron.training import pretrain

    lines = _Lines()
    logger = logging.getLogger("megatron.checkpointing.engine")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    before = _tree_digest(Path(ck) / TAG)
    converted = pretrain(parse_args([*FLAGS, *layout, "--load", ck, "--load-tag", TAG]))
    out: dict[str, object] = {
        "converted": (converted.iteration, converted.losses),
        "source_unchanged": before == _tree_digest(Path(ck) / TAG),
        "leftovers": sorted(p.name for p in Path(ck).glob(".relayout-*")),
        "log": [line for line in lines.lines if "convert" in line],
    }
    if universal_tag is not None:
        uni = [*FLAGS, *layout, "--load", ck, "--universal-checkpoint", "--load-tag", universal_tag]
        universal = pretrain(parse_args(uni))
        out["universal"] = (universal.iteration, universal.losses)
    return out


def _worst(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == ITERS - SAVED_AT, (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def _check(
    result: dict[str, object], reference: list[float], saved: str, run: str
) -> dict[str, float]:
    it, losses = result["converted"]  # type: ignore[misc]
    assert it == ITERS, result
    worst = {"reference": _worst(losses, reference)}
    if "universal" in result:
        it_u, uni = result["universal"]  # type: ignore[misc]
        assert it_u == ITERS
        worst["universal"] = _worst(losses, uni)
    assert max(worst.values()) <= TOL, (worst, result, reference)
    assert result["source_unchanged"] and result["leftovers"] == [], result
    log = result["log"]
    print(*log, sep="\n")  # type: ignore[misc]
    assert any(f"from {saved} to {run}" in line and "source unchanged" in line for line in log), log  # type: ignore[attr-defined]
    return worst


def _one_rank(ck: str) -> tuple[list[float], dict[str, object]]:
    ref = _reference(ck, ["--zero-stage", "1"])
    return ref, _converted(ck, ["--zero-stage", "3"], None)


@pytest.mark.slow
def test_load_converts_zero1_to_zero3_on_one_rank(tmp_path: Path) -> None:
    ref, result = run_distributed(_one_rank, 1, str(tmp_path / "ck"), init_process_group=False)[0]
    worst = _check(result, ref, "TP1 PP1 DP1 ZeRO-1", "TP1 PP1 DP1 ZeRO-3")
    print(f"ZeRO-1 -> ZeRO-3 (1 rank): worst |loss difference| {worst}")


def _offline_universal(ck: str) -> str:
    from tools.checkpoint import to_universal

    assert to_universal.main(["--load", ck, "--tag", TAG]) == 0
    return f"{TAG}_universal"


def _matrix_case(
    tmp_path: Path,
    world: int,
    saved: list[str],
    run: list[str],
    words: tuple[str, str],
    *,
    universal: bool = True,
) -> dict[str, float]:
    """``universal``: compare with the offline universal path too (not into ZeRO-3: DeepSpeed's ZeRO-3 universal
    loader lacks the repairs the on-load path makes, see docs/checkpoints.md)."""
    ck = str(tmp_path / "ck")
    ref = run_distributed(_reference, world, ck, saved, init_process_group=False, timeout=600)[0]
    tag = _offline_universal(ck) if universal else None
    result = run_distributed(_converted, world, ck, run, tag, init_process_group=False, timeout=900)
    return _check(result[0], ref, *words)


@pytest.mark.slow
def test_load_converts_tp2pp2_to_tp1pp2dp2(tmp_path: Path) -> None:
    saved = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    run = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]
    words = ("TP2 PP2 DP1 ZeRO-1", "TP1 PP2 DP2 ZeRO-1")
    worst = _matrix_case(
        tmp_path, 4, [*saved, "--zero-stage", "1"], [*run, "--zero-stage", "1"], words
    )
    print(f"TP2 x PP2 -> TP1 x PP2 x DP2: worst |loss difference| {worst}")


@pytest.mark.slow
def test_load_converts_zero1_to_zero3_at_dp2(tmp_path: Path) -> None:
    words = ("TP1 PP1 DP2 ZeRO-1", "TP1 PP1 DP2 ZeRO-3")
    worst = _matrix_case(
        tmp_path, 2, ["--zero-stage", "1"], ["--zero-stage", "3"], words, universal=False
    )
    print(f"ZeRO-1 -> ZeRO-3 (DP 2): worst |loss difference| {worst}")


# --- default suite: which loads convert, and the repairs of the universal form (no process group) -----------------

_BASE: dict[str, object] = {
    "load_dir": "ck", "tag": "global_step2", "saved_tp": 1, "saved_pp": 1, "saved_dp": 2, "saved_stage": 1,
    "saved_precision": "fp32", "run_tp": 1, "run_pp": 1, "run_dp": 2, "run_stage": 1, "requested_stage": 1,
    "run_precision": "fp32", "weights_only": False, "optimizer_state": True,
}  # fmt: skip
CONVERTS = [
    # (change from the checkpoint's layout, converted on load?, the error otherwise or after it)
    ({}, False, None),  # same layout: a regular load
    ({"run_tp": 2, "run_dp": 1}, True, None),
    ({"run_pp": 2, "run_dp": 1}, True, None),
    ({"run_dp": 4}, True, None),
    ({"run_stage": 3, "requested_stage": 3}, True, None),
    (
        {"saved_stage": 3, "run_stage": 2, "requested_stage": 2},
        False,
        "DeepSpeed keeps ZeRO-3's weights",
    ),
    (
        {"saved_stage": 3, "run_stage": 3, "run_dp": 4},
        False,
        "saved with ZeRO-3, which is not converted",
    ),
    (
        {"run_tp": 2, "run_dp": 1, "run_stage": 3},
        False,
        "ZeRO-3 universal loader reads no TP slices",
    ),
    (
        {"run_tp": 2, "run_dp": 1, "saved_stage": 0},
        False,
        "saved with ZeRO-0, which keeps no optimizer",
    ),
    ({"run_dp": 4, "optimizer_state": False}, False, None),  # --no-load-optim: ZeRO-1 reads any DP
    (
        {"run_tp": 2, "run_dp": 1, "optimizer_state": False},
        False,
        "drop --no-load-optim / --finetune",
    ),
    (
        {"run_dp": 4, "run_stage": 0, "requested_stage": 0},
        False,
        "whose optimizer state DeepSpeed stores",
    ),
    (
        {"run_dp": 4, "run_stage": 0, "run_precision": "bf16"},
        True,
        "trained in fp32; this run uses bf16",
    ),
    ({"run_dp": 4, "saved_ep": 2, "run_ep": 2}, True, None),  # MoE, by name: relayout_moe.py
    (
        {"run_tp": 2, "run_dp": 1, "saved_ep": 2, "run_ep": 2},
        False,
        "MoE checkpoint is converted on load only in fp32 at TP = PP = 1",
    ),
    (
        {"run_tp": 2, "run_dp": 1, "run_precision": "bf16"},
        True,
        "trained in fp32; this run uses bf16",
    ),
]


@pytest.mark.parametrize("change,converts,error", CONVERTS)
def test_which_loads_convert(change: dict[str, object], converts: bool, error: str | None) -> None:
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


def test_universal_form_repairs(tmp_path: Path) -> None:
    """The universal form of a ZeRO-1 checkpoint, made loadable by DeepSpeed's ZeRO-3 universal loader: both
    model-state names, the nested optimizer state with the step, vocabulary rows padded; the other parameters
    and an existing name untouched; the folder never inside the source tag."""
    import torch

    from megatron.checkpointing.relayout import (
        add_model_state_aliases,
        add_stage3_optimizer_state,
        pad_vocab_rows,
        relayout_dir,
        saved_param_groups,
    )

    out = tmp_path / "u"
    (out / "zero" / "emb").mkdir(parents=True)
    (out / "zero" / "bias").mkdir()
    torch.save({"module": {}}, out / "mp_rank_00_model_states.pt")
    torch.save({"module": {}}, out / "mp_rank_01_model_states.pt")
    torch.save({"x": 1}, out / "zero_pp_rank_0_mp_rank_01_model_states.pt")  # already there: kept
    groups = [{"weight_decay": 0.01, "params": [0]}, {"weight_decay": 0.0, "params": [1]}]
    torch.save(
        {"param_groups": groups, "ds_version": "0.19.8"}, out / "zero" / "optimizer_state.pt"
    )
    emb = torch.randn(5, 3)
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        torch.save(
            {"param": emb, "vocab_tensor": True, "cat_dim": 0}, out / "zero" / "emb" / f"{key}.pt"
        )
        torch.save(torch.ones(3), out / "zero" / "bias" / f"{key}.pt")
    torch.save(torch.tensor(2.0), out / "zero" / "emb" / "step.pt")

    assert add_model_state_aliases(out) == 1
    assert (
        out / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    ).resolve().name == "mp_rank_00_model_states.pt"
    assert torch.load(out / "zero_pp_rank_0_mp_rank_01_model_states.pt") == {"x": 1}
    assert add_stage3_optimizer_state(out) and not add_stage3_optimizer_state(out)
    state = torch.load(out / "zero" / "optimizer_state.pt")
    assert state["optimizer_state_dict"]["state"][0]["step"] == 2.0
    assert (
        state["optimizer_state_dict"]["param_groups"] == groups == saved_param_groups(tmp_path, "u")
    )
    assert pad_vocab_rows(out, 8) == 3 and pad_vocab_rows(out, 8) == 0
    padded = torch.load(out / "zero" / "emb" / "exp_avg.pt")["param"]
    assert padded.shape == (8, 3) and torch.equal(padded[:5], emb) and not padded[5:].any()
    assert torch.equal(torch.load(out / "zero" / "bias" / "fp32.pt"), torch.ones(3))
    assert relayout_dir("/s", "/l", "global_step2") == Path("/s/.relayout-global_step2")
    assert relayout_dir(None, "/l", "global_step2") == Path("/l/.relayout-global_step2")


def test_converter_sees_every_ranks_patterns(tmp_path: Path) -> None:
    """Under a pipeline each rank saved the patterns of its own parameters, and ds_to_universal reads the first
    file's: the converter is given a copy of that file with the union (the others linked, the source untouched);
    where the first file has them all it reads the tag itself."""
    import torch

    from megatron.checkpointing.relayout import converter_input

    tag = tmp_path / "global_step2"
    tag.mkdir()
    first = {
        "universal_checkpoint_info": {"tp_replicated_parameter_patterns": ["1.a"], "version": 0.2}
    }
    last = {
        "universal_checkpoint_info": {
            "tp_replicated_parameter_patterns": ["4.weight"],
            "version": 0.2,
        }
    }
    torch.save(first, tag / "mp_rank_00_model_states.pt")
    torch.save(last, tag / "mp_rank_01_model_states.pt")
    (tag / "layer_01-model_00-model_states.pt").write_bytes(b"x")
    before = _tree_digest(tag)
    scratch = tmp_path / ".input-u"
    assert converter_input(tag, scratch) == scratch
    info = torch.load(scratch / "mp_rank_00_model_states.pt")["universal_checkpoint_info"]
    assert info == {"tp_replicated_parameter_patterns": ["1.a", "4.weight"], "version": 0.2}
    assert (scratch / "layer_01-model_00-model_states.pt").resolve() == (
        tag / "layer_01-model_00-model_states.pt"
    ).resolve()
    assert _tree_digest(tag) == before
    torch.save(
        {"universal_checkpoint_info": {**info, "version": 0.2}}, tag / "mp_rank_00_model_states.pt"
    )
    assert converter_input(tag, tmp_path / ".input-v") == tag
