"""Megatron-DeepSpeed's sequence-length curriculum (``curriculum_learning`` in the DeepSpeed JSON).

The schedule against hand-computed lengths (DeepSpeed's formulas), the JSON checks, and one 2-rank spawn: the
logged curriculum seqlen per iteration, the same loss curve at DP=2 and PP=2 (truncated samples are the same on
every layout), tokens counted at the truncated length, and an exact stop/resume in the middle of the curriculum.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megatron.config import parse_args
from megatron.testing import run_distributed
from megatron.training.curriculum import parse_curriculum, truncate_batch, without_curriculum

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "5",
    "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "linear",
    "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234",
    "--mock-data", "--vocab-size", "299", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--eval-iters", "0", "--log-interval", "1", "--log-level", "WARNING",
]  # fmt: skip


def _section(**over: object) -> dict:
    base = {
        "enabled": True,
        "curriculum_type": "seqlen",
        "min_difficulty": 8,
        "max_difficulty": 16,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 4},
    }
    return {**base, **over}


def _data_efficiency(**over: object) -> dict:
    """The same schedule as the seqlen_truncate metric of DeepSpeed's data-efficiency section."""
    metric = {k: v for k, v in _section(**over).items() if k not in ("enabled", "curriculum_type")}
    metric |= {"index_to_sample_path": "dummy", "index_to_metric_path": "dummy",
               "difficulty_type": "value", "clustering_type": "single_cluster"}  # fmt: skip
    sampling = {"enabled": True, "curriculum_learning": {"enabled": True, "curriculum_metrics": {
        "seqlen_truncate": metric}}}  # fmt: skip
    return {"data_efficiency": {"enabled": True, "data_sampling": sampling}}


LINEAR = [8, 12, 12, 16, 16]
"""fixed_linear, min 8, max 16, 4 steps, multiples of 4: floor(8 + 8 i / 4) rounded down to 4, capped at 16."""


def test_schedules_and_json_checks() -> None:
    c = parse_curriculum({"curriculum_learning": _section()}, "ds.json", seq_length=16)
    assert c is not None and [c.seqlen(i) for i in range(1, 6)] == LINEAR
    root = _section(
        schedule_type="fixed_root",
        schedule_config={"total_curriculum_step": 4, "difficulty_step": 2, "root_degree": 2},
    )
    c = parse_curriculum({"curriculum_learning": root}, "ds.json", seq_length=16)
    # floor(8 + 8 sqrt(i / 4)) rounded down to 2: 12, 13.6 -> 12, 14.9 -> 14, 16
    assert c is not None and [c.seqlen(i) for i in range(1, 5)] == [12, 12, 14, 16]
    discrete = _section(
        schedule_type="fixed_discrete",
        schedule_config={"difficulty": [4, 8, 16], "max_step": [1, 3]},
    )
    c = parse_curriculum({"curriculum_learning": discrete}, "ds.json", seq_length=16)
    assert c is not None and [c.seqlen(i) for i in range(1, 6)] == [4, 8, 8, 16, 16]
    assert (
        parse_curriculum({"curriculum_learning": _section(enabled=False)}, "x", seq_length=16)
        is None
    )
    assert parse_curriculum({}, "x", seq_length=16) is None
    assert without_curriculum({"curriculum_learning": {}, "a": 1}) == {"a": 1}
    batch = {
        "tokens": torch.arange(32).view(2, 16),
        "labels": torch.arange(1, 33).view(2, 16),
        "loss_mask": torch.ones(2, 16),
        "position_ids": torch.arange(16).repeat(2, 1),
        "attention_mask": torch.ones(2, 1, 16, 16, dtype=torch.bool),
        "document_ids": torch.arange(32).view(2, 16) // 5,
    }
    cut = truncate_batch(batch, 12)
    assert {k: tuple(v.shape) for k, v in cut.items()} == {
        "tokens": (2, 12), "labels": (2, 12), "loss_mask": (2, 12), "position_ids": (2, 12),
        "attention_mask": (2, 1, 12, 12), "document_ids": (2, 12),
    }  # fmt: skip
    assert torch.equal(cut["labels"], batch["labels"][:, :12])
    assert truncate_batch(batch, None) is batch and truncate_batch(batch, 16) is batch
    bad = [
        (_section(curriculum_type="vocabularyrarity"), 'only "seqlen"'),
        (_section(max_difficulty=32), "max_difficulty (32) must be integers with 1 <= min_difficulty"),
        (_section(schedule_type="custom"), "schedule_type is \"custom\"; use one of fixed_linear"),
        (_section(schedule_config={"difficulty_step": 4}), "lacks total_curriculum_step"),
        (_section(schedule_config={"total_curriculum_step": 0, "difficulty_step": 4}),
         "total_curriculum_step is 0; give a positive integer"),
        (_section(schedule_type="fixed_discrete", schedule_config={"difficulty": [4, 8], "max_step": [1, 2]}),
         "one element fewer"),
        (_section(enabled="yes"), "boolean 'enabled'"),
    ]  # fmt: skip
    for section, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_curriculum({"curriculum_learning": section}, "ds.json", seq_length=16)
    # Megatron-DeepSpeed's data-efficiency spelling of the same schedule (--data-efficiency-curriculum-learning).
    c = parse_curriculum(_data_efficiency(), "ds.json", seq_length=16, data_efficiency=True)
    assert c is not None and [c.seqlen(i) for i in range(1, 6)] == LINEAR
    assert without_curriculum(_data_efficiency() | {"a": 1}) == {"a": 1}
    routing_only = {"data_efficiency": {"enabled": True, "data_routing": {"enabled": False}}}
    assert parse_curriculum(routing_only, "ds.json", seq_length=16) is None  # no data_sampling: off
    vocab = _data_efficiency()
    metrics = vocab["data_efficiency"]["data_sampling"]["curriculum_learning"]["curriculum_metrics"]
    metrics["vocabularyrarity"] = metrics.pop("seqlen_truncate")
    ltd = {
        "data_efficiency": {
            "enabled": True,
            "data_routing": {"enabled": True, "random_ltd": {"enabled": True}},
        }
    }
    de_bad = [
        (_data_efficiency(), False, "add the flag"),
        ({}, True, "enable that section in ds.json"),
        (vocab, True, 'only "seqlen_truncate" is supported'),
        (ltd, False, "random_ltd is enabled, but random layerwise token dropping is not built"),
        ({**_data_efficiency(), "curriculum_learning": _section()}, True, "keep one sequence-length curriculum"),
    ]  # fmt: skip
    for user, flag, message in de_bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_curriculum(user, "ds.json", seq_length=16, data_efficiency=flag)
    with pytest.raises(ValueError, match=r"difficulty_step \(4\) must be a multiple of 8"):
        parse_curriculum(
            {"curriculum_learning": _section()}, "ds.json", seq_length=16, sequence_multiple=8
        )


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if '"lm_loss"' in x]


