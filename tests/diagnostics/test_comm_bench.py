"""tools/comm_bench.py on gloo: the JSON records, busbw = algbw x nccl-tests' factor, the collectives it times
(values checked, not just timed), the three ways to run it (library under run_distributed, the CLI spawning its
ranks, the CLI under torchrun) and its one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron import mpu
from megatron.diagnostics import comm_bench as cb
from megatron.mpu import mappings
from megatron.testing import run_distributed
from tools import comm_bench

ROOT = Path(__file__).resolve().parents[2]
RECORD_KEYS = {
    "group",
    "group_size",
    "group_ranks",
    "op",
    "bytes",
    "count",
    "dtype",
    "time_us",
    "algbw_gbps",
    "busbw_gbps",
    "bus_factor",
}
FACTORS = {
    **{(op, 2): 0.5 for op in ("all_gather", "reduce_scatter", "all_to_all")},
    **{(op, 4): 0.75 for op in ("all_gather", "reduce_scatter", "all_to_all")},
    ("all_reduce", 2): 1.0,  # 2 (n - 1) / n
    ("all_reduce", 4): 1.5,
    ("send_recv", 2): 1.0,
    ("send_recv", 4): 1.0,
}
"""nccl-tests' busbw / algbw, written out by hand."""


def test_bus_factors_sizes_and_their_errors() -> None:
    for (op, n), factor in FACTORS.items():
        assert cb.bus_factor(op, n) == factor
    assert cb.bus_factor("all_reduce", 8) == 2 * 7 / 8
    with pytest.raises(ValueError, match="unknown collective 'broadcast'; choose from all_reduce"):
        cb.bus_factor("broadcast", 2)
    assert [cb.parse_size(s) for s in ("4096", "1K", "64M", "1G", "2kib")] == [
        4096,
        1024,
        64 << 20,
        1 << 30,
        2048,
    ]
    for bad in ("0", "1T", "-1K", "x"):
        with pytest.raises(ValueError, match="is not a size in bytes; write e.g. 4096, 1K"):
            cb.parse_size(bad)
    assert cb.message_sizes(1024, 1 << 20, 4) == [1 << k for k in range(10, 21, 2)]
    assert cb.message_sizes(1024, 5000, 2) == [1024, 2048, 4096]
    with pytest.raises(
        ValueError, match=r"--min-bytes \(2048\) must be >= 1 and <= --max-bytes \(1024\)"
    ):
        cb.message_sizes(2048, 1024, 2)
    with pytest.raises(ValueError, match=r"--step-factor \(1\) must be >= 2"):
        cb.message_sizes(1, 8, 1)
    assert comm_bench.build_parser().parse_args(["--local_rank=3"]).local_rank == 3  # deepspeed's
    # Sizes round to whole elements, and to a multiple of n elements where the op splits the buffer.
    assert cb._element_count("all_reduce", 1000, 4, 4) == 250
    assert cb._element_count("all_gather", 1000, 4, 4) == 248
    assert cb._element_count("all_to_all", 2, 4, 4) == 4


