"""Megatron-DeepSpeed's logging flags: timers, the --log-*-to-tensorboard scalars, and Weights & Biases (offline).

One single-rank ``pretrain`` run with every flag on (timing level 2, W&B offline), one with timing level 0, read
back through TensorBoard's ``EventAccumulator`` and W&B's offline run files.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from megatron.config import parse_args, validate
from megatron.testing import run_distributed
from megatron.training.timers import Timers
from tests.training.test_token_schedule import TINY

pytest.importorskip("wandb")

ITERS = 4
ALL_FLAGS = [
    "--timing-log-level", "2", "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard",
    "--log-validation-ppl-to-tensorboard", "--log-optimizer-states-to-tensorboard",
    "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard", "--log-params-norm",
    "--log-num-zeros-in-grad", "--tensorboard-queue-size", "5",
]  # fmt: skip


def _scenario(tmp: str) -> dict:
    import logging

    from megatron.training import pretrain

    os.environ.pop("WANDB_MODE", None)  # offline by default
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = _Keep(level=logging.INFO)
    logging.getLogger("megatron").addHandler(handler)
    logging.getLogger("megatron").setLevel(logging.INFO)
    base = [*TINY, "--train-iters", str(ITERS), "--eval-interval", "2", "--eval-iters", "1"]
    base += ["--log-interval", "2"]
    full = pretrain(
        parse_args(
            [
                *base,
                *ALL_FLAGS,
                "--tensorboard-dir",
                f"{tmp}/tb2",
                "--save",
                f"{tmp}/ck",
                "--wandb-project",
                "trident-test",
                "--wandb-exp-name",
                "tiny",
                "--wandb-save-dir",
                f"{tmp}/wb",
            ]  # fmt: skip
        )
    )
    lines_full = list(records)
    records.clear()
    level0 = pretrain(
        parse_args(
            [
                *base,
                "--timing-log-level",
                "0",
                "--log-timers-to-tensorboard",
                "--tensorboard-dir",
                f"{tmp}/tb0",
            ]  # fmt: skip
        )
    )
    logging.getLogger("megatron").removeHandler(handler)
    return {
        "codes": (full.exit_code, level0.exit_code),
        "valid_loss": full.valid_loss,
        "lines_full": lines_full,
        "lines_level0": list(records),
    }


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _params_norm_of_checkpoint(ck: Path) -> float:
    files = list(ck.rglob("mp_rank_00_model_states.pt"))
    assert len(files) == 1, files
    module = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
    seen: set[int] = set()
    total = 0.0
    for t in module.values():
        if id(t) in seen or not torch.is_floating_point(t):
            continue
        seen.add(id(t))
        total += t.double().pow(2).sum().item()
    return math.sqrt(total)


def _wandb_history(run_file: Path) -> list[dict]:
    """The history rows of an offline ``run-<id>.wandb`` file: a 7-byte header (":W&B", magic, version), then
    LevelDB-log records (32 KiB blocks; crc32 4 B, length 2 B LE, type 1 B: 1 full, 2 first, 3 middle, 4 last)
    holding ``wandb_internal_pb2.Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunks, rows = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the tail of a block too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(chunks)
            chunks = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        i.key or "/".join(i.nested_key): json.loads(i.value_json)
                        for i in rec.history.item
                    }
                )
    return rows


