"""Attention memory benchmark: packed documents without a dense mask, and what the CP ring saves per rank.

    python -m benchmarks.bench_packed_attention                      # both parts, defaults below
    python -m benchmarks.bench_packed_attention --part packed --seq-length 8192 --json out.json
    python -m benchmarks.bench_packed_attention --part ring --cp-sizes 1 2 4 --ring-seq-length 32768

Not a test: a measurement (minutes; the dense path of part 1 needs several GiB).

Part 1, packed documents: one forward + backward of the core attention alone over a ``--seq-length`` packed
sequence (``b = 1``, documents of random lengths 100 .. 4000 tokens, ``--heads`` heads of ``--head-dim``, fp32),
each path in a fresh process:

* ``dense``: ``reference_attention`` with the ``[b, 1, s, s]`` mask of ``--reset-attention-mask``
  (``data.batch.get_ltor_masks_and_position_ids``), the path a packed batch took before;
* ``block``: ``context_attention`` with the documents' ids (``model/block_attention.py``: tiles, online softmax).

Part 2, the ring: ``N`` gloo ranks (one process each) run ``context_attention`` over their load-balanced
``S/N`` tokens of a ``--ring-seq-length`` causal sequence, forward and backward, for each ``N`` of ``--cp-sizes``.

What is measured, per process: ``saved`` the bytes autograd keeps from the forward for the backward (every tensor
through ``torch.autograd.graph.saved_tensors_hooks``, each storage once, the inputs q, k, v included: exact, and
what the attention adds to a layer's activations); ``peak`` the peak RSS rise over forward + backward (``VmHWM``
after a ``/proc/self/clear_refs`` reset): the attention's whole working set, transient buffers included. To make
that a measure of tensors rather than of the allocator, each process first sets glibc's mmap threshold to 64 KiB
(every tensor buffer is mapped when allocated and unmapped when freed, so freed memory is not kept resident and
reused unseen) before anything else; the reset comes once the inputs exist. Repeated runs then agree within 1 %,
and the peak grows linearly with the sequence on the block path (16.7 / 24.9 / 41.1 / 73.9 MiB at 4k / 8k / 16k /
32k tokens, 2 heads). And the forward and backward wall times, from a second set of fresh processes with the
allocator as it is (page faults on every mapping slow the memory run down; ``OMP_NUM_THREADS`` as set, 1 in our
runs; on a shared machine they vary). Every process first runs one unmeasured 512-token forward + backward (BLAS,
allocator and gloo set-up).

Measured on this machine (2 shared cores, OMP_NUM_THREADS=1): see ``docs/context-parallelism.md``, section "The
ring exchange".
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron.launch.spawn import spawn_local_ranks

MiB = 2**20
EOD = 0
WARM_UP = 512
"""Tokens of a first, unmeasured forward + backward in every process (one-time set-up: ~60 MiB of RSS)."""


def _vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _map_every_buffer() -> None:
    """Make glibc map each allocation of 64 KiB or more on its own and unmap it on free (``M_MMAP_THRESHOLD``,
    which also stops the threshold's growth), so the RSS follows the live tensors instead of the allocator's cache
    of freed memory; a no-op where glibc is not the C library."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not permitted: the rise is then measured from the peak so far
        pass


def _packed_tokens(seq_length: int, seed: int) -> Any:
    """``[1, S]`` token ids: documents of 100 .. 4000 tokens, each closed by an EOD (the last one cut)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 1000, (1, seq_length), generator=g)
    end = 0
    while True:
        end += int(torch.randint(100, 4001, (1,), generator=g))
        if end > seq_length:
            return tokens
        tokens[0, end - 1] = EOD


def _inputs(seq_length: int, heads: int, head_dim: int, seed: int) -> tuple[Any, ...]:
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (seq_length, 1, heads, head_dim)  # [s, b, np, hn]
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    grad_out = torch.randn(seq_length, 1, heads * head_dim, generator=g)
    return q, k, v, grad_out


def _measure(fn: Any, q: Any, k: Any, v: Any, grad_out: Any) -> dict[str, Any]:
    """Forward + backward of ``fn(q, k, v) -> [s, b, np*hn]``: saved bytes, peak RSS rise, times, output."""
    import torch

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    _reset_peak_rss()
    base = _vm_hwm_bytes()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*leaves)
    middle = time.perf_counter()
    out.backward(grad_out)
    end = time.perf_counter()
    return {
        "saved_bytes": sum(saved.values()),
        "peak_rss_rise_bytes": _vm_hwm_bytes() - base,
        "forward_s": middle - start,
        "backward_s": end - middle,
        "out": out.detach(),
        "grads": [x.grad for x in leaves],
    }


def _timed_and_measured(run: Callable[[bool], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """``run(memory)`` twice, fresh processes each: the memory from ``run(True)`` (every buffer mapped on its own,
    which costs time in page faults), the times from ``run(False)`` (the allocator as it is)."""
    timed = run(False)
    rows = run(True)
    for row, times in zip(rows, timed, strict=True):
        row.update(forward_s=times["forward_s"], backward_s=times["backward_s"])
    return rows


def _packed_fn(path: str, tokens: Any) -> Any:
    """``fn(q, k, v) -> [s, b, np*hn]``: the attention of ``path`` over the packed ``tokens [1, s]``."""
    from megatron.data.batch import get_ltor_masks_and_position_ids
    from megatron.model.attention import reference_attention
    from megatron.model.context_parallel import context_attention
    from megatron.model.token_layout import PackedDocuments, document_ids

    if path == "dense":
        # [1, 1, s, s] bool, True = masked (--reset-attention-mask)
        mask, _, _ = get_ltor_masks_and_position_ids(tokens, EOD, False, True, False)
        return lambda q, k, v: reference_attention(q, k, v, attention_mask=mask)
    documents = PackedDocuments(document_ids(tokens, EOD))
    return lambda q, k, v: context_attention(q, k, v, documents=documents, group=None)


def _packed_path(  # noqa: PLR0913 (the benchmark's knobs)
    path: str, seq_length: int, heads: int, head_dim: int, seed: int, memory: bool
) -> dict[str, Any]:
    """One path of part 1 in this (fresh) process: the measurements and a sample of the results."""
    if memory:
        _map_every_buffer()
    small = _packed_tokens(WARM_UP, seed)  # the BLAS and allocator set-up, once, before measuring
    _measure(_packed_fn(path, small), *_inputs(WARM_UP, heads, head_dim, seed))
    tokens = _packed_tokens(seq_length, seed)
    row = _measure(_packed_fn(path, tokens), *_inputs(seq_length, heads, head_dim, seed))
    row.update(path=path, documents=int((tokens == EOD).sum()) + 1)
    # a sample of rows to compare the paths (the whole would be large), as numpy: torch tensors sent back share
    # file descriptors that die with this process
    row["out"] = row["out"][::97].numpy().copy()
    row["grads"] = [g[::97].numpy().copy() for g in row["grads"]]
    return row


def measure_packed(
    seq_length: int, heads: int, head_dim: int, seed: int = 1234
) -> list[dict[str, Any]]:
    """Part 1: both paths, each in a fresh process; the block path's largest deviation from the dense one."""

    def run(memory: bool) -> list[dict[str, Any]]:
        return [
            spawn_local_ranks(
                _packed_path,
                1,
                path,
                seq_length,
                heads,
                head_dim,
                seed,
                memory,
                init_process_group=False,
                timeout=3600,
            )[0]
            for path in ("dense", "block")
        ]

    rows = _timed_and_measured(run)
    dense, block = rows
    pairs = [(dense["out"], block["out"]), *zip(dense["grads"], block["grads"], strict=True)]
    block["max_abs_diff_vs_dense"] = max(float(abs(a - b).max()) for a, b in pairs)
    for row in rows:
        del row["out"], row["grads"]
    return rows


def _ring_rank(  # noqa: PLR0913 (the benchmark's knobs)
    seq_length: int, heads: int, kv_heads: int, head_dim: int, seed: int, memory: bool
) -> dict[str, Any]:
    """One rank of part 2: its load-balanced shard through the ring (the world is the CP group)."""
    if memory:
        _map_every_buffer()
    import torch.distributed as dist

    from megatron.model.context_parallel import context_attention
    from megatron.model.token_layout import load_balanced_positions

    n, r = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD if n > 1 else None

    def fn(q: Any, k: Any, v: Any) -> Any:
        return context_attention(q, k, v, documents=None, group=group)

    def shard(length: int) -> list[Any]:
        q, k, v, grad_out = _inputs(length, heads, head_dim, seed)
        k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]  # [S, b, np, hn] -> [S, b, gp, hn]
        mine = load_balanced_positions(length, n, r)
        return [x[mine].contiguous() for x in (q, k, v, grad_out)]  # [S, ...] -> [S/N, ...]

    _measure(fn, *shard(WARM_UP))  # the BLAS, allocator and gloo connections set up, once
    inputs = shard(seq_length)
    dist.barrier()
    row = _measure(fn, *inputs)
    del row["out"], row["grads"]
    row.update(rank=r, tokens=int(inputs[0].shape[0]))
    return row


