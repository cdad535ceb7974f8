"""Context-parallel memory benchmark: the longest sequence one machine trains at CP 1 vs CP 4, from real steps.

    python -m benchmarks.bench_cp_longest                          # CP 1 and 4; seq 4k .. 48k; ~25 min here
    python -m benchmarks.bench_cp_longest --cp-sizes 4 --seq-lengths 8192 16384 --json out.json

Not a test: a measurement. Every point is a fresh spawn of ``N`` gloo ranks (one process each) running
``megatron.training.pretrain`` (the real DeepSpeed engine, mock data) on a small LLaMA-style model
(``presets.LLAMA_FLAGS``: RMSNorm, SwiGLU, RoPE, no biases, untied output; by default 2 layers x 256, 8 query heads
in 2 K/V groups, FFN 704, vocabulary 2,048, fp32, micro-batch 1, global batch 1, attention dropout 0, Adam, no
activation recomputation) at ``--context-parallel-size N`` for one or two iterations. The attention is torch's SDPA
at CP 1 (the CPU flash kernel: memory linear in the sequence) and the K/V ring of ``model/context_parallel.py`` at
CP > 1 (tiles and online softmax: memory linear as well).

Measured per rank: the peak RSS of the whole process (``VmHWM`` at the end: Python, torch, DeepSpeed, the model,
Adam, the activations: what has to fit in memory), with glibc's mmap threshold fixed at 64 KiB before anything is
allocated (each tensor buffer mapped on its own and unmapped when freed, so the RSS follows the live tensors, as in
``bench_packed_attention``) and ``TRIDENT_CPU_ALLOCATOR=system`` (no heap kept for reuse). The machine total is the
sum over the ranks: an upper bound, the libraries' shared pages (``RssFile``, reported) are counted once per rank.
The step time is the last iteration's (sequence / tokens per second of the metrics file); two iterations where the
estimate is short (the first one pays one-time set-up), one where it is long.

Before each point its step time is estimated from the previous point at the same CP (scaled by ``(s / s_prev)^2``,
the attention's growth, an upper bound); a point over ``--max-step-s`` is skipped and listed. The longest sequence
that fits ``--memory-gib`` less ``--headroom-gib`` is then found by a least-squares line through the measured peaks
(memory is linear in the sequence on both paths) of the points with at least ``--fit-min-tokens-per-rank`` tokens
per rank (below that the process's peak is the start-up's, ~450 MiB per rank at CP 4 here, not the step's): of
the per-rank peak at CP 1, of the machine total at CP 4, and of the largest per-rank peak at CP 4 (the cluster
case, one rank per device of that memory: derived, not run).
Measured on this machine: ``docs/context-parallelism.md``, section "Memory".
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from megatron.launch.spawn import spawn_local_ranks

MiB = 2**20
GiB = 2**30
SPAWN_S = 40.0
"""Seconds a spawn costs besides the steps (imports, engine build), added to a point's estimate."""
TWO_ITERS_UNDER_S = 30.0
"""A point whose estimated step is shorter runs two iterations and reports the second."""


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _map_every_buffer() -> None:
    """glibc: every allocation of 64 KiB or more mapped on its own and unmapped on free (``M_MMAP_THRESHOLD``)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def model_flags(seq_length: int, cp: int, iters: int, a: argparse.Namespace) -> list[str]:
    """The ``pretrain`` flags of one point."""
    from megatron.model.presets import LLAMA_FLAGS

    return [
        *LLAMA_FLAGS,
        "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
        "--num-attention-heads", str(a.heads), "--num-key-value-heads", str(a.kv_heads),
        "--ffn-hidden-size", str(a.ffn_hidden_size), "--vocab-size", str(a.vocab_size),
        "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", str(iters),
        "--lr", "1e-4", "--seed", "1234", "--mock-data", "--context-parallel-size", str(cp),
        "--eval-interval", "1000", "--eval-iters", "0", "--log-interval", "1", "--log-level", "WARNING",
    ]  # fmt: skip


def _rank(argv: list[str], metrics: str) -> dict[str, Any]:
    """One rank of one point: ``pretrain`` in this fresh process, then its peak RSS."""
    _map_every_buffer()
    os.environ["TRIDENT_CPU_ALLOCATOR"] = "system"
    from megatron.config import parse_args
    from megatron.training import pretrain

    start_kib = _status_kib("VmRSS")
    result = pretrain(parse_args([*argv, "--metrics-file", metrics]))
    if result.exit_code != 0:
        raise RuntimeError(f"pretrain exited with {result.exit_code}")
    return {
        "peak_rss_bytes": _status_kib("VmHWM") * 1024,
        "rss_file_bytes": _status_kib("RssFile") * 1024,
        "start_rss_bytes": start_kib * 1024,
        "loss": result.losses[-1],
    }


def measure_point(cp: int, seq_length: int, iters: int, a: argparse.Namespace) -> dict[str, Any]:
    """``cp`` ranks train ``iters`` steps at ``seq_length``: per-rank peaks, their sum, the last step's time."""
    from megatron.training.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        metrics = str(Path(tmp) / "m.jsonl")
        argv = model_flags(seq_length, cp, iters, a)
        ranks = spawn_local_ranks(_rank, cp, argv, metrics, init_process_group=False, timeout=1800)
        train, _ = read_metrics(metrics)
    peaks = [r["peak_rss_bytes"] for r in ranks]
    return {
        "cp": cp,
        "seq_length": seq_length,
        "iterations": iters,
        "peak_rss_per_rank_bytes": peaks,
        "peak_rss_max_bytes": max(peaks),
        "machine_total_bytes": sum(peaks),
        "rss_file_max_bytes": max(r["rss_file_bytes"] for r in ranks),
        "start_rss_max_bytes": max(r["start_rss_bytes"] for r in ranks),
        "step_s": seq_length / train[-1]["tokens_per_sec"],
        "loss": ranks[0]["loss"],
    }


