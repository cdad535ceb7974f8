"""Stress checks of every fused op against its PyTorch reference, at the shapes and in the situations the unit tests
do not reach: large shapes, unaligned inputs, side streams, CUDA-graph capture, run-to-run determinism, NaN.

    python -m benchmarks.gpu_stress --device cuda                          # large shapes, bf16 and fp32
    python -m benchmarks.gpu_stress --device cpu                           # small shapes: the same logic on CPU
    python -m benchmarks.gpu_stress --device cuda --size tiny --checks reference   # compute-sanitizer's case

Checks, for each op and dtype (``scripts/gpu_check.sh`` runs this as its stress step):

- ``reference``: the kernel (``fused=True``) against the reference evaluated in float64, forward and every input
  gradient, at ``--size`` shapes (large: hidden 8k and 16k, a 128k vocabulary shard, sequence 4k). Error
  ``max|kernel - reference| / max|reference|`` per tensor, bound :data:`TOL` (looser than the unit tests' bounds:
  sums over 16k columns or 128k vocabulary entries in another order).
- ``unaligned``: odd sizes (1023 columns, 32003 vocabulary entries, sequence 127), the floating inputs once at
  storage offset 1 (no vector alignment) and once as non-contiguous slices of wider tensors; the same bound.
- ``determinism``: two kernel runs on the same inputs give bitwise equal outputs and gradients.
- ``nan``: a NaN in the first input reaches the same rows of the output and gradients as in the reference (a
  kernel that drops NaN hides a diverged run from the NaN guard).
- ``stream`` (CUDA): the kernel on a side stream, its inputs written on that stream just before the call (after a
  GPU sleep, so a kernel launched on another stream would read them unwritten), equals the default-stream result
  bitwise.
- ``graph`` (CUDA): forward and backward captured in a CUDA graph, replayed on new inputs, equal the eager run
  bitwise.

One line per check as it finishes (``op check dtype VERDICT detail``), then one JSON line with the counts and the
failed checks (``--json FILE``: every result). Exit status 0 when no check failed, 1 when one did, 2 when the
device has no kernels (nothing to compare). Not a test of this machine's speed: see ``bench_kernels``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron import fused_kernels as fk
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}
SIZES = ("large", "small", "tiny")
CHECKS = ("reference", "unaligned", "determinism", "nan", "stream", "graph")
Shape = tuple[int, ...]


@dataclass(frozen=True)
class Op:
    """A fused op as the checks see it: ``make(shape, dtype, device, seed)`` builds its inputs (the first ``grads``
    are the differentiable ones), ``forward(inputs, fused)`` runs it; ``shapes`` maps a size (and ``odd``) to the
    shape ``make`` takes."""

    name: str
    make: Callable[[Shape, torch.dtype, torch.device, int], list[torch.Tensor]]
    forward: Callable[[list[torch.Tensor], bool], torch.Tensor]
    grads: int
    shapes: dict[str, Shape]


def _randn(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def _norm_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> list:
    h = shape[-1]
    gamma = 1.0 + 0.1 * _randn((h,), dtype, device, seed + 1)
    return [_randn(shape, dtype, device, seed), gamma, 0.1 * _randn((h,), dtype, device, seed + 2)]


def _plain_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> list:
    return [_randn(shape, dtype, device, seed)]


def _masked_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> list:
    b, _, sq, sk = shape
    gen = torch.Generator().manual_seed(seed + 1)
    mask = torch.rand(b, 1, sq, sk, generator=gen) < 0.3
    mask[..., 0] = False  # column 0 is never masked (the NaN check puts its NaN there) ...
    mask[0, 0, -1, :] = True  # ... except in one fully masked row (zeros, not NaN)
    return [_randn(shape, dtype, device, seed), mask.to(device)]


def _bias_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> list:
    return [_randn(shape, dtype, device, seed), _randn(shape[-1:], dtype, device, seed + 1)]


def _rope_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> list:
    s, _, _, hn = shape
    d = hn - hn % 4 if hn % 4 else hn  # odd head dims rotate a prefix (partial rotary)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.arange(s, dtype=torch.float32)[:, None] * inv_freq  # [s, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [s, d/2] -> [s, 1, 1, d]
    cos, sin = (t.to(device=device, dtype=dtype) for t in (emb.cos(), emb.sin()))
    return [_randn(shape, dtype, device, seed), cos, sin]


def _ce_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int) -> list:
    n, vp = shape
    gen = torch.Generator().manual_seed(seed + 1)
    target = torch.randint(0, vp, (n, 1), generator=gen).to(device)
    return [_randn((n, 1, vp), dtype, device, seed) * 3.0, target]


def _ce_forward(inputs: list[torch.Tensor], fused: bool) -> torch.Tensor:
    z, target = inputs
    # the fused backward writes the gradient over the logits it is given: hand it a fresh fp32 buffer, as the model
    buf = z.float() if z.dtype != torch.float32 else z.clone()  # [N, 1, vp]
    kernels = fk.cross_entropy_kernels(buf) if fused else None
    return vocab_parallel_cross_entropy(buf, target, local_kernels=kernels)  # [N, 1]


OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op(
            "layer_norm",
            _norm_inputs,
            lambda t, f: fk.layer_norm(t[0], t[1], t[2], 1e-5, fused=f),
            3,
            {"large": (2048, 16384), "small": (64, 320), "tiny": (4, 64), "odd": (37, 1023)},
        ),
        Op(
            "rms_norm",
            lambda *a: _norm_inputs(*a)[:2],
            lambda t, f: fk.rms_norm(t[0], t[1], 1e-5, fused=f),
            2,
            {"large": (4096, 8192), "small": (64, 320), "tiny": (4, 64), "odd": (37, 1023)},
        ),
        Op(
            "causal_softmax",
            _plain_inputs,
            lambda t, f: fk.scaled_upper_triang_masked_softmax(t[0], 0.125, fused=f),
            1,
            {
                "large": (4, 4096, 4096),
                "small": (4, 64, 64),
                "tiny": (2, 16, 16),
                "odd": (3, 127, 127),
            },
        ),
        Op(
            "masked_softmax",
            _masked_inputs,
            lambda t, f: fk.scaled_masked_softmax(t[0], t[1], 0.125, fused=f),
            1,
            {
                "large": (1, 4, 4096, 4096),
                "small": (2, 3, 32, 48),
                "tiny": (1, 2, 8, 16),
                "odd": (2, 3, 61, 127),
            },
        ),
        Op(
            "bias_gelu",
            _bias_inputs,
            lambda t, f: fk.bias_gelu(t[0], t[1], fused=f),
            2,
            {"large": (2048, 16384), "small": (64, 512), "tiny": (4, 64), "odd": (37, 1001)},
        ),
        Op(
            "bias_swiglu",
            _bias_inputs,
            lambda t, f: fk.bias_swiglu(t[0], t[1], fused=f),
            2,
            {"large": (2048, 28672), "small": (64, 512), "tiny": (4, 64), "odd": (37, 1002)},
        ),
        Op(
            "rope",
            _rope_inputs,
            lambda t, f: fk.rope(t[0], t[1], t[2], fused=f),
            1,
            {
                "large": (4096, 1, 32, 128),
                "small": (32, 2, 4, 32),
                "tiny": (4, 1, 2, 16),
                "odd": (31, 3, 5, 34),
            },
        ),
        Op(
            "cross_entropy",
            _ce_inputs,
            _ce_forward,
            1,
            {"large": (1024, 131072), "small": (64, 1000), "tiny": (4, 128), "odd": (37, 32003)},
        ),
    )
}
"""op name -> :class:`Op`. Large shapes: hidden 16k (LayerNorm) and 8k (RMSNorm), sequence 4k (softmax, RoPE),
SwiGLU width 14336 (LLaMA-70B-like), a 128k vocabulary shard."""


@dataclass(frozen=True)
class Setting:
    """Where a check runs: device, dtype and the size of its shapes."""

    device: torch.device
    dtype: torch.dtype
    size: str


def fwd_bwd(op: Op, inputs: list[torch.Tensor], fused: bool) -> list[torch.Tensor]:
    """``[output, grad of each differentiable input]`` for a seeded upstream gradient (inputs keep their strides)."""
    leaves = [t.detach().requires_grad_() for t in inputs[: op.grads]]
    y = op.forward(leaves + inputs[op.grads :], fused)
    upstream = _randn(tuple(y.shape), y.dtype, y.device, 7)
    return [y.detach(), *torch.autograd.grad(y, leaves, upstream)]


def _in_float64(op: Op, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.double() if i < op.grads else t for i, t in enumerate(inputs)]


def rel_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[float, str]:
    """The largest ``max|got - want| / max|want|`` over the tensors, and a note naming a non-finite one."""
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.shape != w.shape:
            return math.inf, f"tensor {i}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
        if not torch.isfinite(g).all():
            return math.inf, f"tensor {i} (0 = output, then input grads) has non-finite values"
        scale = max(w.double().abs().max().item(), 1e-30) if w.numel() else 1.0
        diff = (g.double() - w.double()).abs().max().item() if w.numel() else 0.0
        worst = max(worst, diff / scale)
    return worst, ""


def _compare(op: Op, inputs: list[torch.Tensor], dtype: torch.dtype) -> tuple[str, str]:
    err, note = rel_error(fwd_bwd(op, inputs, True), fwd_bwd(op, _in_float64(op, inputs), False))
    ok = err <= TOL[dtype]
    return ("PASS" if ok else "FAIL"), note or f"rel. error {err:.2e} (bound {TOL[dtype]:.0e})"


def _shaped(op: Op, st: Setting, size: str, seed: int = 0) -> list[torch.Tensor]:
    return op.make(op.shapes[size], st.dtype, st.device, seed)


def check_reference(op: Op, st: Setting) -> tuple[str, str]:
    verdict, detail = _compare(op, _shaped(op, st, st.size), st.dtype)
    return verdict, f"{'x'.join(map(str, op.shapes[st.size]))}: {detail}"


def _at_offset(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values at storage offset 1 (its data pointer off every vector alignment)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a non-contiguous slice of a tensor 3 columns wider."""
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype, device=t.device)
    out = wide[..., 1 : 1 + t.shape[-1]]
    out.copy_(t)
    return out