def _scenario(tmp: str) -> dict:
    from megatron.training import pretrain

    tmp_path = Path(tmp)
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps({"curriculum_learning": _section(), "zero_optimization": {"stage": 1}})
    )
    de = tmp_path / "de.json"
    de.write_text(json.dumps(_data_efficiency()))
    base = [*TINY, "--deepspeed_config", str(ds), "--zero-stage", "1"]
    de_flags = [*TINY, "--deepspeed_config", str(de), "--data-efficiency-curriculum-learning"]
    out = {}
    for name, argv in (
        ("dp2", base),
        ("pp2", [*de_flags, "--zero-stage", "1", "--pipeline-model-parallel-size", "2"]),
        ("plain", [*TINY, "--zero-stage", "1"]),  # no curriculum: whole samples
    ):
        r = pretrain(parse_args([*argv, "--metrics-file", str(tmp_path / f"{name}.jsonl")]))
        out[name] = (r.exit_code, r.iteration)
    ck = str(tmp_path / "ckpt")
    resumable = [*base, "--pipeline-model-parallel-size", "2", "--save", ck, "--load", ck]
    resumable += ["--save-interval", "100", "--metrics-file", str(tmp_path / "resumed.jsonl")]
    first = pretrain(parse_args([*resumable, "--exit-interval", "2"]))
    second = pretrain(parse_args([*resumable, "--train-tokens", str(4 * sum(LINEAR[:4]))]))
    out["first"] = (first.exit_code, first.iteration)
    out["second"] = (second.exit_code, second.iteration)
    return out


def test_curriculum_run_logs_seqlen_is_layout_independent_and_resumes(tmp_path: Path) -> None:
    r = run_distributed(_scenario, 2, str(tmp_path), timeout=400)[0]
    assert r["dp2"] == (0, 5) and r["pp2"] == (0, 5)
    rows = _rows(tmp_path / "dp2.jsonl")
    assert [row["curriculum_seqlen"] for row in rows] == LINEAR
    losses = [row["lm_loss"] for row in rows]
    pp = [row["lm_loss"] for row in _rows(tmp_path / "pp2.jsonl")]
    assert pp == pytest.approx(losses, rel=2e-5, abs=1e-6)  # PP=2 ran the data-efficiency spelling
    assert [row["curriculum_seqlen"] for row in _rows(tmp_path / "pp2.jsonl")] == LINEAR
    plain = _rows(tmp_path / "plain.jsonl")
    assert "curriculum_seqlen" not in plain[0]
    # Same initial weights, same samples: the first loss differs only because the samples were cut to 8 tokens.
    assert abs(plain[0]["lm_loss"] - losses[0]) > 1e-4
    # Stop after 2 iterations, resume: the curriculum continues (12, 16) and --train-tokens counts the truncated
    # lengths: 4 x (8 + 12 + 12 + 16) tokens end the run after iteration 4, not 16-token iterations.
    assert r["first"] == (3, 2) and r["second"] == (0, 4)
    resumed = _rows(tmp_path / "resumed.jsonl")
    assert [x["curriculum_seqlen"] for x in resumed] == LINEAR[:4]
    assert [x["lm_loss"] for x in resumed] == pytest.approx(pp[:4], rel=1e-6, abs=1e-7)
