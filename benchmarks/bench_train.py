"""Training benchmark: Trident vs a plain Hugging Face GPT-2 loop (tokens/s), and ZeRO 0-3 memory per rank at DP=4.

    python -m benchmarks.bench_train                      # both parts, small defaults for a CPU box
    python -m benchmarks.bench_train --skip-memory --threads 2 --iters 30

Not a test: the numbers depend on the machine. What is measured:

1. Throughput: the same tiny GPT-2 (TP = 1, one process) trained by Trident (``pretrain``: DeepSpeed engine, our
   model, Megatron data path) and by a plain loop over Hugging Face ``GPT2LMHeadModel`` + ``torch.optim.AdamW``
   (same layers, width, heads, sequence, vocabulary, batch, clipping and thread count; dropout 0). Median tokens/s
   over the iterations after a warm-up. The HF loop runs in fresh processes, twice: as a plain loop (glibc's
   allocator defaults) and with the setting of ``TRIDENT_CPU_ALLOCATOR=reuse`` (``megatron.launch.cpu_allocator``;
   Trident's own run follows that variable: by default ``auto``, which picks ``reuse`` for a model this small), so
   that Trident with the setting can be compared without its share. ``--rounds N`` repeats the three runs N times,
   one after the other, and prints the median ratios: on a shared machine a single round's ratio moves by several
   per cent.
2. ZeRO memory: a ~50M-parameter GPT (fp32 + Adam) at DP = 4 for ZeRO 0, 1, 2, 3. Per rank, the bytes of all live
   tensors (deduplicated by storage) right after backward and right after the optimizer step; the peak of the two
   is the model + gradient + optimizer memory. On CUDA also ``torch.cuda.max_memory_allocated``. ZeRO theory for
   Psi parameters on N ranks (fp32 Adam, 4 + 4 + 8 bytes/param): stage 0 16 Psi, 1: 8 Psi + 8 Psi/N, 2: 4 Psi +
   12 Psi/N, 3: 16 Psi/N (plus DeepSpeed's flat buffers, fp32 partition copies and communication buckets).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron.launch.cpu_allocator import keep_freed_memory
from megatron.launch.spawn import spawn_local_ranks

BUCKET_KEYS = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
)


def _median_tail(values: list[float], warmup: int) -> float:
    tail = values[warmup:] if len(values) > warmup else values
    return float(statistics.median(tail))


def trident_tokens_per_sec(argv: list[str], warmup: int) -> float:
    """Run ``pretrain`` in this process on ``argv`` (plus a metrics file); median tokens/s after ``warmup``."""
    from megatron.config import parse_args
    from megatron.training import pretrain
    from megatron.training.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        result = pretrain(
            parse_args([*argv, "--log-interval", "1", "--metrics-file", str(metrics)])
        )
        if result.exit_code != 0:
            raise RuntimeError(f"pretrain exited with {result.exit_code}")
        train, _ = read_metrics(metrics)
    return _median_tail([r["tokens_per_sec"] for r in train], warmup)


@dataclass(frozen=True)
class HFLoop:
    """The plain HF GPT-2 loop: Trident's shapes (layers, width, heads, sequence, vocabulary, batch) and schedule."""

    num_layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    batch: int
    iters: int
    warmup: int
    lr: float = 1e-4
    seed: int = 1234


