"""Collective benchmark in the run's TP / DP / PP groups, with the bandwidths nccl-tests reports.

For an operation on ``n`` ranks that takes ``t`` seconds on a message of ``S`` bytes, nccl-tests
(``doc/PERFORMANCE.md``) defines the algorithm bandwidth ``algbw = S / t`` and the bus bandwidth
``busbw = algbw * factor``, the per-link speed a ring needs, comparable with the hardware's peak::

    op               S (the "size" column)                        factor
    all_reduce       the buffer (input = output)                  2 (n - 1) / n
    all_gather       the gathered output (n x each input)         (n - 1) / n
    reduce_scatter   the input (n x each output)                  (n - 1) / n
    all_to_all       each rank's send buffer (n chunks)           (n - 1) / n
    send_recv        the message (ring: to next, from previous)   1

``t`` is the mean over ``iters`` timed iterations after ``warmup`` untimed ones, averaged over the group's ranks
(nccl-tests' default ``-a 1``). Every group of a kind runs at once, as in training (all DP groups reduce together);
the report is the one of global rank 0's groups. GB/s are 1e9 bytes per second, as in nccl-tests. Every
collective goes through :mod:`megatron.mpu.mappings`.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron import mpu
from megatron.launch.device import device_type, local_device
from megatron.mpu import mappings
from megatron.mpu.parallel_state import (
    ProcessGroup,
    group_rank,
    group_world_size,
    validate_degrees,
)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
GROUP_KINDS = {
    "tp": "tensor_model_parallel",
    "dp": "data_parallel",
    "pp": "pipeline_model_parallel",
}
"""Short name of a group kind (flags, JSON) -> the :class:`~megatron.mpu.parallel_state.RankGrid` field."""
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)(i?B)?\s*$", re.IGNORECASE)


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw of ``op`` on ``n`` ranks (nccl-tests' definitions, table in the module docstring)."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "send_recv":
        return 1.0
    raise ValueError(f"unknown collective {op!r}; choose from {', '.join(OPS)}")


def parse_size(text: str) -> int:
    """Bytes from ``"4096"``, ``"1K"``, ``"64M"``, ``"1G"`` (binary multiples: 1K = 1024, as nccl-tests' -b/-e).

    Raises:
        ValueError: not a positive size.
    """
    m = _SIZE.match(text)
    if not m or int(m.group(1)) < 1:
        raise ValueError(f"{text!r} is not a size in bytes; write e.g. 4096, 1K, 64M or 1G")
    return int(m.group(1)) * 1024 ** " KMG".index((m.group(2) or " ").upper())


def message_sizes(min_bytes: int, max_bytes: int, step_factor: int) -> list[int]:
    """``min_bytes, min_bytes * step_factor, ...`` up to ``max_bytes`` (inclusive).

    Raises:
        ValueError: min above max, or a step factor below 2.
    """
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(
            f"--min-bytes ({min_bytes}) must be >= 1 and <= --max-bytes ({max_bytes}); "
            "e.g. --min-bytes 1K --max-bytes 1M"
        )
    if step_factor < 2:
        raise ValueError(f"--step-factor ({step_factor}) must be >= 2; use 2 or 4")
    sizes = [min_bytes]
    while sizes[-1] * step_factor <= max_bytes:
        sizes.append(sizes[-1] * step_factor)
    return sizes


@dataclass(frozen=True)
class CommBenchSpec:
    """What to measure (the same on every rank)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sizes: tuple[int, ...] = (1024,)
    """Message sizes in bytes (rounded per op to whole elements, and to a multiple of ``n`` where chunked)."""
    ops: tuple[str, ...] = OPS
    groups: tuple[str, ...] = tuple(GROUP_KINDS)
    dtype: str = "float32"
    warmup: int = 5
    iters: int = 20


@dataclass(frozen=True)
class BenchResult:
    """One (group, op, size) measurement, the fields of one JSON record."""

    group: str
    group_size: int
    group_ranks: list[int]
    op: str
    bytes: int
    count: int
    dtype: str
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    bus_factor: float


@dataclass
class CommBenchReport:
    """Everything one rank measured; :meth:`to_dict` is the ``--json`` document."""

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    backend: str
    device: str
    dtype: str
    warmup: int
    iters: int
    hostname: str
    results: list[BenchResult] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    """Groups not measured: ``{"group": "tp", "reason": ...}`` (a group of one rank has nothing to send)."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (the results as a list of records)."""
        return asdict(self)


def validate_spec(spec: CommBenchSpec, world_size: int) -> None:
    """Every check of ``spec`` against the world, identical on every rank (run before any group exists).

    Raises:
        ValueError: naming the flag, its value and the fix.
    """
    validate_degrees(world_size, spec.tensor_model_parallel_size, spec.pipeline_model_parallel_size)
    for op in spec.ops:
        bus_factor(op, 2)
    unknown = [g for g in spec.groups if g not in GROUP_KINDS]
    if unknown:
        raise ValueError(f"--groups: unknown {unknown}; choose from {', '.join(GROUP_KINDS)}")
    if spec.dtype not in DTYPES:
        raise ValueError(f"--dtype {spec.dtype!r}: choose from {', '.join(DTYPES)}")
    if spec.warmup < 0 or spec.iters < 1:
        raise ValueError(f"--warmup ({spec.warmup}) must be >= 0 and --iters ({spec.iters}) >= 1")
    if not spec.sizes or min(spec.sizes) < 1:
        raise ValueError(f"message sizes {list(spec.sizes)} must be >= 1 byte")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _element_count(op: str, nbytes: int, n: int, itemsize: int) -> int:
    """Elements of the message ``S``: at least one per rank; a multiple of ``n`` where the op splits it in chunks."""
    count = max(nbytes // itemsize, 1)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        count = max(count // n, 1) * n
    return count


def _operation(
    op: str, count: int, n: int, group: ProcessGroup, dtype: torch.dtype, device: torch.device
) -> Callable[[], Any]:
    """A closure running ``op`` once on preallocated buffers (zeros: repeated sums stay finite)."""

    def buf(k: int) -> torch.Tensor:
        return torch.zeros(k, dtype=dtype, device=device)

    if op == "all_reduce":
        x = buf(count)
        return lambda: mappings.all_reduce_sum_(x, group)
    if op == "all_gather":
        x, out = buf(count // n), buf(count)
        return lambda: mappings.all_gather_into_(out, x, group)  # n x [count/n] -> [count]
    if op == "reduce_scatter":
        x, out = buf(count), buf(count // n)
        return lambda: mappings.reduce_scatter_into_(out, x, group)  # [count] -> [count/n]
    if op == "all_to_all":
        x, out = buf(count), buf(count)
        return lambda: mappings.all_to_all_into_(out, x, group)  # [count] -> [count]
    me = group_rank(group)
    x, out = buf(count), buf(count)
    return lambda: mappings.send_recv_(x, (me + 1) % n, out, (me - 1) % n, group)


def time_op(
    op: str,
    group: ProcessGroup,
    nbytes: int,
    *,
    dtype: str = "float32",
    device: torch.device | None = None,
    warmup: int = 5,
    iters: int = 20,
) -> tuple[int, float]:
    """``(count, seconds)``: elements of the message and the mean time of one ``op`` on ``group``, averaged over
    its ranks. Every rank of ``group`` calls this with the same arguments."""
    device = device or mappings.communication_device(group)
    n = group_world_size(group)
    count = _element_count(op, nbytes, n, DTYPES[dtype].itemsize)
    run = _operation(op, count, n, group, DTYPES[dtype], device)
    for _ in range(warmup):
        run()
    _sync(device)
    mappings.all_reduce_sum_(torch.zeros(1, device=device), group)  # line the ranks up
    start = time.perf_counter()
    for _ in range(iters):
        run()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    mean = mappings.all_reduce_sum_(elapsed.to(device), group).item() / n
    return count, mean


def result_of(
    group: str, ranks: list[int], op: str, count: int, seconds: float, dtype: str
) -> BenchResult:
    """The record of one measurement: algbw = S / t and busbw = algbw x :func:`bus_factor`."""
    n = len(ranks)
    nbytes = count * DTYPES[dtype].itemsize
    algbw = nbytes / seconds / 1e9
    factor = bus_factor(op, n)
    return BenchResult(
        group=group,
        group_size=n,
        group_ranks=list(ranks),
        op=op,
        bytes=nbytes,
        count=count,
        dtype=dtype,
        time_us=seconds * 1e6,
        algbw_gbps=algbw,
        busbw_gbps=algbw * factor,
        bus_factor=factor,
    )


def run_comm_bench(spec: CommBenchSpec) -> CommBenchReport:
    """Measure every (group kind, op, size) of ``spec`` on this rank; every rank of the world calls it.

    Needs torch.distributed initialized; builds the model-parallel groups for ``spec``'s degrees when they do not
    exist yet (and forgets them afterwards).

    Raises:
        ValueError: see :func:`validate_spec` (on every rank, before any group is created).
    """
    world = dist.get_world_size()
    validate_spec(spec, world)
    own_groups = not mpu.model_parallel_is_initialized()
    if own_groups:
        mpu.initialize_model_parallel(
            spec.tensor_model_parallel_size, spec.pipeline_model_parallel_size
        )
    try:
        state = mpu.get_parallel_state()
        device = mappings.communication_device(dist.group.WORLD)
        report = CommBenchReport(
            world_size=world,
            tensor_model_parallel_size=state.grid.tensor_model_parallel_size,
            pipeline_model_parallel_size=state.grid.pipeline_model_parallel_size,
            data_parallel_size=state.grid.data_parallel_size,
            backend=str(dist.get_backend()),
            device=str(device),
            dtype=spec.dtype,
            warmup=spec.warmup,
            iters=spec.iters,
            hostname=socket.gethostname(),
        )
        for short in spec.groups:
            kind = GROUP_KINDS[short]
            ranks = state.grid.group_of(kind, state.rank) or [state.rank]
            if len(ranks) == 1:
                report.skipped.append({"group": short, "reason": "a group of one rank"})
                continue
            group = {
                "tp": state.get_tensor_model_parallel_group,
                "dp": state.get_data_parallel_group,
                "pp": state.get_pipeline_model_parallel_group,
            }[short]()
            for op in spec.ops:
                for nbytes in spec.sizes:
                    count, seconds = time_op(
                        op,
                        group,
                        nbytes,
                        dtype=spec.dtype,
                        device=device,
                        warmup=spec.warmup,
                        iters=spec.iters,
                    )
                    report.results.append(result_of(short, ranks, op, count, seconds, spec.dtype))
        return report
    finally:
        if own_groups:
            mpu.destroy_model_parallel()


def format_table(report: CommBenchReport) -> str:
    """nccl-tests-like text: one line per measurement, grouped by group kind and op."""
    head = (
        f"world {report.world_size} (tp {report.tensor_model_parallel_size}, "
        f"pp {report.pipeline_model_parallel_size}, dp {report.data_parallel_size}), backend "
        f"{report.backend} on {report.device}, {report.dtype}, warmup {report.warmup}, iters "
        f"{report.iters}; times averaged over each group's ranks, GB/s = 1e9 B/s"
    )
    lines = [head, f"{'group':<6}{'op':<16}{'bytes':>12}{'time_us':>12}{'algbw':>11}{'busbw':>11}"]
    for r in report.results:
        lines.append(
            f"{r.group + str(r.group_size):<6}{r.op:<16}{r.bytes:>12}{r.time_us:>12.1f}"
            f"{r.algbw_gbps:>11.4g}{r.busbw_gbps:>11.4g}"
        )
    lines += [f"skipped {s['group']}: {s['reason']}" for s in report.skipped]
    return "\n".join(lines)


def _backend_for(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if device_type() == "cuda" else "gloo"


def run_launched(spec: CommBenchSpec, backend: str = "auto") -> CommBenchReport:
    """Under ``torchrun`` / ``deepspeed`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): join the world, measure,
    leave it. NCCL binds each process to GPU ``LOCAL_RANK``.

    Raises:
        ValueError: a bad spec (see :func:`validate_spec`), before the process group exists.
    """
    validate_spec(spec, int(os.environ.get("WORLD_SIZE", "1")))
    backend = _backend_for(backend)
    if backend == "nccl":
        local_device("cuda")
    dist.init_process_group(backend, init_method="env://")
    try:
        return run_comm_bench(spec)
    finally:
        dist.destroy_process_group()
