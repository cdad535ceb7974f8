"""ZeRO-3 construction benchmark: peak RSS per rank while a large GPT is built inside ``deepspeed.zero.Init``.

    python -m benchmarks.bench_zero3_build                         # ~700M parameters, DP = 4, 2 iterations
    python -m benchmarks.bench_zero3_build --num-layers 30 --offload --iters 1   # a larger model with CPU offload

Not a test: the numbers depend on the machine. Each of the DP ranks (gloo, one process each):

1. imports everything, creates the process groups, builds nothing: its RSS then is the fixed process overhead;
2. resets its peak RSS (``/proc/self/clear_refs`` 5; where that is refused, a 2 ms sampling thread is used) and
   builds the model (``model_setup.build_model`` with the run's DeepSpeed config: inside ``zero.Init``); the peak
   (``VmHWM``, also sampled) is compared with the bound
   ``overhead + its 1/DP share of the fp32 parameters + one transformer layer in fp32`` (the largest single module,
   the word embeddings, is reported too: it is built whole before anything else exists);
3. builds the engine and trains ``--iters`` iterations of one micro-batch, reporting the peak RSS and the time.

``--offload`` adds ``offload_param`` and ``offload_optimizer`` to the CPU with DeepSpeed's CPU Adam
(``--cpu-optimizer``). On a machine without an accelerator that is where everything lives anyway, so it shows
whether offload costs memory, not whether it saves any.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from megatron.launch.spawn import spawn_local_ranks

MiB = 2**20
ZERO3_TUNING = {
    "reduce_bucket_size": 10_000_000,
    "stage3_prefetch_bucket_size": 10_000_000,
    "stage3_max_live_parameters": 30_000_000,
    "stage3_max_reuse_distance": 10_000_000,
}
"""DeepSpeed JSON keys of every run. DeepSpeed's defaults (a 5e8-element reduce bucket: 2 GB of fp32 per rank,
allocated at the first backward; up to 1e9 gathered parameters kept live) are sized for GPUs with one rank each,
not for four ranks sharing 24 GiB; these keep about one layer (28M parameters here) in flight."""
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_TRIM_THRESHOLD_": "1048576"}
"""glibc settings of every rank (unless already set). By default glibc raises its mmap threshold to the largest
block freed (up to 32 MiB), so ZeRO's freed full-size parameters and partitions of a few MiB come back from the
heap and stay resident after they are freed; with a fixed 1 MiB threshold they are returned to the system. Measured
on a 247M-parameter model at DP = 4: the peak RSS of a rank while training fell from 2781 to 2066 MiB."""


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """This process's resident set size now."""
    return _status_kib("VmRSS") * 1024


