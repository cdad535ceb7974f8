"""ZeRO-3 construction inside ``deepspeed.zero.Init`` (``megatron/training/zero_init.py``), ZeRO offload, NVMe refusal.

Every run is the real thing: ``pretrain(cfg)`` on 2 spawned gloo ranks (DP = 2, ZeRO-3). The run "without
zero.Init" is the same code with ``uses_zero3_init`` patched to False in the worker, so the model is built whole and
DeepSpeed partitions it afterwards, as before this change.

- Construction: under ``zero.Init`` every parameter is partitioned when the model is returned (a placeholder of 0
  elements, this rank's half in ``ds_tensor``); gathered, it is bit for bit the whole build (each parameter is drawn
  from ``(seed, name)`` inside its module's ``__init__``). The untied output layer and the padded vocabulary
  (300 -> 384) exercise the padded-row zeroing that used to run after construction. The optimizer's weight-decay
  groups are the same (they look at the full shape, not the placeholder).
- Losses: equal within 1e-6 relative (measured: bitwise) over 4 iterations, in fp32 and in bf16 (where
  ``zero.Init`` builds bf16 parameters: the same fp32 draw, cast as the engine casts the whole build).
- Offload: ``offload_param`` + ``offload_optimizer`` to CPU with DeepSpeed's CPU Adam (``--cpu-optimizer``), and
  with torch's AdamW (``--cpu_torch_adam``), against no offload: 10 iterations within 1e-6 relative (CPU Adam's
  SIMD loop rounds differently from torch's AdamW: ~1e-7 here).
- NVMe: refused in one line naming the key and the fix where libaio is missing; where it is installed
  (``apt-get install libaio-dev``), ``offload_param`` + ``offload_optimizer`` to a local directory give the same
  losses (skipped elsewhere).

DeepSpeed's ops are JIT-built once per machine into torch's extension cache, later runs load them: ``cpu_adam`` 122 s,
``async_io`` 880 s, measured on 2 cores shared with other jobs (load average 8).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron.config import RunPlan, parse_args, validate
from megatron.testing import run_distributed
from megatron.training.zero_init import uses_zero3_init

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "1", "--global-batch-size", "4",
    "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "linear",
    "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234",
    "--mock-data", "--vocab-size", "299", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--untie-embeddings-and-output-weights", "--zero-stage", "3",
    "--eval-iters", "0", "--log-interval", "1", "--log-level", "WARNING",
]  # fmt: skip
RTOL = 1e-6


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _train(argv: list[str], *, zero_init: bool) -> dict:
    """``pretrain`` on this rank; the built model's facts (gathered values, partitioning, optimizer groups)."""
    import sys

    import deepspeed

    from megatron.config import parse_args
    from megatron.training import model_setup, pretrain

    seen: dict = {}
    build_model, build_optimizer = model_setup.build_model, model_setup.build_optimizer
    pretrain_module = sys.modules["megatron.training.pretrain"]
    build_engine = pretrain_module.build_engine

    def recording_build(*args, **kwargs):
        model = build_model(*args, **kwargs)
        params = dict(model.named_parameters())
        seen["placeholders"] = {n: p.numel() for n, p in params.items()}
        seen["dtypes"] = {n: p.dtype for n, p in params.items()}
        seen["partition"] = {n: getattr(p, "ds_tensor", p).numel() for n, p in params.items()}
        with deepspeed.zero.GatheredParameters(list(params.values()), enabled=zero_init):
            seen["values"] = {n: p.detach().float().clone() for n, p in params.items()}
        return model

    def recording_optimizer(model, t, **kwargs):
        optimizer = build_optimizer(model, t, **kwargs)
        names = {id(p): n for n, p in model.named_parameters()}
        seen["groups"] = [sorted(names[id(p)] for p in g["params"]) for g in optimizer.param_groups]
        return optimizer

    def recording_engine(*args, **kwargs):
        bundle = build_engine(*args, **kwargs)
        engine = bundle.engine
        seen["engine"] = {
            "offload_param": bool(engine.zero_offload_param()),
            "offload_optimizer": bool(engine.zero_offload_optimizer()),
            "optimizer": type(engine.basic_optimizer).__name__,
        }
        return bundle

    model_setup.build_model = recording_build
    model_setup.build_optimizer = recording_optimizer
    model_setup.uses_zero3_init = lambda plan: zero_init
    pretrain_module.build_engine = recording_engine
    try:
        result = pretrain(parse_args(argv))
    finally:
        model_setup.build_model, model_setup.build_optimizer = build_model, build_optimizer
        model_setup.uses_zero3_init = uses_zero3_init
        pretrain_module.build_engine = build_engine
    assert result.exit_code == 0
    return {**seen, "losses": result.losses}


