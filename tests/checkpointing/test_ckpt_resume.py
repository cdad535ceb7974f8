"""Training checkpoints: exact resume (dropout on, fp32, CPU), auto-resume, errors, crash safety, SIGTERM.

Every run is the real thing: ``pretrain(cfg)`` with real gloo groups and the real DeepSpeed engine, saving and
loading real files through ``DeepSpeedCheckpointer``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.model.presets import GPT2_FLAGS
from megatron.testing import run_distributed

ITERS = 6
HALF = 3

TINY = [
    *GPT2_FLAGS,
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(ITERS),
    "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234",
    "--mock-data", "--vocab-size", "299",
    "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
    "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1", "--log-level", "WARNING",
]  # fmt: skip


def _losses(path: Path) -> list[float]:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r["lm_loss"] for r in lines if "lm_loss" in r]


def _valid_losses(path: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return {r["iteration"]: r["valid_loss"] for r in lines if "valid_loss" in r}


def _resume_scenario(tmp: str, tp: int, pp: int, extra: tuple[str, ...] = ()) -> dict:
    """Straight run vs (stop at HALF, relaunch the same flags, finish); plus the error cases. Per-rank results."""
    from megatron.config import parse_args
    from megatron.training import pretrain

    tmp_path = Path(tmp)
    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    base = [*TINY, *layout, *extra]
    straight = pretrain(parse_args([*base, "--metrics-file", str(tmp_path / "straight.jsonl")]))
    ck = str(tmp_path / "ckpt")
    resumable = [*base, "--save", ck, "--load", ck, "--save-interval", "100"]
    first = pretrain(
        parse_args(
            [*resumable, "--exit-interval", str(HALF), "--metrics-file", str(tmp_path / "a.jsonl")]
        )
    )
    # The relaunch names the same metrics file: it continues it (a resumed run appends, not overwrites).
    second = pretrain(parse_args([*resumable, "--metrics-file", str(tmp_path / "a.jsonl")]))
    # A model whose shape disagrees with the checkpoint: one error listing the differing fields.
    try:
        pretrain(parse_args([*base, "--load", ck, "--hidden-size", "64", "--num-layers", "3"]))
        mismatch = None
    except ValueError as e:
        mismatch = str(e)
    # --finetune: weights only, iteration 0, trains all ITERS again.
    ft = pretrain(parse_args([*base, "--load", ck, "--finetune", "--train-iters", "2"]))
    return {
        "straight": straight.losses,
        "first": (first.exit_code, first.iteration, first.losses),
        "second": (second.exit_code, second.iteration, second.losses),
        "mismatch": mismatch,
        "finetune": (ft.iteration, ft.losses),
    }


def _check_resume(tmp_path: Path, results: list[dict]) -> None:
    r = results[0]
    for other in results[1:]:
        assert other == r
    straight = r["straight"]
    code, it, first = r["first"]
    assert (code, it) == (3, HALF)
    code, it, second = r["second"]
    assert (code, it) == (0, ITERS)
    # Bit for bit: the resumed run logs exactly the losses of the straight run.
    assert first + second == straight, (first, second, straight)
    assert _losses(tmp_path / "a.jsonl") == _losses(tmp_path / "straight.jsonl")
    # Evaluations (every 2 iterations) continue the validation stream across the resume: same valid losses.
    straight_valid = _valid_losses(tmp_path / "straight.jsonl")
    resumed_valid = _valid_losses(tmp_path / "a.jsonl")
    assert len(straight_valid) >= 3 and resumed_valid == straight_valid, (
        resumed_valid,
        straight_valid,
    )
    ck = tmp_path / "ckpt"
    assert (ck / "latest").read_text() == f"global_step{ITERS}"
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    assert (ck / f"global_step{HALF}" / "trident_meta.json").is_file()
    msg = r["mismatch"]
    assert msg is not None and "differs from the flags in 4 field(s)" in msg
    assert (
        "num_layers: checkpoint 2, flags 3" in msg and "hidden_size: checkpoint 32, flags 64" in msg
    )
    ft_iter, ft_losses = r["finetune"]
    assert ft_iter == 2 and ft_losses[0] < straight[0]  # trained weights, fresh iteration count


def test_exact_resume_single_rank(tmp_path: Path) -> None:
    results = run_distributed(
        _resume_scenario, 1, str(tmp_path), 1, 1, init_process_group=False, timeout=300
    )
    _check_resume(tmp_path, results)


def test_exact_resume_pipeline_two_ranks(tmp_path: Path) -> None:
    """PP = 2 (PipelineEngine, layer files, ZeRO-1): same bit-for-bit resume; every rank restores its own RNG."""
    results = run_distributed(
        _resume_scenario, 2, str(tmp_path), 1, 2, init_process_group=False, timeout=300
    )
    _check_resume(tmp_path, results)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,world", [(2, 1, 2), (1, 1, 2), (2, 2, 4)])
def test_exact_resume_layouts(tmp_path: Path, tp: int, pp: int, world: int) -> None:
    results = run_distributed(
        _resume_scenario, world, str(tmp_path), tp, pp, init_process_group=False, timeout=600
    )
    _check_resume(tmp_path, results)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,world", [(1, 1, 1), (1, 2, 2), (2, 2, 4)])
def test_exact_resume_async_save(tmp_path: Path, tp: int, pp: int, world: int) -> None:
    """--async-save: the exit (--exit-interval) and the end wait for the background write and commit it; the
    resume is bit for bit, with pipelines (layer files) and TP too."""
    results = run_distributed(
        _resume_scenario,
        world,
        str(tmp_path),
        tp,
        pp,
        ("--async-save",),
        init_process_group=False,
        timeout=600,
    )
    _check_resume(tmp_path, results)
