"""Training benchmark: Trident vs a plain Hugging Face GPT-2 loop (tokens/s), and ZeRO 0-3 memory per rank at DP=4.

    python -m tools.bench_train                      # both parts, small defaults for a CPU box
    python -m tools.bench_train --skip-memory --threads 2 --iters 30

Not a test: the numbers depend on the machine. See megatron/training/benchmark.py for what is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from megatron.training import benchmark

BUCKET_KEYS = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads for both trainers")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192, help="multiple of 128: no padding difference")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--memory-dp", type=int, default=4)
    a = p.parse_args(argv)
    benchmark.cpu_env_defaults()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    import torch

    torch.set_num_threads(a.threads)
    if not a.skip_throughput:
        shape = [
            "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
            "--num-attention-heads", str(a.num_attention_heads), "--seq-length", str(a.seq_length),
            "--max-position-embeddings", str(a.seq_length),
        ]  # fmt: skip
        ours = benchmark.trident_tokens_per_sec(
            [
                *shape,
                "--micro-batch-size",
                str(a.batch),
                "--global-batch-size",
                str(a.batch),
                "--train-iters",
                str(a.iters),
                "--lr",
                "1e-4",
                "--lr-decay-style",
                "constant",
                "--mock-data",
                "--vocab-size",
                str(a.vocab - 1),
                "--attention-dropout",
                "0",
                "--hidden-dropout",
                "0",
                "--eval-iters",
                "0",
                "--log-level",
                "WARNING",
            ],  # fmt: skip
            a.warmup,
        )
        hf = benchmark.hf_tokens_per_sec(
            num_layers=a.num_layers,
            hidden=a.hidden_size,
            heads=a.num_attention_heads,
            seq=a.seq_length,
            vocab=a.vocab,
            batch=a.batch,
            iters=a.iters,
            warmup=a.warmup,
            lr=1e-4,
            seed=1234,
        )
        print(
            f"threads {a.threads}: trident {ours:.0f} tokens/s, HF GPT2LMHeadModel+AdamW {hf:.0f} tokens/s, "
            f"ratio {ours / hf:.2f}x"
        )
    if not a.skip_memory:
        # DeepSpeed's default reduce bucket (5e8 elements = 1.9 GiB in fp32) is allocated up front by ZeRO-3 and
        # would dwarf a 50M model; use 5e6-element buckets (a user --deepspeed_config key Trident does not own).
        ds_json = Path(tempfile.mkdtemp()) / "buckets.json"
        ds_json.write_text(json.dumps({"zero_optimization": dict.fromkeys(BUCKET_KEYS, 5_000_000)}))
        # ~50M parameters: 8 x 640 (39M in the layers) + 16384 x 640 tied embedding (10.5M).
        rows = benchmark.zero_memory(
            [
                "--deepspeed_config",
                str(ds_json),
                "--num-layers",
                "8",
                "--hidden-size",
                "640",
                "--num-attention-heads",
                "10",
                "--seq-length",
                "128",
                "--max-position-embeddings",
                "128",
                "--micro-batch-size",
                "1",
                "--global-batch-size",
                str(a.memory_dp),
                "--train-iters",
                "2",
                "--mock-data",
                "--vocab-size",
                "16383",
                "--attention-dropout",
                "0",
                "--hidden-dropout",
                "0",
                "--log-level",
                "WARNING",
            ],  # fmt: skip
            dp=a.memory_dp,
        )
        print(benchmark.format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