def _both(argv: list[str]) -> dict:
    """Train with and without ``zero.Init``; compare the built models here (tensors do not cross processes)."""
    zi, whole = _train(argv, zero_init=True), _train(argv, zero_init=False)
    out = whole["values"]["language_model.output_layer.weight"]
    return {
        "zi_placeholders": zi["placeholders"],
        "zi_partition": zi["partition"],
        "whole_placeholders": whole["placeholders"],
        "numel": {n: v.numel() for n, v in whole["values"].items()},
        # --bf16: zero.Init builds bf16 parameters (the fp32 draw, cast); the whole build is cast by the engine
        "differ": sorted(
            n
            for n, v in whole["values"].items()
            if not zi["values"][n].equal(v.to(zi["dtypes"][n]).float())
        ),
        "output_shape": tuple(out.shape),
        "padded_rows_zero": not out[300:].any(),  # NullTokenizer: 299 ids + EOD = 300
        "true_rows_drawn": bool(out[:300].abs().min() > 0),
        "groups": (zi["groups"], whole["groups"]),
        "losses": (zi["losses"], whole["losses"]),
    }


@pytest.mark.parametrize(
    "precision",
    [[], pytest.param(["--bf16"], marks=pytest.mark.slow)],  # bf16: ~40 s more, -m slow
    ids=["fp32", "bf16"],
)
def test_zero_init_builds_partitioned_with_the_same_numbers(precision: list[str]) -> None:
    argv = [*TINY, "--train-iters", "4", *precision]
    per_rank = run_distributed(_both, 2, argv, init_process_group=False, timeout=600)
    for rank, r in enumerate(per_rank):
        # Partitioned when the model is returned: a 0-element placeholder, half of each parameter on this rank.
        assert set(r["zi_placeholders"].values()) == {0}, r["zi_placeholders"]
        for name, numel in r["numel"].items():
            assert r["zi_partition"][name] == (numel + 1) // 2, name
            assert r["whole_placeholders"][name] == numel  # built whole
        # The same numbers, bit for bit: drawn from (seed, name) inside the module's __init__.
        assert r["differ"] == [], f"rank {rank}: {r['differ']} differ"
        assert r["output_shape"] == (384, 32) and r["padded_rows_zero"] and r["true_rows_drawn"]
        zi_groups, whole_groups = r["groups"]
        assert zi_groups == whole_groups and len(zi_groups) == 2
        zi_losses, whole_losses = r["losses"]
        assert _max_rel(zi_losses, whole_losses) <= RTOL, (zi_losses, whole_losses)
        assert r["losses"] == per_rank[0]["losses"]  # every rank logs the same
    losses = per_rank[0]["losses"][0]
    assert len(losses) == 4 and losses[-1] < losses[0]


def _offload_runs(argv: list[str], offload_json: str) -> dict[str, list[float]]:
    runs = {
        "plain": [],
        "cpu_adam": ["--cpu-optimizer", "--deepspeed_config", offload_json],
        "cpu_torch_adam": [
            "--cpu-optimizer",
            "--cpu_torch_adam",
            "--deepspeed_config",
            offload_json,
        ],
    }
    out = {}
    for name, flags in runs.items():
        seen = _train([*argv, *flags], zero_init=True)
        out[name] = {"losses": seen["losses"], **seen["engine"]}
    return out


@pytest.mark.slow  # builds DeepSpeed's cpu_adam op on a fresh machine (~1-2 min)
def test_offload_param_and_cpu_adam_match_no_offload(tmp_path: Path) -> None:
    offload = tmp_path / "offload.json"
    offload.write_text(json.dumps({"zero_optimization": {"offload_param": {"device": "cpu"}}}))
    argv = [*TINY, "--train-iters", "10"]
    per_rank = run_distributed(
        _offload_runs, 2, argv, str(offload), init_process_group=False, timeout=900
    )
    runs = per_rank[0]
    assert per_rank[1] == runs
    plain = runs["plain"]
    assert (
        not plain["offload_param"]
        and not plain["offload_optimizer"]
        and plain["optimizer"] == "AdamW"
    )
    assert len(plain["losses"]) == 10 and min(plain["losses"]) < plain["losses"][0]  # it trains
    for name, optimizer in (("cpu_adam", "DeepSpeedCPUAdam"), ("cpu_torch_adam", "AdamW")):
        run = runs[name]
        assert run["offload_param"] and run["offload_optimizer"] and run["optimizer"] == optimizer
        # measured: CPU Adam 8e-8 (its SIMD loop rounds differently), torch AdamW offloaded 0 (bitwise)
        assert _max_rel(run["losses"], plain["losses"]) <= RTOL, (name, run, plain)


