"""DeepSpeed-Ulysses (``--ds-sequence-parallel-size N``): layout parity against N = 1, flag validation, rank grid.

Parity: the same flags, seed, data and global batch as ``test_train_parity.py`` (4 layers, width 64, seq 32,
dropout 0, fp32, 20 iterations, global batch 8); every run is ``megatron.training.pretrain(cfg)`` on spawned gloo
ranks with the real DeepSpeed engine, and the per-iteration LM loss must be within 1e-5 relative of the N = 1 run.
With Ulysses only the order of reductions changes (the loss sum and token count over the group, the gradients
summed over it by DeepSpeed), about 1e-7 in fp32 here.

Default run (about 45 s): the two N = 1 baselines, then on 4 ranks LLaMA-GQA at N = 2 x TP 2 under ZeRO-3 (the
path that needs ``megatron/training/ulysses.py``). The matrix (N in {2, 4} x {DP 2, TP 2, ZeRO-3} x both presets,
recomputation, the reference attention path, --force-ds-sequence-parallel) and a save/resume case are ``-m slow``.
"""

from __future__ import annotations

import pytest

from megatron import mpu
from megatron.config import parse_args, validate
from megatron.testing import run_distributed
from tests.training.test_train_parity import _argv, _layouts, _max_rel

RTOL = 1e-5
SP = "--ds-sequence-parallel-size"


@pytest.fixture(scope="module")
def baselines() -> dict[str, list[float]]:
    gpt2, llama = _layouts(1, [_argv("gpt2", 1, 1), _argv("llama", 1, 1)])
    # It learns, or parity would be vacuous.
    assert gpt2[-1] < gpt2[0] - 0.05 and llama[-1] < llama[0] - 0.05
    return {"gpt2": gpt2, "llama": llama}


def _check(runs: dict[str, list[float]], baselines: dict[str, list[float]]) -> dict[str, float]:
    diffs = {name: _max_rel(losses, baselines[name.split()[0]]) for name, losses in runs.items()}
    assert all(d < RTOL for d in diffs.values()), diffs
    return diffs


def test_ulysses_parity_default(baselines: dict[str, list[float]]) -> None:
    """LLaMA-GQA (8 heads, 4 K/V groups) at Ulysses N = 2 under ZeRO-3 on 2 ranks (with TP and DP: the slow
    matrix)."""
    (run,) = _layouts(2, [_argv("llama", 1, 1, SP, "2", "--zero-stage", "3")])
    print(_check({"llama sp2 zero3": run}, baselines))