def _check_new_mappings() -> None:
    """The helpers the benchmark times move the right values (world 4, one group of every rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    x = torch.arange(4.0) + 10 * rank  # rank r holds [10r, 10r+1, 10r+2, 10r+3]
    out = torch.empty(4 * world)
    mappings.all_gather_into_(out, x, group)
    assert out.tolist() == [10.0 * r + i for r in range(world) for i in range(4)]
    part = torch.empty(1)
    mappings.reduce_scatter_into_(part, x, group)  # chunk `rank` of x, summed: sum_r (10r + rank)
    assert part.item() == sum(10 * r + rank for r in range(world))
    swapped = torch.empty(4)
    mappings.all_to_all_into_(swapped, x, group)  # chunk j came from rank j: its element `rank`
    assert swapped.tolist() == [10.0 * j + rank for j in range(world)]
    got = mappings.send_recv_(x, (rank + 1) % world, torch.empty(4), (rank - 1) % world, group)
    assert got.tolist() == (torch.arange(4.0) + 10 * ((rank - 1) % world)).tolist()
    with pytest.raises(
        ValueError, match="all-to-all along dim 0: dimension 0 of a tensor of shape"
    ):
        mappings.all_to_all_into_(torch.empty(3), torch.empty(3), group)


def _world4_worker(specs: list[cb.CommBenchSpec]) -> list[dict]:
    _check_new_mappings()
    docs = []
    for spec in specs:
        docs.append(cb.run_comm_bench(spec).to_dict())
        assert not mpu.model_parallel_is_initialized()  # its own groups are forgotten afterwards
    return docs


def _check_records(
    doc: dict, groups: dict[str, list[int]], ops: tuple[str, ...], sizes: list[int]
) -> None:
    assert [(r["group"], r["op"]) for r in doc["results"]] == [
        (g, op) for g in groups for op in ops for _ in sizes
    ]
    for r in doc["results"]:
        assert set(r) == RECORD_KEYS
        assert r["group_ranks"] == groups[r["group"]] and r["group_size"] == len(r["group_ranks"])
        assert r["time_us"] > 0 and r["algbw_gbps"] > 0 and r["busbw_gbps"] > 0
        assert r["bus_factor"] == FACTORS[(r["op"], r["group_size"])]
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * r["bus_factor"], rel=1e-12)
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9, rel=1e-9)
        assert r["bytes"] == r["count"] * 4 and r["dtype"] == "float32"


@pytest.mark.timeout(300)
def test_world4_every_op_in_tp_pp_and_dp_groups() -> None:
    small = {"sizes": (1024, 4096), "warmup": 1, "iters": 2}
    specs = [
        cb.CommBenchSpec(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, **small),
        cb.CommBenchSpec(**small),  # DP = 4: the factors at n = 4
    ]
    per_rank = run_distributed(_world4_worker, 4, specs, timeout=240)
    grid, flat = per_rank[0]
    assert (grid["world_size"], grid["data_parallel_size"], grid["backend"]) == (4, 1, "gloo")
    assert grid["skipped"] == [{"group": "dp", "reason": "a group of one rank"}]
    _check_records(grid, {"tp": [0, 1], "pp": [0, 2]}, cb.OPS, [1024, 4096])
    assert per_rank[3][0]["results"][0]["group_ranks"] == [
        2,
        3,
    ]  # each rank measures its own groups
    assert flat["data_parallel_size"] == 4 and len(flat["skipped"]) == 2
    _check_records(flat, {"dp": [0, 1, 2, 3]}, cb.OPS, [1024, 4096])
    json.dumps(per_rank)


def _check_cli_json(path: Path, ops: tuple[str, ...]) -> None:
    doc = json.loads(path.read_text())
    assert (doc["world_size"], doc["tensor_model_parallel_size"]) == (2, 1)
    assert doc["skipped"] == [
        {"group": "tp", "reason": "a group of one rank"},
        {"group": "pp", "reason": "a group of one rank"},
    ]
    _check_records(doc, {"dp": [0, 1]}, ops, [1024, 2048, 4096])


@pytest.mark.timeout(300)
def test_cli_world2_spawned_and_under_torchrun(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--min-bytes", "1K", "--max-bytes", "4K", "--step-factor", "2", "--warmup", "1"]
    flags += ["--iters", "2", "--ops", "all-reduce,all_gather,send_recv"]
    ops = ("all_reduce", "all_gather", "send_recv")
    assert (
        comm_bench.main([*flags, "--nproc-per-node", "2", "--json", str(tmp_path / "a.json")]) == 0
    )
    out = capsys.readouterr().out
    assert "dp2   all_reduce" in out and "skipped tp: a group of one rank" in out
    _check_cli_json(tmp_path / "a.json", ops)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--standalone",  # torchrun picks a free port itself: no race with other tests
            "-m",
            "tools.comm_bench",
            *flags,
            "--json",
            str(tmp_path / "b.json"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    assert run.stdout.count("dp2   all_reduce") == 3  # rank 0 prints; one line per size
    _check_cli_json(tmp_path / "b.json", ops)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--bogus"], "error: unrecognized arguments: --bogus (run with --help"),
        (["--min-bytes", "1X"], "error: argument --min-bytes: '1X' is not a size in bytes"),
        (["--ops", "all_reduce,bcast"], "error: argument --ops: 'all_reduce,bcast': choose"),
        (
            ["--max-bytes", "1K", "--min-bytes", "4K"],
            "error: --max-bytes (1024) must be >= --min-bytes",
        ),
        (
            ["--nproc-per-node", "3", "--tensor-model-parallel-size", "2"],
            "error: invalid parallel degrees",
        ),
        (["--nproc-per-node", "0"], "error: --nproc-per-node (0) must be >= 1"),
        (["--iters", "0"], "error: --warmup (5) must be >= 0 and --iters (0) >= 1"),
        (["--step-factor", "1"], "error: --step-factor (1) must be >= 2"),
    ],
)
def test_bad_flags_are_one_error_line_and_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert comm_bench.main(flags) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines
    assert captured.out == ""
