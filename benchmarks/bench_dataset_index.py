"""Benchmark GPT index building (C++ extension vs NumPy fallback) on synthetic document sizes; prints a table.

Not a test. Documents have uniform random lengths in [1, 2 * mean) (default mean 1000 tokens), so 1e9 tokens is
about 1e6 documents; ``sample_idx`` then has tokens / seq_length rows. Timed per configuration: the whole
``compute_gpt_indices`` (doc_idx shuffle + sample_idx + shuffle_idx) and ``build_sample_idx`` alone, on each path;
then Megatron's greedy blending for ``--blend-samples``.

    python -m benchmarks.bench_dataset_index --tokens 1e8 1e9 --seq-length 2048 --numpy-max-tokens 1e9
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from megatron.data import helpers
from megatron.data.blendable_dataset import compute_blending_indices
from megatron.data.gpt_dataset import build_doc_idx, compute_gpt_indices


def _timed(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=float, nargs="+", default=[1e8, 1e9], help="tokens per epoch")
    p.add_argument("--seq-length", type=int, nargs="+", default=[2048])
    p.add_argument("--mean-doc-length", type=int, default=1000)
    p.add_argument("--epochs", type=float, default=1.0, help="samples requested, in epochs")
    p.add_argument(
        "--numpy-max-tokens",
        type=float,
        default=1e9,
        help="skip the NumPy path above this many tokens",
    )
    p.add_argument(
        "--blend-samples", type=float, nargs="*", default=[1e6], help="blend sizes to time"
    )
    p.add_argument("--repeat", type=int, default=1, help="best of N runs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not helpers.HAVE_CPP_HELPERS:
        print(
            "note: megatron.data._helpers is not built; only the NumPy path is timed",
            file=sys.stderr,
        )
    rng = np.random.default_rng(0)
    header = f"{'tokens':>8} {'docs':>9} {'seq':>5} {'samples':>11} {'path':>6} {'sample_idx s':>13} {'all idx s':>10}"
    print(header)
    print("-" * len(header))
    for tokens in args.tokens:
        num_docs = max(1, int(tokens) // args.mean_doc_length)
        sizes = rng.integers(1, 2 * args.mean_doc_length, num_docs).astype(np.int32)
        documents = np.arange(num_docs, dtype=np.int32)
        tpe = int(sizes.sum(dtype=np.int64))
        for seq in args.seq_length:
            num_samples = int(args.epochs * (tpe - 1) // seq)
            doc_idx = build_doc_idx(documents, 1, np.random.RandomState(1), False)
            paths = [
                p
                for p, ok in (
                    ("c++", helpers.HAVE_CPP_HELPERS),
                    ("numpy", tokens <= args.numpy_max_tokens),
                )
                if ok
            ]
            for path in paths:
                use_cpp = path == "c++"
                t_sample, sample_idx = _timed(
                    partial(helpers.build_sample_idx, sizes, doc_idx, seq, 1, tpe, use_cpp=use_cpp),
                    args.repeat,
                )
                t_all, _ = _timed(
                    partial(
                        compute_gpt_indices,
                        documents,
                        sizes,
                        num_samples,
                        seq,
                        1234,
                        use_cpp=use_cpp,
                    ),
                    args.repeat,
                )
                print(
                    f"{tokens:8.0e} {num_docs:9,d} {seq:5d} {len(sample_idx) - 1:11,d} {path:>6} "
                    f"{t_sample:13.3f} {t_all:10.3f}"
                )
    if args.blend_samples:
        print()
        header = f"{'blend samples':>13} {'datasets':>8} {'path':>6} {'seconds':>8}"
        print(header)
        print("-" * len(header))
        weights = np.array([0.5, 0.3, 0.15, 0.05])
        for size in args.blend_samples:
            paths = (["c++"] if helpers.HAVE_CPP_HELPERS else []) + ["numpy"]
            for path in paths:
                t, _ = _timed(
                    partial(compute_blending_indices, weights, int(size), use_cpp=path == "c++"),
                    args.repeat,
                )
                print(f"{size:13.0e} {len(weights):8d} {path:>6} {t:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