def measure_ring(
    sizes: list[int], seq_length: int, heads: int, kv_heads: int, head_dim: int, seed: int = 1234
) -> list[dict[str, Any]]:
    """Part 2: per CP size, the largest per-rank numbers."""
    rows = []
    for n in sizes:

        def run(memory: bool, n: int = n) -> list[dict[str, Any]]:
            args = (seq_length, heads, kv_heads, head_dim, seed, memory)
            return spawn_local_ranks(_ring_rank, n, *args, timeout=3600)

        ranks = _timed_and_measured(run)
        row: dict[str, Any] = {"cp": n, "tokens_per_rank": ranks[0]["tokens"]}
        for key in ("saved_bytes", "peak_rss_rise_bytes", "forward_s", "backward_s"):
            row[key] = max(rank[key] for rank in ranks)
        rows.append(row)
    for row in rows:
        row["saved_ratio"] = row["saved_bytes"] / rows[0]["saved_bytes"]
        row["ideal_ratio"] = rows[0]["cp"] / row["cp"]
    return rows


def _print_packed(rows: list[dict[str, Any]], a: argparse.Namespace) -> None:
    print(
        f"packed: seq {a.seq_length}, {rows[0]['documents']} documents, {a.heads} heads x {a.head_dim}, "
        "b 1, fp32, forward + backward of the attention"
    )
    print("  path   saved (MiB)  peak RSS rise (MiB)  forward (s)  backward (s)")
    for r in rows:
        print(
            f"  {r['path']:<5}  {r['saved_bytes'] / MiB:>11.1f}  {r['peak_rss_rise_bytes'] / MiB:>19.1f}  "
            f"{r['forward_s']:>11.2f}  {r['backward_s']:>12.2f}"
        )
    print(f"  block vs dense: max abs difference {rows[1]['max_abs_diff_vs_dense']:.2e}")


