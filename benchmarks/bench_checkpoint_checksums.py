"""Checkpoint save/load time with checksums on vs off, for a GPT-2 124M-sized model on this machine (not a test).

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m benchmarks.bench_checkpoint_checksums [--repeats 3] [--dir /tmp/x]

One process, ZeRO-1 fp32 (GPT-2 small: 12 layers, hidden 768, 12 heads, vocab 50257, seq 1024), through the real
``DeepSpeedCheckpointer``: "save" is ``save()`` with the hashing writer vs DeepSpeed's own ``torch.save``
(``record_checksums=False``: the checksums off); "load" is the verification (``verify_checkpoint_files`` over the
files this rank reads: every one hashed) followed by ``load()``, vs ``load()`` alone (--no-verify-checkpoint-checksums:
sizes only); "resume" is a relaunch's start-up as ``pretrain`` runs it (preflight starts the digests on a thread, the
engine is built meanwhile, the digests are joined before the load), with and without
--no-verify-checkpoint-checksums. Prints one line per measurement and the medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

FLAGS = [
    "--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
    "--seq-length", "1024", "--max-position-embeddings", "1024", "--vocab-size", "50257",
    "--tokenizer-type", "NullTokenizer", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "1",
    "--train-iters", "1", "--lr", "1e-4", "--zero-stage", "1", "--log-level", "WARNING",
]  # fmt: skip


def _engine_and_schedule(pre: Any, run: Any) -> tuple[Any, Any]:
    """The run's engine bundle and LR schedule, built as ``pretrain`` builds them."""
    from megatron.training.lr_scheduler import build_lr_scheduler
    from megatron.training.model_setup import build_engine

    cfg, plan = pre.cfg, pre.plan
    bundle = build_engine(cfg.model, cfg.training, cfg.parallel, plan, pre.ds_config, run)
    sched = build_lr_scheduler(
        cfg.training,
        plan.global_batch_size,
        bundle.client_optimizer,
        train_samples=plan.train_samples,
    )
    return bundle, sched


def _bench(root: Path, repeats: int) -> dict[str, list[float]]:
    from megatron import mpu
    from megatron.config import parse_args
    from megatron.training import initialize, preflight
    from megatron.training.pretrain import build_checkpointer
    from megatron.training.state import TrainState

    save = root / "ck"
    cfg = parse_args([*FLAGS, "--save", str(save), "--load", str(save)])
    pre = preflight(cfg)
    run = initialize.init_distributed(pre.cfg.parallel)
    times: dict[str, list[float]] = {
        k: [] for k in ("save_on", "save_off", "load_on", "load_off", "resume_on", "resume_off")
    }
    try:
        bundle, sched = _engine_and_schedule(pre, run)
        checkpointers = {
            "on": build_checkpointer(pre, run),
            "off": build_checkpointer(pre, run, record_checksums=False),
        }
        ck = checkpointers["on"]
        n = sum(p.numel() for p in bundle.engine.module.parameters())
        print(f"model: {n / 1e6:.1f} M parameters")
        state = TrainState()
        for i in range(repeats):
            for mode in ("on", "off"):
                shutil.rmtree(save, ignore_errors=True)
                state.iteration = i + 1
                os.sync()
                t = time.perf_counter()
                checkpointers[mode].save(bundle.engine, sched, state)
                times[f"save_{mode}"].append(time.perf_counter() - t)
                if mode == "on":
                    tag = save / f"global_step{i + 1}"
                    for verify in (True, False):
                        t = time.perf_counter()
                        if verify:
                            _verify(tag, pre)
                        ck.load(bundle.engine, sched, TrainState())
                        times[f"load_{'on' if verify else 'off'}"].append(time.perf_counter() - t)
                    for verify in (True, False):
                        times[f"resume_{'on' if verify else 'off'}"].append(
                            _resume(save, verify, run)
                        )
                size = sum(p.stat().st_size for p in save.rglob("*") if p.is_file())
                print(
                    f"repeat {i}: checksums {mode}: save {times[f'save_{mode}'][-1]:.2f} s ({size / 1e9:.2f} GB)"
                    + (
                        f", load verified {times['load_on'][-1]:.2f} s, unverified {times['load_off'][-1]:.2f} s"
                        + f"; resume start-up verified {times['resume_on'][-1]:.2f} s, unverified "
                        + f"{times['resume_off'][-1]:.2f} s"
                        if mode == "on"
                        else ""
                    )
                )
    finally:
        mpu.destroy_model_parallel()
    return times


def _verify(tag: Path, pre: Any) -> int:
    """Hash the files of ``tag`` this rank reads at load, as a run's start-up does (in the foreground here)."""
    from megatron.checkpointing.checksums import files_to_verify, verify_checkpoint_files
    from megatron.checkpointing.meta import read_meta
    from megatron.checkpointing.rules import zero_partitions

    meta = read_meta(tag.parent, tag.name)
    names = files_to_verify(
        meta,
        rank=0,
        run_tp=pre.plan.tensor_model_parallel_size,
        run_pp=pre.plan.pipeline_model_parallel_size,
        run_dp=zero_partitions(pre.plan, pre.cfg.parallel.ds_sequence_parallel_size),
        optimizer_state=True,
    )
    return verify_checkpoint_files(tag, meta, names, hashes=True)


def _resume(save: Path, verify: bool, run: Any) -> float:
    """Seconds of a relaunch's start-up as ``pretrain`` runs it: preflight (the digests start on a thread), engine,
    schedule, the join of the digests, the load."""
    from megatron.config import parse_args
    from megatron.training import preflight
    from megatron.training.pretrain import build_checkpointer, join_checksums
    from megatron.training.state import TrainState

    off = [] if verify else ["--no-verify-checkpoint-checksums"]
    t = time.perf_counter()
    pre = preflight(parse_args([*FLAGS, "--load", str(save), *off]))
    bundle, sched = _engine_and_schedule(pre, run)
    join_checksums(pre.checksums)
    build_checkpointer(pre, run).load(bundle.engine, sched, TrainState())
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    if a.dir is not None:
        if Path(a.dir).exists() and not Path(a.dir).is_dir():
            p.error(f"--dir {a.dir} is a file; give a directory (it is created if missing)")
        Path(a.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        times = _bench(Path(tmp), a.repeats)
    med = {k: statistics.median(v) for k, v in times.items()}
    for what in ("save", "load", "resume"):
        on, off = med[f"{what}_on"], med[f"{what}_off"]
        print(
            f"{what}: checksums on {on:.2f} s, off {off:.2f} s (median): {100 * (on / off - 1):+.1f} %"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
