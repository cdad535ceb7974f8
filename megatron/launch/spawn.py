"""Local ranks: run a function on N processes of this machine joined in a torch.distributed group.

The one spawn helper: the offline tools that need a real engine per rank (``megatron.conversion.rewrite``), the
benchmarks and the self-check spawn with it, and the test suite through ``megatron.testing.run_distributed``. Each
rank gets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in its environment (so ``deepspeed.init_distributed`` works
inside it too), ``OMP_NUM_THREADS=1`` and, without CUDA, ``DS_ACCELERATOR=cpu``. The first failing rank's
traceback is re-raised in the parent; a rank that hangs (the usual failure of a mismatched collective) is killed
at ``timeout`` and reported with the ranks that did not finish.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

from megatron.launch.rendezvous import find_free_port


class LocalRanksError(RuntimeError):
    """A rank raised, died or timed out inside :func:`spawn_local_ranks` (the message holds its traceback)."""


INTERRUPTS = {signal.SIGINT, signal.SIGTERM}
"""Held back while children start: a Ctrl-C or SIGTERM in the middle of handing a spawned child its start-up data
left that child printing multiprocessing's "EOFError: Ran out of input" traceback; the children unblock them first
thing, the parent right after the last start (a pending signal is then handled, and the children are killed)."""


def _worker(
    rank: int,
    world_size: int,
    port: int,
    payload_path: str,
    init_process_group: bool,
    backend: str,
    env: dict[str, str],
    results: Any,
) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    os.environ.update(env)
    signal.pthread_sigmask(
        signal.SIG_UNBLOCK, INTERRUPTS
    )  # blocked by the parent while it started us
    torch.set_num_threads(1)
    try:
        # The function and its arguments travel through a file, not the spawn pipe: a child that cannot unpickle
        # them then fails here (and is reported) instead of leaving the parent blocked writing a large pipe.
        with open(payload_path, "rb") as f:
            fn, args, kwargs = pickle.load(f)
        if init_process_group:
            import torch.distributed as dist

            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world_size,
                init_method=f"tcp://127.0.0.1:{port}",
                timeout=timedelta(seconds=120),
            )
        value = fn(*args, **kwargs)
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001, S110 - teardown of a broken group is best effort
            pass


def spawn_local_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    init_process_group: bool = True,
    backend: str | None = None,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned processes and return the per-rank results.

    Args:
        fn: a module-level (picklable) function; its return value must be picklable.
        world_size: number of processes (ranks 0..world_size-1 on this machine).
        timeout: seconds for the whole group; past it every rank is killed and an error names the stuck ranks.
        init_process_group: create the default process group before calling ``fn`` (set False when ``fn`` calls
            ``deepspeed.init_distributed`` itself; the rendezvous variables are set either way).
        backend: "gloo" (default on CPU) or "nccl" (default when CUDA has ``world_size`` devices).
        env: extra environment variables for every rank.

    Raises:
        LocalRanksError: with the first failing rank's traceback.
    """
    if backend is None:
        backend = (
            "nccl"
            if torch.cuda.is_available() and torch.cuda.device_count() >= world_size
            else "gloo"
        )
    child_env = {"DS_ACCELERATOR": "cpu"} if backend == "gloo" else {}
    child_env.update(env or {})
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    with tempfile.NamedTemporaryFile(prefix="trident-spawn-", suffix=".pkl", delete=False) as f:
        pickle.dump((fn, args, kwargs), f)
        payload_path = f.name
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                rank,
                world_size,
                port,
                payload_path,
                init_process_group,
                backend,
                child_env,
                results,
            ),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        held = signal.pthread_sigmask(signal.SIG_BLOCK, INTERRUPTS)
        try:
            for p in procs:
                p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stuck = sorted(set(range(world_size)) - set(values))
                raise LocalRanksError(
                    f"timed out after {timeout:.0f} s; ranks still running: {stuck}"
                )
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if r not in values and p.exitcode not in (None, 0)
                ]
                if dead:
                    codes = {r: procs[r].exitcode for r in dead}
                    raise LocalRanksError(
                        f"rank(s) died without a result, exit codes {codes}"
                    ) from None
                continue
            if status == "error":
                raise LocalRanksError(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = value
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=5 if len(values) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        os.unlink(payload_path)
    return [values[r] for r in range(world_size)]