def test_logging_flags_tensorboard_timers_wandb(tmp_path: Path) -> None:
    r = run_distributed(_scenario, 1, str(tmp_path), timeout=300)[0]
    assert r["codes"] == (0, 0)
    tb = _scalars(tmp_path / "tb2")
    steps = list(range(1, ITERS + 1))  # --tensorboard-log-interval 1 (default)
    # Timers (level 2): Megatron's names + "-time", max over ranks, positive seconds per iteration.
    for name in ("forward-backward", "optimizer", "forward-compute", "backward-compute"):
        assert [s for s, _ in tb[f"{name}-time"]] == steps
        assert all(v > 0 for _, v in tb[f"{name}-time"])
    assert all(v > 0 for _, v in tb["batch-generator-time"])
    assert not any(k.startswith("forward-send") for k in tb)  # no pipeline at PP=1
    assert [s for s, _ in tb["iteration-time/iteration-time"]] == [2, 4]
    assert [v for _, v in tb["batch-size/batch-size"]] == [4.0] * ITERS
    assert [s for _, s in tb["batch-size/batch-size vs samples"]] == [4.0] * ITERS
    assert [s for s, _ in tb["batch-size/batch-size vs samples"]] == [4, 8, 12, 16]
    assert [v for _, v in tb["world-size/world-size"]] == [1.0] * ITERS
    assert tb["mem-allocated-bytes"][0][1] > 1e6  # CPU: the process RSS
    assert all(v > 0 for _, v in tb["num-zeros/num-zeros"]) is not None  # counted every iteration
    assert [s for s, _ in tb["num-zeros/num-zeros"]] == steps
    # Validation ppl = exp(validation loss), at the evaluation iterations.
    loss = dict(tb["lm-loss-validation/lm loss validation"])
    ppl = dict(tb["lm-loss-validation/lm loss validation ppl"])
    assert sorted(loss) == [2, 4] and sorted(ppl) == [2, 4]
    for it in (2, 4):
        assert ppl[it] == pytest.approx(math.exp(loss[it]), rel=1e-5)
    assert loss[4] == pytest.approx(r["valid_loss"], rel=1e-6)
    # Params norm: the final one equals the norm recomputed from the saved checkpoint; fp32 Adam updates exactly
    # the model's parameters, so the optimizer's weight_l2 is the same number.
    final_norm = tb["params-norm/params-norm"][-1][1]
    assert final_norm == pytest.approx(_params_norm_of_checkpoint(tmp_path / "ck"), rel=1e-5)
    assert tb["optimizer/weight_l2"][-1][1] == pytest.approx(final_norm, rel=1e-5)
    for key in ("variance_l2", "momentum_l2", "variance_sqrt_l1", "momentum_abs_max"):
        assert tb[f"optimizer/{key}"][-1][1] > 0
    # Console: the timer block after each progress line, params norm / num zeros in the line.
    progress = [x for x in r["lines_full"] if x.startswith(" iteration ")]
    assert len(progress) == 2 and all(re.search(r"params norm: \d+\.\d{3} \|", x) for x in progress)
    assert all("num zeros: " in x for x in progress)
    blocks = [x for x in r["lines_full"] if x.startswith("(min, max) time across ranks (ms):")]
    assert len(blocks) == 2 and all(
        "forward-backward ...." in b and "optimizer" in b for b in blocks
    )
    # Level 0: no timer exists (no block, no "-time" tags) but the iteration time still goes to TensorBoard.
    tb0 = _scalars(tmp_path / "tb0")
    assert not [k for k in tb0 if k.endswith("-time") and not k.startswith("iteration-time")]
    assert "iteration-time/iteration-time" in tb0
    assert "lm-loss-validation/lm loss validation ppl" not in tb0  # off without its flag
    assert not [x for x in r["lines_level0"] if "time across ranks" in x]
    # W&B offline: one run directory with the run's binary log, the summary holds the last scalars.
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wb").rglob("*"))
    (run_file,) = runs[0].glob("run-*.wandb")
    rows = _wandb_history(run_file)
    losses = {
        row["_step"]: row["lm-loss-training/lm loss"]
        for row in rows
        if "lm-loss-training/lm loss" in row
    }
    assert losses == pytest.approx(dict(tb["lm-loss-training/lm loss"]), rel=1e-6)
    assert all(row["forward-backward-time"] > 0 for row in rows if "forward-backward-time" in row)
    assert sorted(row["_step"] for row in rows if "params-norm/params-norm" in row) == steps


def test_timers_levels_and_options() -> None:
    t = Timers(1, "minmax", barrier_level_1=False)
    t("forward-backward", 1).start()
    t("forward-backward").stop()
    t("forward-compute", 2).start()  # above the level: a no-op timer
    t("forward-compute").stop()
    assert t.names == ["forward-backward"]
    block = t.log_string(normalizer=1.0)
    assert block is not None and block.startswith("(min, max) time across ranks (ms):")
    assert "forward-backward" in block and "forward-compute" not in block
    assert t.log_string() is None  # reset by the previous call: nothing ran since
    t.log_option = "all"
    t("forward-backward").start()
    t("forward-backward").stop()
    assert (t.log_string() or "").startswith(
        "times across ranks (ms):\n  forward-backward:\n     rank  0:"
    )
    with pytest.raises(RuntimeError, match="exists at level 1"):
        t("forward-backward", 2)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--log-timers-to-tensorboard"], "--log-timers-to-tensorboard writes to TensorBoard"),
        (["--tensorboard-log-interval", "0"], "--tensorboard-log-interval (0) must be"),
        (["--wandb-save-dir", "x"], "--wandb-save-dir (x) without --wandb-project"),
        (
            [
                "--log-optimizer-states-to-tensorboard",
                "--tensorboard-dir",
                "x",
                "--optimizer",
                "sgd",
            ],
            "--optimizer is sgd",
        ),
        (
            ["--log-params-norm", "--zero-stage", "3"],
            "--log-params-norm is not supported with --zero-stage 3",
        ),
        (
            ["--log-num-zeros-in-grad", "--zero-stage", "3"],
            "--log-num-zeros-in-grad is not supported",
        ),
    ],
)
def test_validate_logging_flags(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(parse_args([*TINY, *flags]), world_size=1)


def _pipe_scenario(tmp: str) -> int:
    from megatron.training import pretrain

    argv = [*TINY, "--train-iters", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "1"]
    argv += [
        "--timing-log-level",
        "2",
        "--log-timers-to-tensorboard",
        "--tensorboard-dir",
        f"{tmp}/tb",
    ]
    return pretrain(parse_args(argv)).exit_code


def test_pipeline_timers_reach_tensorboard(tmp_path: Path) -> None:
    """PP=2: DeepSpeed's 1F1B instructions are timed under Megatron's names, send/recv included (logged by the
    TensorBoard rank as the max over ranks: stage 0 sends activations, stage 1 sends gradients)."""
    assert run_distributed(_pipe_scenario, 2, str(tmp_path), timeout=300) == [0, 0]
    tags = _scalars(tmp_path / "tb")
    for name in (
        "forward-backward", "optimizer", "batch-generator", "forward-compute", "backward-compute",
        "forward-send", "forward-recv", "backward-send", "backward-recv",
    ):  # fmt: skip
        values = tags[f"{name}-time"]
        assert [step for step, _ in values] == [1, 2], name
        assert all(v > 0 for _, v in values), name