def estimate_step_s(done: list[dict[str, Any]], seq_length: int) -> float | None:
    """The step time at ``seq_length`` from the longest measured point: scaled by the square of the length ratio
    (the attention's growth; an upper bound, the rest grows linearly); None before any point."""
    if not done:
        return None
    last = max(done, key=lambda r: r["seq_length"])
    return float(last["step_s"] * (seq_length / last["seq_length"]) ** 2)


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line ``y = intercept + slope * x``: (intercept, slope); at least two distinct ``xs``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("linear_fit: needs at least two distinct x values")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


def longest_fitting(intercept: float, slope: float, budget: float, multiple: int) -> int:
    """The longest sequence, a multiple of ``multiple``, with ``intercept + slope * s <= budget`` (0 if none)."""
    if slope <= 0 or intercept > budget:
        return 0
    return int((budget - intercept) / slope) // multiple * multiple


def run_cp(cp: int, a: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every length of ``--seq-lengths`` at ``cp`` in turn: (measured rows, skipped points with their estimate)."""
    done: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for seq_length in sorted(a.seq_lengths):
        estimate = estimate_step_s(done, seq_length)
        if estimate is not None and estimate > a.max_step_s:
            skipped.append({"cp": cp, "seq_length": seq_length, "estimated_step_s": estimate})
            continue
        iters = a.iterations or (2 if estimate is None or estimate < TWO_ITERS_UNDER_S else 1)
        row = measure_point(cp, seq_length, iters, a)
        row["estimated_step_s"] = estimate
        done.append(row)
        _print_row(row)
    return done, skipped


def longest(rows: list[dict[str, Any]], key: str, budget: float, multiple: int) -> dict[str, Any]:
    """The fit of ``key`` over ``rows`` and the longest sequence under ``budget`` bytes."""
    xs = [float(r["seq_length"]) for r in rows]
    ys = [float(r[key]) for r in rows]
    intercept, slope = linear_fit(xs, ys)
    s = longest_fitting(intercept, slope, budget, multiple)
    return {
        "of": key,
        "points": list(zip(xs, ys, strict=True)),
        "intercept_bytes": intercept,
        "bytes_per_token": slope,
        "longest_seq_length": s,
        "measured_up_to": int(max(xs)),
        "extrapolated": s > max(xs),
    }


def _print_row(r: dict[str, Any]) -> None:
    per_rank = " ".join(f"{b / MiB:,.0f}" for b in r["peak_rss_per_rank_bytes"])
    print(
        f"  CP {r['cp']}  seq {r['seq_length']:>7,}  peak RSS/rank (MiB) [{per_rank}]  "
        f"machine {r['machine_total_bytes'] / MiB:>8,.0f} MiB  step {r['step_s']:>7.1f} s "
        f"({r['iterations']} it; est. {r['estimated_step_s'] or 0:.0f} s)  loss {r['loss']:.4f}",
        flush=True,
    )


def _print_fit(label: str, fit: dict[str, Any]) -> None:
    kind = "extrapolated" if fit["extrapolated"] else "measured"
    print(
        f"  {label}: {fit['intercept_bytes'] / MiB:,.0f} MiB + {fit['bytes_per_token'] / 1024:.2f} KiB/token "
        f"over {len(fit['points'])} points -> longest {fit['longest_seq_length']:,} tokens ({kind}; "
        f"measured up to {fit['measured_up_to']:,})"
    )


def main(argv: list[str] | None = None) -> None:
    """CLI: measure, print the rows and the longest sequences (and write ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument(
        "--seq-lengths", type=int, nargs="+", default=[4096, 8192, 16384, 24576, 32768, 49152]
    )
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn-hidden-size", type=int, default=704)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument(
        "--memory-gib", type=float, default=24.0, help="the machine's (or a device's) memory"
    )
    ap.add_argument("--headroom-gib", type=float, default=2.0)
    ap.add_argument(
        "--max-step-s", type=float, default=300.0, help="skip a point estimated to step longer"
    )
    ap.add_argument(
        "--fit-min-tokens-per-rank",
        type=int,
        default=2048,
        help="fit only points with this many tokens per rank or more (below, the start-up's peak is the peak)",
    )
    ap.add_argument(
        "--iterations", type=int, default=0, help="iterations per point (0: two if short, else one)"
    )
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    budget = (a.memory_gib - a.headroom_gib) * GiB
    print(
        f"LLaMA-style, {a.num_layers} layers x {a.hidden_size}, {a.heads} heads / {a.kv_heads} KV, FFN "
        f"{a.ffn_hidden_size}, vocab {a.vocab_size}, fp32, b 1, Adam; budget {budget / GiB:.1f} GiB",
        flush=True,
    )
    result: dict[str, Any] = {"rows": [], "skipped": [], "longest": {}}
    for cp in a.cp_sizes:
        rows, skipped = run_cp(cp, a)
        result["rows"] += rows
        result["skipped"] += skipped
        for s in skipped:
            print(
                f"  CP {cp}  seq {s['seq_length']:,}: skipped, step estimated {s['estimated_step_s']:.0f} s"
            )
        fit_rows = [r for r in rows if r["seq_length"] // cp >= a.fit_min_tokens_per_rank]
        if len(fit_rows) < 2:
            continue
        fits = {f"cp{cp} machine total": longest(fit_rows, "machine_total_bytes", budget, 2 * cp)}
        if cp > 1:
            fits[f"cp{cp} per rank (one rank per device, derived)"] = longest(
                fit_rows, "peak_rss_max_bytes", budget, 2 * cp
            )
        for label, fit in fits.items():
            _print_fit(label, fit)
        result["longest"].update(fits)
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