def hf_tokens_per_sec(loop: HFLoop) -> float:
    """The plain HF GPT-2 loop at the same shapes; median tokens/s after ``loop.warmup``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron.data.mock_dataset import MockGPTDataset

    torch.manual_seed(loop.seed)
    cfg = GPT2Config(
        vocab_size=loop.vocab,
        n_positions=loop.seq,
        n_embd=loop.hidden,
        n_layer=loop.num_layers,
        n_head=loop.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=loop.lr, weight_decay=0.01)
    batch, seq = loop.batch, loop.seq
    data = MockGPTDataset(loop.iters * batch, seq, loop.vocab, loop.seed)
    rates = []
    for it in range(loop.iters):
        text = torch.stack(
            [torch.from_numpy(data[it * batch + j]["text"]) for j in range(batch)]
        )  # [b, s + 1]
        start = time.perf_counter()
        out = model(input_ids=text[:, :-1], labels=text[:, :-1])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rates.append(batch * seq / (time.perf_counter() - start))
    return _median_tail(rates, loop.warmup)


def hf_in_subprocess(args: list[str], allocator: str) -> float:
    """:func:`hf_tokens_per_sec` in a fresh process (glibc's allocator state is per process): ``allocator`` 'system'
    (a plain loop) or 'reuse' (Trident's CPU setting, ``megatron.launch.cpu_allocator``)."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_train", *args, "--hf-only", allocator],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "TRIDENT_CPU_ALLOCATOR": "system"},
    ).stdout
    return float(json.loads(out.strip().splitlines()[-1])["hf_tokens_per_sec"])


def live_tensor_bytes() -> int:
    """Bytes of every live tensor storage in this process (each storage counted once)."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        except Exception:  # noqa: BLE001, S112 - some tensor subclasses refuse storage access
            continue
    return sum(seen.values())


def zero_memory_worker(argv: list[str], steps: int) -> dict[str, Any]:
    """One rank of the ZeRO memory benchmark (run by ``spawn_local_ranks`` with ``init_process_group=False``)."""
    from megatron import mpu
    from megatron.config import parse_args
    from megatron.model import loss_func
    from megatron.training import initialize, preflight
    from megatron.training.model_setup import build_engine

    cfg = parse_args(argv)
    pre = preflight(cfg)
    run = initialize.init_distributed(cfg.parallel)
    device = run.device
    initialize.set_seeds(cfg.training.seed, run.state)
    gc.collect()
    base = live_tensor_bytes()
    bundle = build_engine(cfg.model, cfg.training, cfg.parallel, pre.plan, pre.ds_config, run)
    engine = bundle.engine
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    b, s = cfg.training.micro_batch_size, cfg.model.seq_length
    g = torch.Generator().manual_seed(run.state.get_data_parallel_rank())
    peak = 0
    for _ in range(steps):
        tokens = torch.randint(0, pre.tokenizer.vocab_size, (b, s + 1), generator=g).to(device)
        pos = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
        per_token = engine(tokens[:, :-1], pos, labels=tokens[:, 1:])
        engine.backward(loss_func(per_token, torch.ones_like(per_token)))
        gc.collect()
        peak = max(peak, live_tensor_bytes() - base)
        engine.step()
        gc.collect()
        peak = max(peak, live_tensor_bytes() - base)
    cuda_peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    mpu.destroy_model_parallel()
    return {"params": int(n_params), "peak_tensor_bytes": peak, "cuda_max_allocated": cuda_peak}


def zero_memory(argv: list[str], *, dp: int, steps: int = 2) -> list[dict[str, Any]]:
    """Per-stage result rows of the ZeRO memory benchmark at ``dp`` ranks (TP = PP = 1)."""
    rows = []
    for stage in (0, 1, 2, 3):
        per_rank = spawn_local_ranks(
            zero_memory_worker,
            dp,
            [*argv, "--zero-stage", str(stage)],
            steps,
            init_process_group=False,
            timeout=1800,
        )
        psi = per_rank[0]["params"]
        theory = {
            0: 16 * psi,
            1: 8 * psi + 8 * psi / dp,
            2: 4 * psi + 12 * psi / dp,
            3: 16 * psi / dp,
        }
        rows.append(
            {
                "zero_stage": stage,
                "params": psi,
                "peak_MiB_per_rank": [r["peak_tensor_bytes"] / 2**20 for r in per_rank],
                "theory_MiB": theory[stage] / 2**20,
                "cuda_max_allocated_MiB": [
                    None if r["cuda_max_allocated"] is None else r["cuda_max_allocated"] / 2**20
                    for r in per_rank
                ],
            }
        )
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """JSON lines for the report."""
    return "\n".join(json.dumps(r) for r in rows)


def cpu_env_defaults() -> None:
    """DS_ACCELERATOR=cpu without CUDA (before DeepSpeed is imported)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


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
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="throughput rounds (Trident, then the two HF loops, each round); >1 also prints the median ratios",
    )
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--memory-dp", type=int, default=4)
    p.add_argument(
        "--hf-only",
        choices=["system", "reuse"],
        help="(internal) run only the HF loop, with glibc's defaults or TRIDENT_CPU_ALLOCATOR=reuse's setting; print JSON",
    )
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds must be at least 1, got {a.rounds}")
    cpu_env_defaults()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    torch.set_num_threads(a.threads)
    if a.hf_only:
        if a.hf_only == "reuse":
            keep_freed_memory({"TRIDENT_CPU_ALLOCATOR": "reuse"})
        rate = hf_tokens_per_sec(
            HFLoop(
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
        )
        print(json.dumps({"hf_tokens_per_sec": rate}))
        return 0
    if not a.skip_throughput:
        shape = [
            "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
            "--num-attention-heads", str(a.num_attention_heads), "--seq-length", str(a.seq_length),
            "--max-position-embeddings", str(a.seq_length),
        ]  # fmt: skip
        hf_args = [
            "--threads", str(a.threads), "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
            "--num-attention-heads", str(a.num_attention_heads), "--seq-length", str(a.seq_length),
            "--vocab", str(a.vocab), "--batch", str(a.batch), "--iters", str(a.iters), "--warmup", str(a.warmup),
        ]  # fmt: skip
        ratios: list[tuple[float, float]] = []
        for round_ in range(1, a.rounds + 1):
            ours = trident_tokens_per_sec(
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
            hf = hf_in_subprocess(hf_args, "system")
            hf_reuse = hf_in_subprocess(hf_args, "reuse")
            ratios.append((ours / hf, ours / hf_reuse))
            label = f"round {round_}/{a.rounds}, " if a.rounds > 1 else ""
            print(  # noqa: T201
                f"{label}threads {a.threads}: trident {ours:.0f} tokens/s; HF GPT2LMHeadModel+AdamW, a plain loop: "
                f"{hf:.0f} tokens/s, ratio {ours / hf:.2f}x; the same HF loop with TRIDENT_CPU_ALLOCATOR=reuse's "
                f"setting: {hf_reuse:.0f} tokens/s, ratio {ours / hf_reuse:.2f}x",
                flush=True,
            )
        if a.rounds > 1:
            plain, reuse = (sorted(r[i] for r in ratios) for i in (0, 1))
            print(  # noqa: T201
                f"median of {a.rounds} rounds: {statistics.median(plain):.2f}x vs the plain HF loop (range "
                f"{plain[0]:.2f}-{plain[-1]:.2f}x), {statistics.median(reuse):.2f}x vs the HF loop with the reuse "
                f"setting ({reuse[0]:.2f}-{reuse[-1]:.2f}x)"
            )
    if not a.skip_memory:
        # DeepSpeed's default reduce bucket (5e8 elements = 1.9 GiB in fp32) is allocated up front by ZeRO-3 and
        # would dwarf a 50M model; use 5e6-element buckets (a user --deepspeed_config key Trident does not own).
        ds_json = Path(tempfile.mkdtemp()) / "buckets.json"
        ds_json.write_text(json.dumps({"zero_optimization": dict.fromkeys(BUCKET_KEYS, 5_000_000)}))
        # ~50M parameters: 8 x 640 (39M in the layers) + 16384 x 640 tied embedding (10.5M).
        rows = zero_memory(
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
        print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