def check_unaligned(op: Op, st: Setting) -> tuple[str, str]:
    base = _shaped(op, st, "odd")
    notes, verdict = [], "PASS"
    for name, move in (("offset", _at_offset), ("strided", _strided)):
        moved = [move(t) if i < op.grads else t for i, t in enumerate(base)]
        v, detail = _compare(op, moved, st.dtype)
        verdict = "FAIL" if v == "FAIL" else verdict
        notes.append(f"{name} {detail}")
    return verdict, f"{'x'.join(map(str, op.shapes['odd']))}: " + "; ".join(notes)


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[str, str]:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if not torch.equal(x, y):  # NaN never equals itself: the inputs here have none
            diff = (x.double() - y.double()).abs().max().item()
            return (
                "FAIL",
                f"tensor {i} (0 = output, then input grads) differs, max |diff| {diff:.2e}",
            )
    return "PASS", f"bitwise equal ({len(a)} tensors)"


def check_determinism(op: Op, st: Setting) -> tuple[str, str]:
    inputs = _shaped(op, st, st.size)
    return _bitwise(fwd_bwd(op, inputs, True), fwd_bwd(op, inputs, True))


def _nan_rows(t: torch.Tensor) -> set[int]:
    """Rows (every dim but the last, flattened) holding a NaN."""
    flat = torch.isnan(t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1))
    return set(torch.nonzero(flat.any(dim=-1)).flatten().tolist())