def _print_ring(rows: list[dict[str, Any]], a: argparse.Namespace) -> None:
    print(
        f"ring: seq {a.ring_seq_length} causal, {a.heads} heads / {a.kv_heads} KV heads x {a.head_dim}, "
        "b 1, fp32, per rank (largest)"
    )
    print(
        "  CP  tokens/rank  saved (MiB)  vs CP=1  ideal  peak RSS rise (MiB)  forward (s)  backward (s)"
    )
    for r in rows:
        print(
            f"  {r['cp']:>2}  {r['tokens_per_rank']:>11}  {r['saved_bytes'] / MiB:>11.2f}  "
            f"{r['saved_ratio']:>6.3f}  {r['ideal_ratio']:>5.3f}  {r['peak_rss_rise_bytes'] / MiB:>19.1f}  "
            f"{r['forward_s']:>11.2f}  {r['backward_s']:>12.2f}"
        )


def main(argv: list[str] | None = None) -> None:
    """CLI: print the tables (and write ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["packed", "ring", "both"], default="both")
    ap.add_argument("--seq-length", type=int, default=16384, help="part 1: packed sequence")
    ap.add_argument("--ring-seq-length", type=int, default=16384, help="part 2: causal sequence")
    ap.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument(
        "--kv-heads", type=int, default=2, help="part 2: K/V heads (GQA when < --heads)"
    )
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    result: dict[str, Any] = {}
    if a.part in ("packed", "both"):
        result["packed"] = measure_packed(a.seq_length, a.heads, a.head_dim)
        _print_packed(result["packed"], a)
    if a.part in ("ring", "both"):
        result["ring"] = measure_ring(
            a.cp_sizes, a.ring_seq_length, a.heads, a.kv_heads, a.head_dim
        )
        _print_ring(result["ring"], a)
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
