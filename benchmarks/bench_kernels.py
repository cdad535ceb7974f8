"""Fused kernels vs their PyTorch references: forward + backward time, achieved GB/s and peak extra memory.

    python -m benchmarks.bench_kernels                       # CPU, fp32, GPT-2 124M shapes and LLaMA-7B-like rows
    python -m benchmarks.bench_kernels --device cuda --dtype bf16 --json out.json
    python -m benchmarks.bench_kernels --ops rms_norm,cross_entropy --small

Not a test: the numbers depend on the machine. Shapes (``--small`` divides the token count by 8):

- GPT-2 124M: s = 1024, b = 8, h = 768, 12 heads (hn 64), MLP 3072, vocabulary 50304;
- LLaMA-7B-like rows: h = 4096, 32 heads (hn 128), SwiGLU width 11008, s = 1024, b = 2.

Each case times ``fused=True`` (the kernel) and ``fused=False`` (the reference) of the same op in
``megatron.fused_kernels``: forward, then the gradients of every input (``torch.autograd.grad``, not accumulated
into ``.grad``) for an upstream gradient of ones made before the clock starts (the op's caller makes it, for either
side; the cross-entropy's fresh fp32 logits likewise), median of ``--repeats`` runs after one warm-up, the two sides
alternating run by run. ``bias_gelu_mlp`` is bias + GeLU as ``ParallelMLP`` calls it on CPU (``overwrite_grad``: the
backward writes the input gradient over the upstream one); ``bias_gelu`` is the default call. On CPU the times are
taken with glibc's allocator defaults (what a large CPU run gets), or with ``--cpu-allocator reuse`` under the
setting of ``TRIDENT_CPU_ALLOCATOR=reuse`` (see ``megatron.launch.cpu_allocator``: freed memory is kept, so
outputs are not page-faulted in again every call).
GB/s counts the bytes the op must read and write at least once (inputs, outputs, gradients) over the fused time.
Peak extra memory, measured first with glibc's defaults: on CUDA ``max_memory_allocated`` above the inputs; on CPU
the peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) above the inputs, which sees tensors of
32 MB and more (the ones that matter here: glibc maps those directly and returns them on free).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron import fused_kernels as fk
from megatron.launch.cpu_allocator import keep_freed_memory

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Step:
    """One side of a case: ``prepare`` (untimed: clear the grads, make the upstream gradient, as the op's caller
    would have it) and ``run`` (timed: forward, then backward of that gradient)."""

    prepare: Callable[[], None]
    run: Callable[[], None]


@dataclass
class Result:
    """One op at one shape."""

    op: str
    shape: str
    reference_ms: float
    fused_ms: float
    speedup: float
    fused_gb_s: float
    reference_extra_mb: float
    fused_extra_mb: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _current_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _time_pair(ref: Step, fused: Step, device: torch.device, repeats: int) -> tuple[float, float]:
    """Median ms of ``ref`` and of ``fused`` (forward + backward; the upstream gradient is made before the clock
    starts) after one warm-up each (first-use kernel loading); the two alternate run by run, so a slow spell of a
    shared machine hits both sides alike."""
    times: dict[int, list[float]] = {0: [], 1: []}
    for rep in range(repeats + 1):
        for side in (0, 1) if rep % 2 == 0 else (1, 0):
            step = (ref, fused)[side]
            step.prepare()
            _sync(device)
            t0 = time.perf_counter()
            step.run()
            _sync(device)
            if rep > 0:
                times[side].append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def _peak_extra_mb(step: Step, device: torch.device) -> float:
    """Peak MB of one forward + backward above what was live before it, the upstream gradient included in the
    inputs (after one warm-up)."""
    step.prepare()
    step.run()
    _sync(device)
    step.prepare()
    _sync(device)
    base = _current_bytes(device)
    _peak_reset(device)
    step.run()
    _sync(device)
    return max(0, _peak_bytes(device) - base) / 2**20


def _leaf(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()


@dataclass
class Case:
    """One op at one shape, built once for both sides: ``call(fused)`` is the forward, ``params`` the inputs whose
    gradients backward makes (read when it runs: ``before`` may replace them), ``moved`` the bytes the op must read
    and write at least once (fwd + bwd)."""

    call: Callable[[bool], torch.Tensor]
    params: list[torch.Tensor]
    moved: int
    before: Callable[[], None] | None = None
    """Untimed, before each run: what the op's caller makes fresh every step (the cross-entropy's logits)."""


def _numel_esize(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    numel = 1
    for d in shape:
        numel *= d
    return numel, torch.empty(0, dtype=dtype).element_size()


def _norm_case(op: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Case:
    numel, esize = _numel_esize(shape, dtype)
    x, h = _leaf(shape, dtype, device, 1), shape[-1]
    gamma, beta = _leaf((h,), dtype, device, 2), _leaf((h,), dtype, device, 3)
    if op == "layer_norm":
        call = lambda fused: fk.layer_norm(x, gamma, beta, 1e-5, fused=fused)  # noqa: E731
        params = [x, gamma, beta]
    else:
        call = lambda fused: fk.rms_norm(x, gamma, 1e-5, fused=fused)  # noqa: E731
        params = [x, gamma]
    return Case(call, params, moved=5 * numel * esize)  # x, y; dy, x again, dx


def _softmax_case(
    op: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> Case:
    numel, esize = _numel_esize(shape, dtype)
    x = _leaf(shape, dtype, device, 1)
    scale = 0.125
    if op == "causal_softmax":
        call = lambda fused: fk.scaled_upper_triang_masked_softmax(x, scale, fused=fused)  # noqa: E731
    else:
        b, n, sq, sk = shape
        gen = torch.Generator().manual_seed(4)
        mask = (torch.rand(b, 1, sq, sk, generator=gen) < 0.3).to(device)
        call = lambda fused: fk.scaled_masked_softmax(x, mask, scale, fused=fused)  # noqa: E731
    return Case(call, [x], moved=5 * numel * esize)  # x, y; dy, y, dx


def _bias_activation_case(
    op: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> Case:
    numel, esize = _numel_esize(shape, dtype)
    x = _leaf(shape, dtype, device, 1)
    bias = _leaf((shape[-1],), dtype, device, 2)
    if op == "bias_swiglu":
        call = lambda fused: fk.bias_swiglu(x, bias, fused=fused)  # noqa: E731
    else:  # bias_gelu_mlp: as ParallelMLP calls it (backward writes over the gradient it is handed)
        mlp = op == "bias_gelu_mlp"
        call = lambda fused: fk.bias_gelu(x, bias, fused=fused, overwrite_grad=mlp)  # noqa: E731
    out = numel // 2 if op == "bias_swiglu" else numel
    return Case(call, [x, bias], moved=(2 * numel + 2 * out + numel) * esize)  # x, y; dy, x, dx


def _rope_case(op: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Case:
    from megatron.model.rotary import rotary_cos_sin

    numel, esize = _numel_esize(shape, dtype)
    s, b, n, hn = shape
    x = _leaf(shape, dtype, device, 1)
    pos = torch.arange(s, device=device).repeat(b, 1)
    cos, sin = rotary_cos_sin(pos, hn, 10000.0, dtype)
    call = lambda fused: fk.rope(x, cos, sin, fused=fused)  # noqa: E731
    return Case(call, [x], moved=4 * numel * esize)  # x, y; dy, dx


def _cross_entropy_case(
    op: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> Case:
    from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy

    numel, _ = _numel_esize(shape, dtype)
    n, v = shape
    z = _leaf((n, 1, v), dtype, device, 1)
    gen = torch.Generator().manual_seed(5)
    target = torch.randint(0, v, (n, 1), generator=gen).to(device)
    held: list[torch.Tensor] = [z]

    def fresh_logits() -> (
        None
    ):  # a fresh fp32 buffer, as the model hands the loss (made before the clock)
        held[:] = [z.detach().float() if dtype != torch.float32 else z.detach().clone()]
        held[0].requires_grad_()

    def call(fused: bool) -> torch.Tensor:
        kernels = fk.cross_entropy_kernels(held[0]) if fused else None
        return vocab_parallel_cross_entropy(held[0], target, local_kernels=kernels)

    # logits read twice (stats, gradient pass), gradient written once
    return Case(call, held, moved=3 * numel * 4, before=fresh_logits)


_CASES: dict[str, Callable[[str, tuple[int, ...], torch.dtype, torch.device], Case]] = {
    "layer_norm": _norm_case,
    "rms_norm": _norm_case,
    "causal_softmax": _softmax_case,
    "masked_softmax": _softmax_case,
    "bias_gelu": _bias_activation_case,
    "bias_gelu_mlp": _bias_activation_case,
    "bias_swiglu": _bias_activation_case,
    "rope": _rope_case,
    "cross_entropy": _cross_entropy_case,
}
"""op -> the builder of its :class:`Case`."""


def _case(
    op: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[Callable[[bool], Step], int]:
    """``make(fused) -> step`` and the bytes the op must move once (fwd + bwd)."""
    if op not in _CASES:
        raise ValueError(f"unknown op {op!r}")
    case = _CASES[op](op, shape, dtype, device)
    with torch.no_grad():
        probe = case.call(False)
    out_shape, out_dtype = probe.shape, probe.dtype
    del probe

    def make(fused: bool) -> Step:
        upstream: list[torch.Tensor] = []

        def prepare() -> None:
            if case.before is not None:
                case.before()
            upstream[:] = [torch.ones(out_shape, dtype=out_dtype, device=device)]

        def run() -> None:
            y = case.call(fused)
            # every input gradient, not accumulated into .grad (no leaf's accumulation is part of the op)
            torch.autograd.grad(y, list(case.params), upstream.pop())

        return Step(prepare, run)

    return make, case.moved


def cases(small: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(op, shape) of the benchmark: GPT-2 124M and LLaMA-7B-like rows."""
    tok = 1024 * 8 // (8 if small else 1)  # s * b of GPT-2 124M
    tok7 = 1024 * 2 // (8 if small else 1)
    s = 1024 // (4 if small else 1)
    return [
        ("layer_norm", (tok, 768)),
        ("rms_norm", (tok, 768)),
        ("rms_norm", (tok7, 4096)),
        ("causal_softmax", (8 * 12 // (8 if small else 1), s, s)),
        ("masked_softmax", (8 // (8 if small else 1), 12, s, s)),
        ("bias_gelu", (tok, 3072)),
        ("bias_gelu_mlp", (tok, 3072)),
        ("bias_swiglu", (tok7, 2 * 11008)),
        ("rope", (1024 // (8 if small else 1), 8, 12, 64)),
        ("rope", (1024 // (8 if small else 1), 2, 32, 128)),
        ("cross_entropy", (tok, 50304)),
    ]


def run(
    *,
    device: torch.device,
    dtype: torch.dtype,
    ops: set[str] | None,
    repeats: int,
    small: bool,
    cpu_allocator: str = "system",
) -> list[Result]:
    """Time every case (fused and reference); ``ops`` None means all.

    Peak memory is measured first, for every case, with glibc's allocator defaults (the resident-set peak only sees
    memory that is mapped for a step and returned after it). On CPU the times are then taken with glibc's defaults
    (``cpu_allocator`` 'system', what a large CPU run gets) or with ``TRIDENT_CPU_ALLOCATOR=reuse``'s setting ('reuse':
    freed memory is kept, so a step does not page-fault its outputs in again); both sides of a ratio run under the
    same setting.
    """
    chosen = [(op, shape) for op, shape in cases(small) if ops is None or op in ops]
    built = [(op, shape, *_case(op, shape, dtype, device)) for op, shape in chosen]
    peaks = [
        (_peak_extra_mb(make(False), device), _peak_extra_mb(make(True), device))
        for *_, make, _m in built
    ]
    if device.type == "cpu" and cpu_allocator == "reuse":
        keep_freed_memory({"TRIDENT_CPU_ALLOCATOR": "reuse"})
    out = []
    for (op, shape, make, moved), (ref_mb, fused_mb) in zip(built, peaks, strict=True):
        ref_ms, fused_ms = _time_pair(make(False), make(True), device, repeats)
        out.append(
            Result(
                op=op,
                shape="x".join(map(str, shape)),
                reference_ms=round(ref_ms, 3),
                fused_ms=round(fused_ms, 3),
                speedup=round(ref_ms / fused_ms, 2),
                fused_gb_s=round(moved / (fused_ms / 1e3) / 1e9, 2),
                reference_extra_mb=round(ref_mb, 1),
                fused_extra_mb=round(fused_mb, 1),
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--ops", default=None, help="comma-separated op names (default: all)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)"
    )
    parser.add_argument("--small", action="store_true", help="1/8 of the tokens (quick look)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--cpu-allocator",
        default="system",
        choices=["system", "reuse"],
        help="CPU times with glibc's defaults (a large run's) or TRIDENT_CPU_ALLOCATOR=reuse's setting (freed memory "
        "kept: what the default 'auto' picks for a small run)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if fk.extension(device.type) is None:
        parser.error(f"no fused kernels for {device.type}: {fk.status()[device.type]}")
    ops = set(args.ops.split(",")) if args.ops else None
    results = run(
        device=device,
        dtype=DTYPES[args.dtype],
        ops=ops,
        repeats=args.repeats,
        small=args.small,
        cpu_allocator=args.cpu_allocator,
    )
    header = f"{'op':16} {'shape':20} {'ref ms':>9} {'fused ms':>9} {'speedup':>8} {'GB/s':>7}"
    allocator = f", CPU allocator {args.cpu_allocator}" if device.type == "cpu" else ""
    print(f"# fused kernels ({fk.status()[device.type]}), {args.dtype}, {device}{allocator}")  # noqa: T201
    print(header + f" {'ref MB':>8} {'fused MB':>9}")  # noqa: T201
    for r in results:
        print(  # noqa: T201
            f"{r.op:16} {r.shape:20} {r.reference_ms:9.2f} {r.fused_ms:9.2f} {r.speedup:7.2f}x "
            f"{r.fused_gb_s:7.1f} {r.reference_extra_mb:8.1f} {r.fused_extra_mb:9.1f}"
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