def _ds(user: dict, monkeypatch: pytest.MonkeyPatch, *, aio: bool) -> dict:
    from megatron.training import zero_init
    from megatron.training.ds_config import build_ds_config

    monkeypatch.setattr(zero_init, "async_io_available", lambda: aio)
    cfg = parse_args([*TINY, "--train-iters", "1"])
    validate(cfg, world_size=1)
    plan = RunPlan.build(cfg, world_size=1, device_type="cpu", true_vocab=299)
    return build_ds_config(cfg, plan, user)


@pytest.mark.parametrize("key", ["offload_param", "offload_optimizer"])
def test_nvme_offload_refused_without_libaio(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    nvme = {"zero_optimization": {key: {"device": "nvme", "nvme_path": "/local/nvme"}}}
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"zero_optimization.{key}.device = nvme, which needs DeepSpeed's async_io op"
        )
        + r".*libaio is missing; install it \(Debian/Ubuntu: apt-get install libaio-dev",
    ):
        _ds(nvme, monkeypatch, aio=False)
    merged = _ds(nvme, monkeypatch, aio=True)  # where the op builds, the config passes as written
    assert merged["zero_optimization"][key]["device"] == "nvme"
    without_path = {"zero_optimization": {key: {"device": "nvme"}}}
    with pytest.raises(ValueError, match=f"zero_optimization.{key}.device = nvme but no nvme_path"):
        _ds(without_path, monkeypatch, aio=True)


def test_output_layer_init_zeroes_padded_rows_of_a_shard() -> None:
    """--per-shard-init hands the init this rank's ``[vp, h]`` shard: its rows from global index V on are zero."""
    import torch

    from megatron.model.language_model import _true_rows_init

    shard = torch.empty(256, 8)
    # TP rank 1 of 2 holds rows 256..511, of which 300.. are padding
    _true_rows_init(0.02, 300, 512, tp_rank=1)(shard, None)
    assert shard[:44].abs().min() > 0 and not shard[44:].any()
    master = torch.empty(512, 8)
    _true_rows_init(0.02, 300, 512, tp_rank=1)(master, torch.Generator().manual_seed(0))
    assert master[:300].abs().min() > 0 and not master[300:].any()


def _nvme_runs(argv: list[str], nvme_json: str) -> dict[str, dict]:
    out = {}
    for name, flags in {"plain": [], "nvme": ["--deepspeed_config", nvme_json]}.items():
        seen = _train([*argv, *flags], zero_init=True)
        out[name] = {"losses": seen["losses"], **seen["engine"]}
    return out


@pytest.mark.slow  # builds DeepSpeed's async_io op (minutes) where libaio is installed
def test_nvme_offload_where_async_io_builds(tmp_path: Path) -> None:
    """Where libaio is installed: parameters and optimizer state swapped to a local directory, the same losses."""
    from megatron.training.zero_init import async_io_available

    if not async_io_available():
        pytest.skip("DeepSpeed's async_io op cannot be built here (apt-get install libaio-dev)")
    swap = tmp_path / "swap"
    swap.mkdir()
    nvme = {"device": "nvme", "nvme_path": str(swap)}
    ds = tmp_path / "nvme.json"
    ds.write_text(
        json.dumps(
            {
                "zero_optimization": {
                    "offload_param": {**nvme, "buffer_size": 1_000_000, "buffer_count": 4},
                    "offload_optimizer": nvme,
                }
            }
        )
    )
    per_rank = run_distributed(
        _nvme_runs, 2, [*TINY, "--train-iters", "4"], str(ds), init_process_group=False, timeout=900
    )
    runs = per_rank[0]
    assert runs["nvme"]["offload_param"] and runs["nvme"]["offload_optimizer"]
    assert _max_rel(runs["nvme"]["losses"], runs["plain"]["losses"]) <= RTOL, runs
    # DeepSpeed's swap directories (the swap files in them are deleted when the engine goes)
    for what in ("float32params", "optimizer"):
        assert {d.name for d in (swap / "zero_stage_3" / what).iterdir()} == {"rank0", "rank1"}