MATRIX = [
    # (name, world, tp, extra flags)
    ("gpt2 sp2", 2, 1, [SP, "2"]),
    ("gpt2 sp2 zero3", 2, 1, [SP, "2", "--zero-stage", "3"]),
    ("gpt2 sp2 dp2 zero1", 4, 1, [SP, "2", "--zero-stage", "1"]),
    ("gpt2 sp2 dp2 zero2", 4, 1, [SP, "2", "--zero-stage", "2"]),
    ("gpt2 sp2 tp2", 4, 2, [SP, "2"]),
    ("gpt2 sp4", 4, 1, [SP, "4"]),
    ("gpt2 sp4 zero3", 4, 1, [SP, "4", "--zero-stage", "3"]),
    ("gpt2 sp4 dp2", 8, 1, [SP, "4"]),
    ("gpt2 sp2 tp2 dp2 zero1", 8, 2, [SP, "2", "--zero-stage", "1"]),
    ("gpt2 sp2 tp2 dp2 zero3", 8, 2, [SP, "2", "--zero-stage", "3"]),
    ("llama sp2", 2, 1, [SP, "2"]),
    ("llama sp2 dp2 zero3", 4, 1, [SP, "2", "--zero-stage", "3"]),
    ("llama sp4 zero1", 4, 1, [SP, "4", "--zero-stage", "1"]),
    ("llama sp4 dp2 zero3", 8, 1, [SP, "4", "--zero-stage", "3"]),
    ("llama sp2 tp2 dp2", 8, 2, [SP, "2"]),
    ("gpt2 sp2 force", 2, 1, [SP, "2", "--force-ds-sequence-parallel"]),
    ("gpt2 sp1 force", 1, 1, ["--force-ds-sequence-parallel"]),
    ("gpt2 sp2 recompute-selective", 2, 1, [SP, "2", "--recompute-activations"]),
    ("gpt2 sp2 recompute-full", 2, 1, [SP, "2", "--recompute-granularity", "full"]),
    ("llama sp2 no-flash", 2, 1, [SP, "2", "--no-flash-attn"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_ulysses_parity_matrix(baselines: dict[str, list[float]], world: int) -> None:
    cases = [(n, tp, extra) for n, w, tp, extra in MATRIX if w == world]
    runs = _layouts(world, [_argv(n.split()[0], tp, 1, *extra) for n, tp, extra in cases])
    print(_check({n: r for (n, _, _), r in zip(cases, runs)}, baselines))


def _resume_scenario(tmp: str) -> dict[str, list[float]]:
    from megatron.config import parse_args
    from megatron.training import pretrain

    ck = f"{tmp}/ckpt"
    sp2 = _argv("gpt2", 1, 1, SP, "2", "--zero-stage", "1")
    full = pretrain(parse_args([*sp2, "--train-iters", "6"])).losses
    pretrain(parse_args([*sp2, "--train-iters", "3", "--save", ck]))
    resumed = pretrain(parse_args([*sp2, "--train-iters", "6", "--load", ck])).losses
    # The same checkpoint at SP 1 x DP 2: ZeRO shards over DP x SP, so its optimizer files fit as they are.
    dp2 = _argv("gpt2", 1, 1, "--zero-stage", "1", "--train-iters", "6", "--load", ck)
    return {"full": full, "resumed": resumed, "dp2": pretrain(parse_args(dp2)).losses}


def _universal_resume(tmp: str) -> dict[str, list[float]]:
    from megatron.config import parse_args
    from megatron.training import pretrain

    ck = f"{tmp}/ckpt"
    out = {}
    for name, tp, pp, extra in [("tp2", 2, 1, []), ("pp2", 1, 2, []), ("sp2 tp1", 1, 1, [SP, "2"])]:
        argv = _argv("gpt2", tp, pp, *extra, "--zero-stage", "1", "--train-iters", "6")
        out[name] = pretrain(parse_args([*argv, "--load", ck, "--universal-checkpoint"])).losses
    return out


@pytest.mark.slow
def test_ulysses_resume(tmp_path) -> None:
    """SP 2 ZeRO-1: save at iteration 3, resume to 6 (bit-identical), and resume the same files at SP 1 x DP 2;
    then through a universal checkpoint at TP 2, at PP 2 and at SP 2 again."""
    from tools.checkpoint import to_universal

    ranks = run_distributed(
        _resume_scenario, 2, str(tmp_path), init_process_group=False, timeout=600
    )
    r = ranks[0]
    assert r["resumed"] == r["full"][3:], r
    assert max(abs(a - b) / b for a, b in zip(r["dp2"], r["full"][3:])) < RTOL, r
    assert to_universal.main(["--load", str(tmp_path / "ckpt"), "--tag", "global_step3"]) == 0
    universal = run_distributed(
        _universal_resume, 2, str(tmp_path), init_process_group=False, timeout=600
    )[0]
    for name, losses in universal.items():
        assert len(losses) == 3, (name, losses)
        assert max(abs(a - b) / b for a, b in zip(losses, r["full"][3:])) < 1e-4, (name, losses, r)


# ---------------------------------------------------------------- validation (no process group)

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "1", "--train-iters", "2", "--mock-data",
]  # fmt: skip


def _validate(*extra: str, world: int = 4) -> None:
    validate(parse_args([*BASE, *extra]), world_size=world)


def test_valid_layouts_pass() -> None:
    _validate(SP, "4")
    _validate(SP, "2", "--tensor-model-parallel-size", "2")
    _validate(SP, "2", "--num-key-value-heads", "2", world=8)
    cfg = parse_args([*BASE, SP, "2"])
    assert cfg.parallel.ds_sequence_parallel_size == 2 and cfg.parallel.data_parallel_size(8) == 4


@pytest.mark.parametrize(
    ("extra", "world", "match"),
    [
        (
            [SP, "3", "--num-attention-heads", "6", "--hidden-size", "60"],
            3,
            r"--seq-length \(32\) must be divisible by --ds-sequence-parallel-size \(3\).*multiple of 3",
        ),
        (
            [SP, "4", "--num-attention-heads", "2"],
            4,
            r"--num-attention-heads \(2\) must be divisible by --tensor-model-parallel-size \(1\) x "
            r"--ds-sequence-parallel-size \(4\) = 4.*use --ds-sequence-parallel-size 1 or 2",
        ),
        (
            [SP, "4", "--num-key-value-heads", "2"],
            4,
            r"--num-key-value-heads \(2\) must be divisible by .* = 4.*key/value heads \(2\)",
        ),
        (
            [SP, "2", "--tensor-model-parallel-size", "2", "--num-key-value-heads", "2"],
            4,
            r"--num-key-value-heads \(2\) must be divisible by --tensor-model-parallel-size \(2\) x "
            r"--ds-sequence-parallel-size \(2\) = 4",
        ),
        (
            [SP, "4"],
            6,
            r"world size \(6\) must be divisible by .*--ds-sequence-parallel-size \(4\) = 4",
        ),
        (
            [SP, "2", "--pipeline-model-parallel-size", "2"],
            4,
            r"--ds-sequence-parallel-size 2 with --pipeline-model-parallel-size 2 is not supported",
        ),
        (
            [SP, "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
            4,
            r"--ds-sequence-parallel-size 2 .* and --sequence-parallel .* are exclusive",
        ),
        ([SP, "0"], 4, r"--ds-sequence-parallel-size \(0\) must be a positive integer"),
    ],
)
def test_refused_layouts(extra: list[str], world: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _validate(*extra, world=world)


def test_fpdt_still_refused() -> None:
    with pytest.raises(ValueError, match=r"--ds-sequence-parallel-fpdt is refused: FPDT"):
        parse_args([*BASE, SP, "2", "--ds-sequence-parallel-fpdt"])


def test_rank_grid_with_ulysses() -> None:
    """The worked example of ``parallel_state``'s docstring: W 8, TP 2, SP 2 (DP 2)."""
    g = mpu.rank_grid(8, 2, 1, ds_sequence_parallel_size=2)
    assert g.tensor_model_parallel == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.sequence_parallel == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.data_parallel == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.sequence_data_parallel == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g.model_parallel == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.data_parallel_size == 2 and g.sequence_parallel_size == 2
    plain = mpu.rank_grid(16, 2, 4)  # at SP 1: one rank per SP group, sequence-data = data
    assert plain.sequence_parallel == [[r] for r in range(16)]
    assert plain.sequence_data_parallel == plain.data_parallel
    with pytest.raises(
        ValueError, match=r"--ds-sequence-parallel-size 3.*tensor x pipeline x sequence = 6"
    ):
        mpu.rank_grid(8, 2, 1, ds_sequence_parallel_size=3)
