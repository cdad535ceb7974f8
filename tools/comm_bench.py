"""Collective benchmark in the run's TP / DP / PP groups: all-reduce, all-gather, reduce-scatter, all-to-all and
send/recv, with nccl-tests' algorithm and bus bandwidth (definitions: ``megatron/diagnostics/comm_bench.py``).

    torchrun --nproc-per-node 8 -m tools.comm_bench --tensor-model-parallel-size 8 --max-bytes 1G
    torchrun --nnodes 2 --nproc-per-node 8 ... -m tools.comm_bench --tensor-model-parallel-size 8 --json bench.json
    deepspeed --hostfile hostfile --module tools.comm_bench --tensor-model-parallel-size 8
    python -m tools.comm_bench --nproc-per-node 4 --tensor-model-parallel-size 2      # 4 local ranks, spawned

Under a launcher (RANK / WORLD_SIZE set) every process is one rank; without one, ``--nproc-per-node`` ranks are
spawned on this machine (gloo on CPU, NCCL when there is a GPU per rank). Rank 0 prints the table and writes
``--json``. Exit codes: 0 measured, 2 bad flags (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from megatron.diagnostics.comm_bench import (
    DTYPES,
    GROUP_KINDS,
    OPS,
    CommBenchReport,
    CommBenchSpec,
    format_table,
    message_sizes,
    parse_size,
    run_comm_bench,
    run_launched,
    validate_spec,
)
from megatron.launch.spawn import spawn_local_ranks

EXIT_INPUT_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse that raises ValueError (reported by :func:`main` as one ``error:`` line, exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"{message} (run with --help for the list of flags)")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _names(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(x.strip().replace("-", "_") for x in text.split(",") if x.strip())
        bad = [x for x in names if x not in choices]
        if not names or bad:
            raise argparse.ArgumentTypeError(
                f"{text!r}: choose a comma-separated list from {', '.join(choices)}"
            )
        return names

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m tools.comm_bench", description=__doc__.splitlines()[0])
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="ranks to spawn here when not under torchrun/deepspeed (default 1)",
    )
    p.add_argument("--min-bytes", type=_size, default=1024, help="smallest message (default 1K)")
    p.add_argument(
        "--max-bytes",
        type=_size,
        default=None,
        help="largest message (default 1G on GPUs, 4M on CPU)",
    )
    p.add_argument("--step-factor", type=int, default=4, help="size multiplier (default 4)")
    p.add_argument("--ops", type=_names(OPS), default=OPS, help=f"default {','.join(OPS)}")
    p.add_argument(
        "--groups",
        type=_names(tuple(GROUP_KINDS)),
        default=tuple(GROUP_KINDS),
        help="group kinds to measure (default tp,dp,pp; groups of one rank are skipped)",
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations (default 5)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations (default 20)")
    p.add_argument("--distributed-backend", choices=("auto", "nccl", "gloo"), default="auto")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds, spawned ranks only")
    p.add_argument("--json", type=Path, default=None, help="write the results here (rank 0)")
    # The deepspeed launcher passes --local_rank=N (LOCAL_RANK is in the environment too).
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _spec(a: argparse.Namespace, gpu: bool) -> CommBenchSpec:
    max_bytes = a.max_bytes if a.max_bytes is not None else (1 << 30 if gpu else 4 << 20)
    return CommBenchSpec(
        tensor_model_parallel_size=a.tensor_model_parallel_size,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size,
        sizes=tuple(message_sizes(a.min_bytes, max(max_bytes, a.min_bytes), a.step_factor)),
        ops=a.ops,
        groups=a.groups,
        dtype=a.dtype,
        warmup=a.warmup,
        iters=a.iters,
    )


def _emit(report: CommBenchReport, json_path: Path | None) -> None:
    print(format_table(report))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report.to_dict(), indent=1) + "\n")
        print(f"wrote {json_path}")


def main(argv: list[str] | None = None) -> int:
    """CLI entry: exit 0 when measured, 2 on bad flags."""
    launched = "RANK" in os.environ or "WORLD_SIZE" in os.environ
    try:
        a = build_parser().parse_args(argv)
        gpu = a.distributed_backend != "gloo" and torch.cuda.is_available()
        gpu = gpu and os.environ.get("DS_ACCELERATOR") != "cpu"
        if a.max_bytes is not None and a.max_bytes < a.min_bytes:
            raise ValueError(f"--max-bytes ({a.max_bytes}) must be >= --min-bytes ({a.min_bytes})")
        spec = _spec(a, gpu)
        if a.nproc_per_node < 1 or (launched and a.nproc_per_node != 1):
            raise ValueError(
                f"--nproc-per-node ({a.nproc_per_node}) must be >= 1, and is for runs without a "
                "launcher: under torchrun / deepspeed pass --nproc-per-node to the launcher"
            )
        world = int(os.environ.get("WORLD_SIZE", "1")) if launched else a.nproc_per_node
        validate_spec(spec, world)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    if launched:
        report = run_launched(spec, a.distributed_backend)
        if int(os.environ.get("RANK", "0")) == 0:
            _emit(report, a.json)
        return 0
    backend = None if a.distributed_backend == "auto" else a.distributed_backend
    reports = spawn_local_ranks(
        run_comm_bench, a.nproc_per_node, spec, backend=backend, timeout=a.timeout
    )
    _emit(reports[0], a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