def check_nan(op: Op, st: Setting) -> tuple[str, str]:
    inputs = _shaped(op, st, "odd")
    x = inputs[0].clone()
    x.view(-1)[0] = float("nan")  # row 0, column 0 (never masked)
    inputs = [x, *inputs[1:]]
    got = fwd_bwd(op, inputs, True)
    want = fwd_bwd(op, _in_float64(op, inputs), False)
    if not _nan_rows(want[0]):
        return "FAIL", "the reference output has no NaN row (the check could not see a drop)"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        # a gradient that does not depend on x (LayerNorm's beta, RoPE's) has no NaN in either
        rows_g, rows_w = _nan_rows(g), _nan_rows(w)
        if rows_g != rows_w:
            lost = sorted(rows_w - rows_g)[:5]
            return (
                "FAIL",
                f"tensor {i}: NaN rows {len(rows_g)} vs reference {len(rows_w)} (lost {lost})",
            )
    return "PASS", f"NaN in the reference's rows of all {len(got)} tensors"


def check_stream(op: Op, st: Setting) -> tuple[str, str]:
    inputs = _shaped(op, st, st.size)
    want = fwd_bwd(op, inputs, True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is not None:
            sleep(50_000_000)  # ~25 ms of GPU time before the inputs are written on this stream
        fresh = [t.clone() for t in inputs]
        got = fwd_bwd(op, fresh, True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return _bitwise(got, want)


def check_graph(op: Op, st: Setting) -> tuple[str, str]:
    static = _shaped(op, st, "small", seed=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    # warm-up outside the capture (first-use allocations, kernel loading)
    with torch.cuda.stream(side):
        for _ in range(2):
            fwd_bwd(op, static, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fwd_bwd(op, static, True)
    new = _shaped(op, st, "small", seed=1)
    with torch.no_grad():
        for s, n in zip(static, new, strict=True):
            s.copy_(n)
    graph.replay()
    torch.cuda.synchronize()
    return _bitwise([t.clone() for t in captured], fwd_bwd(op, new, True))


CHECK_FNS: dict[str, Callable[[Op, Setting], tuple[str, str]]] = {
    "reference": check_reference,
    "unaligned": check_unaligned,
    "determinism": check_determinism,
    "nan": check_nan,
    "stream": check_stream,
    "graph": check_graph,
}


def run_check(check: str, op: Op, st: Setting) -> tuple[str, str]:
    """(verdict, detail) of one check; an exception is a FAIL naming it, CUDA-only checks SKIP on CPU."""
    if check in ("stream", "graph") and st.device.type != "cuda":
        return "SKIP", "CUDA only"
    try:
        return CHECK_FNS[check](op, st)
    except Exception as exc:  # noqa: BLE001 - a crash of one check is that check's result
        text = str(exc).strip().splitlines()
        return "FAIL", f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def run(ops: list[str], checks: list[str], dtypes: list[str], *, device: str, size: str) -> list:
    """Every (op, check, dtype); prints one line per check as it finishes and returns the results."""
    results = []
    for dtype in dtypes:
        st = Setting(torch.device(device), DTYPES[dtype], size)
        for name in ops:
            for check in checks:
                verdict, detail = run_check(check, OPS[name], st)
                print(f"{name:15} {check:12} {dtype:5} {verdict:5} {detail}", flush=True)
                results.append(
                    {
                        "op": name,
                        "check": check,
                        "dtype": dtype,
                        "verdict": verdict,
                        "detail": detail,
                    }
                )
    return results


def summary(results: list[dict], device: str, size: str) -> dict:
    """Counts per verdict and the failed checks (``op/check/dtype``)."""
    count = {v: sum(r["verdict"] == v for r in results) for v in ("PASS", "FAIL", "SKIP")}
    failed = [f"{r['op']}/{r['check']}/{r['dtype']}" for r in results if r["verdict"] == "FAIL"]
    return {"device": device, "size": size, **count, "failed_checks": failed}


def _choices(
    parser: argparse.ArgumentParser, text: str, allowed: tuple[str, ...] | dict, flag: str
) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in allowed]
    if bad or not names:
        parser.error(
            f"{flag} {text!r}: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(allowed)}"
        )
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--size", choices=SIZES, help="default: large on CUDA, small on CPU")
    parser.add_argument(
        "--dtypes", help="comma-separated (default: bf16,fp32 on CUDA, fp32 on CPU)"
    )
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated op names")
    parser.add_argument("--checks", default=",".join(CHECKS), help="comma-separated check names")
    parser.add_argument("--json", type=Path, help="also write every result here")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible (use --device cpu)")
    dtypes = _choices(parser, args.dtypes or ("bf16,fp32" if cuda else "fp32"), DTYPES, "--dtypes")
    ops = _choices(parser, args.ops, OPS, "--ops")
    checks = _choices(parser, args.checks, CHECKS, "--checks")
    if args.json and not args.json.parent.is_dir():
        parser.error(
            f"--json {args.json}: no folder {args.json.parent}; create it or choose another path"
        )
    if fk.extension(args.device) is None:
        parser.error(f"no fused kernels for {args.device}: {fk.status()[args.device]}")
    size = args.size or ("large" if cuda else "small")
    print(f"# gpu_stress on {args.device} ({fk.status()[args.device]}), size {size}", flush=True)
    results = run(ops, checks, dtypes, device=args.device, size=size)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    report = summary(results, args.device, size)
    print(json.dumps(report), flush=True)
    return 1 if report["FAIL"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
