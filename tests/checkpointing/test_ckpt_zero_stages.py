"""ZeRO stages and checkpoints: exact resume under ZeRO-3, and --finetune across ZeRO stages and DP sizes.

DeepSpeed stores ZeRO-3 checkpoints in other files than ZeRO-0/1/2 ones, and ZeRO-3's weights are partitioned over
DP; a weights-only load it cannot do goes through ``megatron/checkpointing/weights_only.py``. Real runs: ``pretrain``
on spawned ranks (gloo, the DeepSpeed engine), dropout off so a fine-tune's losses depend only on the loaded weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.model.presets import GPT2_FLAGS
from megatron.testing import run_distributed

FLAGS = [
    *GPT2_FLAGS,
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "1", "--global-batch-size", "4",
    "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234",
    "--mock-data", "--vocab-size", "299", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--eval-iters", "0", "--log-interval", "1", "--log-level", "WARNING",
]  # fmt: skip


def _pretrain(argv: list[str]):
    from megatron.config import parse_args
    from megatron.training import pretrain

    return pretrain(parse_args(argv))


def _save_and_resume(tmp: str) -> dict[str, list[float]]:
    """Pretrain 4 iterations under ZeRO-3 and ZeRO-1 (saving); ZeRO-3: 2 + resume 2 must equal 4 straight."""
    out = {}
    for stage in (3, 1):
        ck = ["--save", f"{tmp}/z{stage}", "--zero-stage", str(stage)]
        out[f"z{stage}"] = _pretrain([*FLAGS, *ck, "--train-iters", "4"]).losses
    half = ["--zero-stage", "3", "--save", f"{tmp}/half", "--load", f"{tmp}/half"]
    first = _pretrain([*FLAGS, *half, "--train-iters", "4", "--exit-interval", "2"])
    second = _pretrain([*FLAGS, *half, "--train-iters", "4"])
    out["resumed"] = first.losses + second.losses
    return out


def _finetunes(tmp: str, runs: list[tuple[str, int]]) -> list[list[float]]:
    """--finetune from each (source dir, --zero-stage) for 2 iterations; the losses of each."""
    return [
        _pretrain(
            [
                *FLAGS,
                "--zero-stage",
                str(stage),
                "--load",
                f"{tmp}/{src}",
                "--finetune",
                "--train-iters",
                "2",
            ]
        ).losses
        for src, stage in runs
    ]


def test_zero3_resume_and_finetune_across_stages_and_dp(tmp_path: Path) -> None:
    saved = run_distributed(
        _save_and_resume, 2, str(tmp_path), init_process_group=False, timeout=600
    )[0]
    assert saved["resumed"] == saved["z3"]  # exact resume under ZeRO-3 (bit for bit, fp32)
    meta = json.loads((tmp_path / "z3" / "global_step4" / "trident_meta.json").read_text())
    assert (meta["zero_stage"], meta["precision"], meta["world_size"]) == (3, "fp32", 2)
    assert saved["z1"] == pytest.approx(
        saved["z3"], rel=1e-5
    )  # same training: the two sources agree
    # Reference: DeepSpeed's own weights-only load (same stage family, same DP).
    two = [("z1", 1), ("z3", 3), ("z3", 1), ("z1", 3), ("z3", 2)]
    ft2 = run_distributed(_finetunes, 2, str(tmp_path), two, init_process_group=False, timeout=600)[
        0
    ]
    one = [("z3", 3), ("z3", 0), ("z1", 3)]
    ft1 = run_distributed(_finetunes, 1, str(tmp_path), one, init_process_group=False, timeout=600)[
        0
    ]
    reference = ft2[0]
    assert (
        reference[0] < saved["z1"][0] - 0.05
    )  # the trained weights were loaded (not a fresh init)
    results = {f"{src}->zero{st} dp2": r for (src, st), r in zip(two, ft2)}
    results.update({f"{src}->zero{st} dp1": r for (src, st), r in zip(one, ft1)})
    # Both iterations: the first checks the weights, the second that the optimizer's fp32 master copy got them too.
    off = {k: max(abs(a - b) / abs(b) for a, b in zip(v, reference)) for k, v in results.items()}
    assert all(d < 1e-5 for d in off.values()), off
