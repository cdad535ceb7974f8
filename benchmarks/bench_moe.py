"""MoE benchmark: step time of a DeepSpeed-MoE model at EP = 2 vs the dense model of equal ACTIVE parameters (CPU).

    python -m benchmarks.bench_moe                         # 2 ranks, small defaults for a CPU box
    python -m benchmarks.bench_moe --experts 8 --iters 20 --hidden 256

Not a test: the numbers depend on the machine. Both runs are ``pretrain`` on 2 spawned gloo ranks (DP 2), the same
LLaMA-style model (SwiGLU, RMSNorm, RoPE), sequence, global batch and thread count; dropout 0, fp32:

* MoE: every layer's MLP is a DeepSpeed-MoE layer of E experts of FFN width f, top-2, expert-parallel over the 2
  ranks (``--moe-expert-parallel-size 2``, E/2 experts per rank), token dropping off.
* Dense: FFN width 2f, so each token goes through as many MLP parameters as in the MoE model (2 experts x f).

Reported: median seconds per iteration after a warm-up, tokens/s, and total vs active parameter counts. The MoE
step also pays the gate, the capacity padding and two all-to-alls per layer, which the dense step does not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from megatron.launch.spawn import spawn_local_ranks


def _step_seconds(argv: list[str], warmup: int) -> tuple[float, float] | None:
    """Run ``pretrain`` on this rank; (median seconds per iteration, median tokens/s) after ``warmup`` on the rank
    that writes the metrics file, None on the others."""
    from megatron.config import parse_args
    from megatron.training import pretrain
    from megatron.training.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        result = pretrain(parse_args([*argv, "--metrics-file", str(metrics)]))
        if result.exit_code != 0:
            raise RuntimeError(f"pretrain exited with {result.exit_code}")
        if not metrics.is_file():
            return None
        train, _ = read_metrics(metrics)
    rates = [r["tokens_per_sec"] for r in train][warmup:]
    tokens = int(argv[argv.index("--global-batch-size") + 1]) * int(
        argv[argv.index("--seq-length") + 1]
    )
    rate = statistics.median(rates)
    return tokens / rate, rate


def _argv(a: argparse.Namespace, *, moe: bool) -> list[str]:
    ffn = a.ffn if moe else 2 * a.ffn
    args = [
        "--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", "4",
        "--ffn-hidden-size", str(ffn), "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq),
        "--swiglu", "--normalization", "rmsnorm", "--use-rotary-position-embeddings", "--no-position-embedding",
        "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--micro-batch-size", str(a.micro_batch), "--global-batch-size", str(2 * a.micro_batch),
        "--train-iters", str(a.iters), "--lr", "1e-4", "--mock-data", "--vocab-size", "1000", "--seed", "1",
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000", "--log-level", "WARNING",
    ]  # fmt: skip
    if moe:
        args += [
            "--num-experts", str(a.experts), "--expert-interval", "1", "--topk", "2",
            "--moe-expert-parallel-size", "2", "--disable-moe-token-dropping",
            "--disable-moe-top2-2nd-expert-sampling",
        ]  # fmt: skip
    return args


def _params(a: argparse.Namespace) -> dict[str, int]:
    """Parameter counts of the MLPs (what differs): total MoE, active MoE per token, dense."""
    expert = 3 * a.hidden * a.ffn  # SwiGLU: [2f, h] + [h, f]
    gate = a.experts * a.hidden
    return {
        "moe_mlp_total": a.layers * (a.experts * expert + gate),
        "moe_mlp_active_per_token": a.layers * (2 * expert + gate),
        "dense_mlp": a.layers * 2 * expert,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256, help="FFN width f of one expert (dense: 2f)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args(argv)
    out: dict[str, object] = {"params": _params(a)}
    for name, moe in (("dense", False), ("moe_ep2", True)):
        per_rank = spawn_local_ranks(
            _step_seconds, 2, _argv(a, moe=moe), a.warmup, init_process_group=False, timeout=1800
        )
        seconds, rate = next(r for r in per_rank if r is not None)
        out[name] = {"seconds_per_iter": round(seconds, 4), "tokens_per_sec": round(rate, 1)}
    out["moe_over_dense_step_time"] = round(
        out["moe_ep2"]["seconds_per_iter"] / out["dense"]["seconds_per_iter"],
        3,  # type: ignore[index]
    )
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
