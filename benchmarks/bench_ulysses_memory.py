"""DeepSpeed-Ulysses memory benchmark: activation memory per rank at a long sequence for SP = 1, 2, 4.

    python -m benchmarks.bench_ulysses_memory                        # seq 8192, 4 layers x 64 wide, 8 heads; N = 1 2 4
    python -m benchmarks.bench_ulysses_memory --sizes 1 2 --seq-length 16384 --json out.json

Not a test: a measurement. For each N, N gloo ranks (one process each) build the same tiny GPT-2-style model with
``--ds-sequence-parallel-size N`` (``GPTModel`` with the run's Ulysses group; SDPA attention), take their ``s/N``
slice of one micro-batch (``data.batch.slice_sequence``) and run one forward + backward with the whole-sequence
loss (``loss_func`` over the Ulysses group).

What "activation memory" is here, measured exactly on CPU: the bytes autograd keeps from the forward for the
backward. Every tensor saved for backward passes through ``torch.autograd.graph.saved_tensors_hooks``; the hook
records its storage once (several saved views of one buffer count once) and skips the parameters' storages. Their
sum at the end of the forward is the activation memory of the step (what Ulysses divides by N); unlike RSS it does
not depend on the allocator's caching or on what the process mapped before. The peak RSS rise over the step
(``VmHWM`` after a ``/proc/self/clear_refs`` reset) is reported next to it, as a coarse cross-check: it also holds
transient buffers (the all-to-all copies, the logits, the attention kernel's workspace) and allocator slack.

Expected: per rank, about ``1/N`` of the N = 1 bytes. Everything outside attention is per token (``s/N`` tokens per
rank), and the attention's saved q, k, v and output are ``[s, b, n/N, hn]`` after the all-to-all, again ``1/N`` of
the bytes. One buffer per layer is extra under Ulysses: at N = 1 the output projection's saved input is a view of
the attention output autograd keeps anyway (SDPA's CPU output is laid out ``[b, s, n, hn]``, so the reshape to
``[s, b, h]`` copies nothing), while under Ulysses the reverse all-to-all makes a new ``[s/N, b, h]`` buffer, so
both are kept: ``+[s/N, h]`` per layer. Measured (defaults: seq 8192, 4 layers x 64, 8 heads, vocab 512, fp32,
this machine)::

      N  tokens/rank  activations/rank  vs N=1  ideal   peak RSS rise  vs N=1
      1         8192         149.7 MiB   1.000  1.000       191.5 MiB   1.000
      2         4096          78.9 MiB   0.527  0.500       137.6 MiB   0.719
      4         2048          39.5 MiB   0.264  0.250        75.6 MiB   0.395

(26 ``[s, h]``-sized units per layer-and-head at N = 1, 27 ``[s/N, h]`` units at N > 1: 0.527 = 27/(2 x 26) at
N = 2 within 0.3 %.) The RSS rise falls more slowly: it also holds the process's transient buffers and allocator
slack, which do not all scale with ``s/N``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from megatron.launch.spawn import spawn_local_ranks

MiB = 2**20


def _vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _rank(sp: int, flags: list[str], seed: int) -> dict[str, Any]:
    """One rank: build the model, run one step on its sequence slice, return its measurements."""
    from dataclasses import replace

    import deepspeed
    import torch

    from megatron import mpu
    from megatron.config import parse_args
    from megatron.data.batch import prepare_gpt_batch, slice_sequence
    from megatron.deepspeed_internals import skip_cpu_shm_build
    from megatron.model import GPTModel, loss_func
    from megatron.mpu.context import ParallelContext

    skip_cpu_shm_build()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    mpu.initialize_model_parallel(1, 1, ds_sequence_parallel_size=sp)
    cfg = parse_args([*flags, "--ds-sequence-parallel-size", str(sp)])
    model_cfg = replace(cfg.model, vocab_size=512)
    model = GPTModel(model_cfg, ParallelContext.from_parallel_state(seed=seed))
    s = model_cfg.seq_length
    text = torch.randint(0, 512, (1, s + 1), generator=torch.Generator().manual_seed(seed))
    batch = prepare_gpt_batch(text, eod=0, skip_mask=True)
    batch = slice_sequence(
        {k: v for k, v in batch.items() if v is not None}, mpu.get_sequence_parallel_rank(), sp
    )
    group = mpu.get_sequence_parallel_group() if sp > 1 else None

    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    torch.distributed.barrier()
    rss_before = _vm_hwm_bytes()
    reset = _reset_peak_rss()
    rss_base = _vm_hwm_bytes()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        # [b, s/N] per-token loss of this rank's slice
        per_token = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
        loss = loss_func(per_token, batch["loss_mask"], sequence_parallel_group=group)
    activation = sum(saved.values())
    loss.backward()
    peak = _vm_hwm_bytes()
    return {
        "rank": torch.distributed.get_rank(),
        "tokens": int(batch["tokens"].shape[1]),
        "activation_bytes": activation,
        "peak_rss_rise_bytes": peak - (rss_base if reset else rss_before),
        "loss": float(loss.item()),
    }


def measure(sizes: list[int], flags: list[str], seed: int = 1234) -> list[dict[str, Any]]:
    """Run every Ulysses size; one row per size with the largest per-rank numbers."""
    rows = []
    for sp in sizes:
        ranks = spawn_local_ranks(_rank, sp, sp, flags, seed, init_process_group=False, timeout=900)
        rows.append(
            {
                "sp": sp,
                "tokens_per_rank": ranks[0]["tokens"],
                "activation_bytes": max(r["activation_bytes"] for r in ranks),
                "peak_rss_rise_bytes": max(r["peak_rss_rise_bytes"] for r in ranks),
                "loss": ranks[0]["loss"],
            }
        )
    base = rows[0]
    for row in rows:
        row["activation_ratio"] = row["activation_bytes"] / base["activation_bytes"]
        row["rss_ratio"] = row["peak_rss_rise_bytes"] / max(1, base["peak_rss_rise_bytes"])
        row["ideal_ratio"] = base["sp"] / row["sp"]
    return rows


def main(argv: list[str] | None = None) -> None:
    """CLI: print a table (and write ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq-length", type=int, default=8192)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--num-attention-heads", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    flags = [
        "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
        "--num-attention-heads", str(a.num_attention_heads), "--seq-length", str(a.seq_length),
        "--max-position-embeddings", str(a.seq_length), "--micro-batch-size", "1", "--train-iters", "1",
        "--mock-data", "--attention-dropout", "0", "--hidden-dropout", "0",
    ]  # fmt: skip
    rows = measure(a.sizes, flags)
    print(
        f"seq {a.seq_length}, {a.num_layers} layers x {a.hidden_size}, {a.num_attention_heads} heads, fp32"
    )
    print(
        "  N  tokens/rank  activations/rank (MiB)  vs N=1  ideal 1/N  peak RSS rise (MiB)  vs N=1  loss"
    )
    for r in rows:
        print(
            f"{r['sp']:>3}  {r['tokens_per_rank']:>11}  {r['activation_bytes'] / MiB:>22.1f}  "
            f"{r['activation_ratio']:>6.3f}  {r['ideal_ratio']:>9.3f}  {r['peak_rss_rise_bytes'] / MiB:>19.1f}  "
            f"{r['rss_ratio']:>6.3f}  {r['loss']:.6f}"
        )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
