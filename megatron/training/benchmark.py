"""Training benchmarks behind ``tools/bench_train.py`` (a script, not a test: numbers depend on the machine).

1. Throughput: the same tiny GPT-2 (TP = 1, one process) trained by Trident (``pretrain``: DeepSpeed engine, our
   model, Megatron data path) and by a plain loop over Hugging Face ``GPT2LMHeadModel`` + ``torch.optim.AdamW``
   (same layers, width, heads, sequence, vocabulary, batch, clipping and thread count; dropout 0). Median tokens/s
   over the iterations after a warm-up.
2. ZeRO memory: a ~50M-parameter GPT (fp32 + Adam) at DP = 4 for ZeRO 0, 1, 2, 3. Per rank, the bytes of all live
   tensors (deduplicated by storage) right after backward and right after the optimizer step; the peak of the two
   is the model + gradient + optimizer memory. On CUDA also ``torch.cuda.max_memory_allocated``. ZeRO theory for
   Psi parameters on N ranks (fp32 Adam, 4 + 4 + 8 bytes/param): stage 0 16 Psi, 1: 8 Psi + 8 Psi/N, 2: 4 Psi +
   12 Psi/N, 3: 16 Psi/N (plus DeepSpeed's flat buffers, fp32 partition copies and communication buckets).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


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


def hf_tokens_per_sec(
    *,
    num_layers: int,
    hidden: int,
    heads: int,
    seq: int,
    vocab: int,
    batch: int,
    iters: int,
    warmup: int,
    lr: float,
    seed: int,
) -> float:
    """The plain HF GPT-2 loop at the same shapes; median tokens/s after ``warmup``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron.data.mock_dataset import MockGPTDataset

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=hidden,
        n_layer=num_layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    data = MockGPTDataset(iters * batch, seq, vocab, seed)
    rates = []
    for it in range(iters):
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
    return _median_tail(rates, warmup)


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
    """One rank of the ZeRO memory benchmark (run by ``run_distributed`` with ``init_process_group=False``)."""
    from megatron import mpu
    from megatron.config import parse_args
    from megatron.model import loss_func
    from megatron.training import initialize, preflight
    from megatron.training.model_setup import build_engine

    cfg = parse_args(argv)
    pre = preflight(cfg)
    device = initialize.init_distributed(cfg)
    initialize.set_seeds(cfg.training.seed)
    gc.collect()
    base = live_tensor_bytes()
    bundle = build_engine(
        cfg,
        pre.ds_config,
        true_vocab=pre.tokenizer.vocab_size,
        device=device,
        world_size=pre.world_size,
    )
    engine = bundle.engine
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    b, s = cfg.training.micro_batch_size, cfg.model.seq_length
    g = torch.Generator().manual_seed(mpu.get_data_parallel_rank())
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
    from megatron.testing import run_distributed

    rows = []
    for stage in (0, 1, 2, 3):
        per_rank = run_distributed(
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
