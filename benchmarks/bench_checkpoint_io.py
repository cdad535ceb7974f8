"""Checkpoint save and load bandwidth against this machine's disk, and the time --async-save blocks training.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m benchmarks.bench_checkpoint_io [--hidden-size 1024]
        [--num-layers 10] [--disk-gb 2] [--repeats 2] [--dir /path/on/the/disk/to/measure]

1. The disk, before each repeat (a shared machine's disk drifts): one file of --disk-gb written sequentially in
   64 MiB chunks and fsync'ed, twice: plainly (the page cache takes it all, the fsync writes it) and streamed (the
   write-back of each chunk started as it is written, as Trident's save does); the faster is the disk's write
   bandwidth. Then it is read back cold (its pages dropped from the page cache first
   with ``posix_fadvise(POSIX_FADV_DONTNEED)``, which needs no root for clean pages; ``fincore`` shows them gone.
   A hypervisor's cache below a virtual disk stays out of reach: on a VM "cold" means cold in this kernel) and
   warm (read again at once).
2. Trident: one process, a GPT of --hidden-size / --num-layers (vocabulary 32000), ZeRO-1 fp32 (16 bytes a
   parameter on disk: weights, fp32 partition, two Adam moments), saved through the real
   ``DeepSpeedCheckpointer``: the synchronous save (its wall time as ``save()`` returns, every file
   ``fdatasync``'ed by then, and with ``os.sync()`` after it), the load from cold pages (``load()``; the SHA-256
   verification a relaunch runs on a second thread is timed on its own), and --async-save: the time ``save()``
   blocks plus the time the next optimizer step waits for the copy to host memory, and the training time lost in
   all while the write is in flight (the blocked time plus how much slower the optimizer steps run meanwhile,
   against a step alone: on a machine with few cores the writer's copying, pickling and hashing compete with
   training for the CPU). The first repeat's async save allocates its host buffers (page faults); later ones
   reuse them, as a run's later saves do.

Bandwidths are bytes of the tag directory / seconds; fractions are per repeat, against the disk measured just
before, then the median. Prints one line per measurement and a summary.
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

CHUNK = 64 << 20


def _drop_cache(paths: list[Path]) -> None:
    """Write back and drop the page-cache pages of ``paths`` (clean pages drop without root)."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_all(path: Path) -> None:
    with path.open("rb", buffering=0) as f:
        while f.read(CHUNK):
            pass


def _write_probe(path: Path, block: bytes, n: int, *, stream: bool) -> float:
    """Seconds to write ``n`` x ``block`` to ``path`` and fsync it; ``stream``: the write-back of each chunk
    started as soon as it is written (``posix_fadvise(DONTNEED)``, as Trident's save does), so the disk works while
    the next chunk is copied, instead of all at the fsync."""
    t = time.perf_counter()
    with path.open("wb", buffering=0) as f:
        for i in range(n):
            f.write(block)
            if stream and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), i * CHUNK, CHUNK, os.POSIX_FADV_DONTNEED)
        os.fsync(f.fileno())
    return time.perf_counter() - t