def hwm_bytes() -> int:
    """This process's peak resident set size since start or the last :func:`reset_peak`."""
    return _status_kib("VmHWM") * 1024


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class PeakSampler:
    """Samples VmRSS every ``interval`` seconds in a thread; ``peak`` is the largest seen."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak = interval, rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def _largest_module_bytes(cfg: Any, vocab: int) -> dict[str, int]:
    """fp32 bytes of the largest single parameter-owning module (word embeddings vs the biggest linear)."""
    h, f = cfg.model.hidden_size, cfg.model.ffn_size
    n, g, hn = cfg.model.num_attention_heads, cfg.model.num_query_groups, cfg.model.head_dim
    up = f * (2 if cfg.model.swiglu else 1)
    sizes = {
        "word_embeddings": vocab * h,
        "query_key_value": h * (n + 2 * g) * hn,
        "dense_h_to_4h": h * up,
        "dense_4h_to_h": f * h,
    }
    return {k: 4 * v for k, v in sizes.items()}


def worker(argv: list[str], iters: int) -> dict[str, Any]:
    """One rank: overhead, construction peak, engine + ``iters`` iterations (``spawn_local_ranks``)."""
    # everything imported before the overhead is measured (the phases' own imports are then no-ops)
    import deepspeed  # noqa: F401
    import torch  # noqa: F401

    import megatron.model  # noqa: F401
    import megatron.model.utils  # noqa: F401
    import megatron.training.model_setup  # noqa: F401
    from megatron import mpu
    from megatron.config import parse_args
    from megatron.training import initialize, preflight

    cfg = parse_args(argv)
    pre = preflight(cfg)
    run = initialize.init_distributed(cfg.parallel)
    initialize.set_seeds(cfg.training.seed, run.state)
    model, build = _build_phase(cfg, pre, run)
    sys.stdout.write(f"build {json.dumps(build)}\n")  # before training, which may run out of memory
    sys.stdout.flush()
    train = _train_phase(cfg, pre, run, model, iters, log=build["rank"] == 0)
    mpu.destroy_model_parallel()
    return {**build, **train}


def _build_phase(cfg: Any, pre: Any, run: Any) -> tuple[Any, dict[str, Any]]:
    """Steps 1 and 2 of the module docstring: the overhead, then the model built inside ``zero.Init`` and its
    peak against the bound."""
    import gc

    from megatron.model.utils import num_parameters
    from megatron.training.model_setup import build_model

    gc.collect()
    overhead = rss_bytes()
    hwm_reset = reset_peak()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        model = build_model(
            cfg.model,
            cfg.parallel,
            pre.plan,
            run,
            seed=cfg.training.seed,
            ds_config=pre.ds_config,
        )
    build_s = time.perf_counter() - start
    build_hwm = hwm_bytes() if hwm_reset else None
    after_build = rss_bytes()
    dp = run.state.get_data_parallel_world_size()
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    largest = _largest_module_bytes(cfg, pre.plan.padded_vocab_size)
    model_cfg = replace(cfg.model, vocab_size=pre.plan.true_vocab_size)
    layer = 4 * num_parameters(model_cfg)["per_layer"]
    bound = overhead + 4 * n_params / dp + layer
    return model, {
        "rank": run.state.get_data_parallel_rank(),
        "params": int(n_params),
        "full_model_fp32_MiB": 4 * n_params / MiB,
        "overhead_MiB": overhead / MiB,
        "share_fp32_MiB": 4 * n_params / dp / MiB,
        "layer_fp32_MiB": layer / MiB,
        "largest_module_fp32_MiB": {k: v / MiB for k, v in largest.items()},
        "bound_MiB": bound / MiB,
        "build_peak_hwm_MiB": None if build_hwm is None else build_hwm / MiB,
        "build_peak_sampled_MiB": sampler.peak / MiB,
        "after_build_MiB": after_build / MiB,
        "within_bound": max(build_hwm or 0, sampler.peak) <= bound,
        "build_s": build_s,
    }


def _train_phase(
    cfg: Any, pre: Any, run: Any, model: Any, iters: int, *, log: bool
) -> dict[str, Any]:
    """Step 3 of the module docstring: the engine, then ``iters`` iterations of one micro-batch (RSS after each
    phase of each iteration; ``log``: print them as they come)."""
    import torch

    from megatron.model import loss_func
    from megatron.training.model_setup import build_engine

    reset_peak()
    start = time.perf_counter()
    bundle = build_engine(
        cfg.model, cfg.training, cfg.parallel, pre.plan, pre.ds_config, run, model=model
    )
    engine_s = time.perf_counter() - start
    engine = bundle.engine
    b, s = cfg.training.micro_batch_size, cfg.model.seq_length
    device = run.device
    gen = torch.Generator().manual_seed(run.state.get_data_parallel_rank())
    losses, iter_s = [], []
    phases = {"engine": rss_bytes() / MiB}  # RSS after each phase of each iteration
    with PeakSampler() as train_sampler:
        for it in range(iters):
            t0 = time.perf_counter()
            tokens = torch.randint(0, pre.plan.true_vocab_size, (b, s + 1), generator=gen)
            pos = torch.arange(s).unsqueeze(0).expand(b, s)
            per_token = engine(
                tokens[:, :-1].to(device), pos.to(device), labels=tokens[:, 1:].to(device)
            )
            loss = loss_func(per_token, torch.ones_like(per_token))
            phases[f"forward{it}"] = rss_bytes() / MiB
            engine.backward(loss)
            phases[f"backward{it}"] = rss_bytes() / MiB
            engine.step()
            phases[f"step{it}"] = rss_bytes() / MiB
            losses.append(float(loss))
            iter_s.append(time.perf_counter() - t0)
            if log:
                sys.stdout.write(f"iteration {it}: {json.dumps(phases)}\n")
                sys.stdout.flush()
    train_hwm = hwm_bytes()
    return {
        "engine_s": engine_s,
        "train_peak_hwm_MiB": max(train_hwm, train_sampler.peak) / MiB,
        "train_rss_MiB": phases,
        "losses": losses,
        "iter_s": iter_s,
    }


def model_argv(a: argparse.Namespace, save_dir: str) -> list[str]:
    """``pretrain_gpt.py`` flags of the benchmarked model (GPT-2 style, fp32, mock data, ZeRO-3 at DP = ranks)."""
    argv = [
        "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
        "--num-attention-heads", str(a.num_attention_heads),
        "--seq-length", str(a.seq_length), "--max-position-embeddings", str(a.seq_length),
        "--micro-batch-size", "1", "--global-batch-size", str(a.ranks), "--train-iters", str(a.iters),
        "--lr", "1e-4", "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234",
        "--mock-data", "--vocab-size", str(a.vocab_size), "--zero-stage", "3",
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--eval-iters", "0", "--log-level", "WARNING",
    ]  # fmt: skip
    if a.bf16:
        argv.append("--bf16")
    zero: dict[str, Any] = dict(ZERO3_TUNING)
    if a.offload:
        zero["offload_param"] = {"device": "cpu"}
        argv.append("--cpu-optimizer")
    ds = Path(save_dir) / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": zero}))
    argv += ["--deepspeed_config", str(ds)]
    return argv


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=4, help="data-parallel ranks (processes)")
    p.add_argument("--num-layers", type=int, default=22)
    p.add_argument("--hidden-size", type=int, default=1536)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument(
        "--offload", action="store_true", help="offload_param + CPU Adam (offload_optimizer)"
    )
    p.add_argument(
        "--bf16", action="store_true", help="bf16 parameters (fp32 master weights in the optimizer)"
    )
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", type=Path, default=None, help="also write the per-rank results here")
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for key, value in MALLOC_ENV.items():
        os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        per_rank = spawn_local_ranks(
            worker,
            a.ranks,
            model_argv(a, tmp),
            a.iters,
            init_process_group=False,
            timeout=a.timeout,
        )
        wall = time.perf_counter() - start
    malloc = {k: os.environ[k] for k in MALLOC_ENV}
    report = {
        "args": vars(a) | {"json": str(a.json)},
        "malloc": malloc,
        "wall_s": wall,
        "ranks": per_rank,
    }
    text = json.dumps(report, indent=1)
    sys.stdout.write(text + "\n")
    if a.json is not None:
        a.json.write_text(text)
    return 0 if all(r["within_bound"] for r in per_rank) else 1


if __name__ == "__main__":
    raise SystemExit(main())