def measure_disk(root: Path, size_gb: float) -> dict[str, float]:
    """Sequential write (with fsync; the better of plain and streamed write-back) and cold/warm read bandwidth of
    one file, bytes/s."""
    path = root / "disk_probe.bin"
    block = os.urandom(CHUNK)
    n = max(1, int(size_gb * (1 << 30)) // CHUNK)
    plain = _write_probe(path, block, n, stream=False)
    path.unlink()
    os.sync()
    streamed = _write_probe(path, block, n, stream=True)
    _drop_cache([path])
    t = time.perf_counter()
    _read_all(path)
    cold = time.perf_counter() - t
    t = time.perf_counter()
    _read_all(path)
    warm = time.perf_counter() - t
    path.unlink()
    size = n * CHUNK
    return {
        "write": size / min(plain, streamed),
        "write_plain": size / plain,
        "write_streamed": size / streamed,
        "read_cold": size / cold,
        "read_warm": size / warm,
    }


def _flags(hidden: int, layers: int) -> list[str]:
    heads = max(1, hidden // 64)
    return [
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
        "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "32000",
        "--tokenizer-type", "NullTokenizer", "--mock-data", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--zero-stage", "1",
        "--log-level", "WARNING",
    ]  # fmt: skip


def _files(tag: Path) -> list[Path]:
    return [p for p in tag.rglob("*") if p.is_file()]


def _verify(tag: Path) -> None:
    from megatron.checkpointing.checksums import verify_checkpoint_files
    from megatron.checkpointing.meta import read_meta

    verify_checkpoint_files(tag, read_meta(tag.parent, tag.name))


def measure_trident(
    root: Path, flags: list[str], repeats: int, disk_gb: float
) -> dict[str, list[float]]:
    """Per repeat: the disk's bandwidths (bytes/s: ``disk_write``, ``disk_read_cold``), measured right before
    Trident's, the seconds of each of Trident's measurements, and the checkpoint's bytes (``"bytes"``)."""
    from megatron import mpu
    from megatron.config import parse_args
    from megatron.training import initialize, preflight
    from megatron.training.lr_scheduler import build_lr_scheduler
    from megatron.training.model_setup import build_engine
    from megatron.training.pretrain import build_checkpointer
    from megatron.training.state import TrainState

    save = root / "ck"
    args = [*flags, "--save", str(save), "--load", str(save)]
    pre = preflight(parse_args(args))
    pre_async = preflight(parse_args([*args, "--async-save"]))
    run = initialize.init_distributed(pre.cfg.parallel)
    keys = (
        "save",
        "save_sync",
        "load",
        "verify",
        "async_blocked",
        "async_lost",
        "async_write",
        "bytes",
        "disk_write",
        "disk_read_cold",
    )
    out: dict[str, list[float]] = {k: [] for k in keys}
    try:
        cfg, plan = pre.cfg, pre.plan
        bundle = build_engine(cfg.model, cfg.training, cfg.parallel, plan, pre.ds_config, run)
        sched = build_lr_scheduler(cfg.training, plan.global_batch_size, bundle.client_optimizer)
        n = sum(p.numel() for p in bundle.engine.module.parameters())
        print(f"model: {n / 1e6:.1f} M parameters")
        _create_optimizer_states(bundle.engine)
        sync_ck, async_ck = build_checkpointer(pre, run), build_checkpointer(pre_async, run)
        for i in range(repeats):
            disk = measure_disk(root, disk_gb)
            out["disk_write"].append(disk["write"])
            out["disk_read_cold"].append(disk["read_cold"])
            print(
                f"repeat {i}: disk: write {disk['write'] / 1e9:.2f} GB/s (fsync; plain "
                f"{disk['write_plain'] / 1e9:.2f}, streamed {disk['write_streamed'] / 1e9:.2f}), read cold "
                f"{disk['read_cold'] / 1e9:.2f} GB/s, warm {disk['read_warm'] / 1e9:.2f} GB/s"
            )
            _one_repeat(i, save, bundle.engine, sched, (sync_ck, async_ck), out, TrainState)
    finally:
        mpu.destroy_model_parallel()
    return out


def _create_optimizer_states(engine: Any) -> None:
    """One optimizer step on a tiny loss of the parameters: Adam's moments exist (and are saved) afterwards."""
    loss = sum((p.float() ** 2).sum() for p in engine.module.parameters()) * 1e-12
    engine.backward(loss)
    engine.step()


def _one_repeat(
    i: int, save: Path, engine: Any, sched: Any, cks: tuple[Any, Any], out: dict, state_cls: Any
) -> None:
    sync_ck, async_ck = cks
    t = time.perf_counter()
    for _ in range(3):
        _create_optimizer_states(engine)
    step_alone = (time.perf_counter() - t) / 3
    shutil.rmtree(save, ignore_errors=True)
    os.sync()
    state = state_cls()
    state.iteration = 2 * i + 1
    t = time.perf_counter()
    sync_ck.save(engine, sched, state)
    out["save"].append(time.perf_counter() - t)
    os.sync()
    out["save_sync"].append(time.perf_counter() - t)
    tag = save / f"global_step{state.iteration}"
    files = _files(tag)
    out["bytes"].append(float(sum(p.stat().st_size for p in files)))
    _drop_cache(files)
    t = time.perf_counter()
    sync_ck.load(engine, sched, state_cls())
    out["load"].append(time.perf_counter() - t)
    _drop_cache(files)
    t = time.perf_counter()
    _verify(tag)
    out["verify"].append(time.perf_counter() - t)
    state.iteration += 1
    os.sync()
    t = time.perf_counter()
    async_ck.save(engine, sched, state)
    blocked = time.perf_counter() - t
    # Training goes on (optimizer steps on a loss of the parameters) until the write is committed: the first
    # step's optimizer step waits for the copy; every step competes with the writer for the CPU.
    steps, t_steps = 0, time.perf_counter()
    while async_ck.save_in_flight:
        _create_optimizer_states(engine)
        steps += 1
        async_ck.finalize_save(blocking=False)
    took = time.perf_counter() - t_steps
    out["async_write"].append(time.perf_counter() - t)
    out["async_blocked"].append(blocked + async_ck.step_wait_seconds)
    out["async_lost"].append(blocked + took - steps * step_alone)
    gb = out["bytes"][-1] / 1e9
    print(
        f"repeat {i}: {gb:.2f} GB: save {out['save'][-1]:.2f} s (+ os.sync {out['save_sync'][-1]:.2f} s), "
        f"load {out['load'][-1]:.2f} s, verify {out['verify'][-1]:.2f} s; --async-save blocked "
        f"{out['async_blocked'][-1]:.3f} s (save + next step's wait), training slowed by "
        f"{out['async_lost'][-1]:.2f} s in all (steps {step_alone:.2f} s alone), written after "
        f"{out['async_write'][-1]:.2f} s"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-layers", type=int, default=10)
    p.add_argument("--disk-gb", type=float, default=2.0, help="size of the disk probe file")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--dir", default=None, help="scratch directory on the disk to measure (default: temp)"
    )
    a = p.parse_args(argv)
    if a.repeats < 1 or a.disk_gb <= 0 or a.hidden_size < 64 or a.num_layers < 1:
        p.error("--repeats and --num-layers must be >= 1, --disk-gb > 0, --hidden-size >= 64")
    if a.dir is not None:
        if Path(a.dir).exists() and not Path(a.dir).is_dir():
            p.error(f"--dir {a.dir} is a file; give a directory (it is created if missing)")
        Path(a.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        out = measure_trident(Path(tmp), _flags(a.hidden_size, a.num_layers), a.repeats, a.disk_gb)
    med = {k: statistics.median(v) for k, v in out.items()}
    if a.repeats > 1:  # the first async save allocates its buffers; a run's later saves reuse them
        for k in ("async_blocked", "async_lost"):
            med[k] = statistics.median(out[k][1:])
    size = med["bytes"]
    # Each repeat against the disk measured just before it (a shared machine's disk drifts between repeats).
    for what, disk_rate in (
        ("save", "write"),
        ("save_sync", "write"),
        ("async_write", "write"),
        ("load", "read_cold"),
    ):
        ratios = [
            b / t / d
            for b, t, d in zip(out["bytes"], out[what], out[f"disk_{disk_rate}"], strict=True)
        ]
        print(
            f"{what}: {size / med[what] / 1e9:.2f} GB/s = {100 * statistics.median(ratios):.0f} % of the "
            f"disk's {disk_rate.replace('_', ' ')} bandwidth (medians; per repeat: "
            f"{', '.join(f'{100 * r:.0f} %' for r in ratios)})"
        )
    print(
        f"verify (SHA-256, cold): {size / med['verify'] / 1e9:.2f} GB/s; --async-save blocked "
        f"{med['async_blocked']:.3f} s = {100 * med['async_blocked'] / med['save']:.1f} % of the synchronous "
        f"save ({med['save']:.2f} s; medians, the first async save left out when --repeats > 1); training time "
        f"lost while it writes (blocked + slower steps): {med['async_lost']:.2f} s = "
        f"{100 * med['async_lost'] / med['save']:.0f} % of the synchronous save"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
