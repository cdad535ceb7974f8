"""Serve text generation from a Trident checkpoint over HTTP (Megatron's ``run_text_generation_server.py`` API).

    python tools/run_text_generation_server.py --load ckpt/ [--host 127.0.0.1] [--port 5000]
    torchrun --nproc-per-node 4 tools/run_text_generation_server.py --load ckpt/ \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \\
         -d '{"prompts": ["In the beginning"], "tokens_to_generate": 32, "top_p": 0.9}'
    curl localhost:5000/health

Request and response: ``megatron/text_generation/server.py``; batching, seeds and the queue:
``megatron/text_generation/scheduler.py``. Launched like training (torchrun, the ``deepspeed`` launcher, srun), every
rank loads its shard and generates; global rank 0 also serves HTTP and batches up to ``--max-batch-size`` queued
prompts (waiting at most ``--batch-wait-ms`` for more); a request that would hold more than ``--max-queue`` prompts
in the queue is answered 503. The default host is 127.0.0.1 (this machine only; pass ``--host 0.0.0.0`` to listen
on every interface: the server has no authentication). ``--read-timeout`` (default 60 s) bounds every wait on a
silent client.

Stopping: SIGTERM or Ctrl-C to rank 0 (its pid is printed) stops accepting requests, finishes the batch in
progress, answers 503 to the queued ones and stops every rank; the other ranks wait for rank 0 on those signals
(a launcher that signals every process, or torchrun forwarding its own signal, stops them the same way).
Exit codes: 0 stopped so, 1 generation failed with more than one rank, 2 bad input (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from tools._textgen_common import add_load_args, build_generator

logger = logging.getLogger("run_text_generation_server")


def _parser() -> argparse.ArgumentParser:
    from megatron.text_generation.scheduler import (
        DEFAULT_BATCH_WAIT_MS,
        DEFAULT_MAX_BATCH_SIZE,
        DEFAULT_MAX_QUEUE,
        HEARTBEAT_S,
    )

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_args(p)  # with the layout flags (--tensor/--pipeline-model-parallel-size)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    p.add_argument(
        "--port",
        type=int,
        default=5000,
        help="TCP port 0..65535 (Megatron's default 5000; 0: any free)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=None,
        help="seconds to wait on a silent client: its request line and headers, and its whole body (then "
        "408); default 60 (server.DEFAULT_READ_TIMEOUT)",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=DEFAULT_MAX_BATCH_SIZE,
        help=f"prompts generated together (default {DEFAULT_MAX_BATCH_SIZE})",
    )
    p.add_argument(
        "--batch-wait-ms",
        type=float,
        default=DEFAULT_BATCH_WAIT_MS,
        help=f"how long a batch waits for more prompts (default {DEFAULT_BATCH_WAIT_MS:g} ms)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help=f"prompts that may wait; beyond it requests get 503 (default {DEFAULT_MAX_QUEUE})",
    )
    p.add_argument(
        "--heartbeat-seconds",
        type=float,
        default=HEARTBEAT_S,
        help="while idle, rank 0 tells the other ranks it is alive this often, far below the process "
        f"group's timeout (default {HEARTBEAT_S:g})",
    )
    return p


def _error(rank: int, message: str) -> None:
    print(f"{'' if rank == 0 else f'rank {rank}: '}error: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    from megatron.log import setup_logging
    from megatron.text_generation.distributed import destroy_inference_distributed
    from megatron.text_generation.server import DEFAULT_READ_TIMEOUT, check_server_args

    setup_logging()
    a.read_timeout = DEFAULT_READ_TIMEOUT if a.read_timeout is None else a.read_timeout
    try:
        check_server_args(  # on every rank, before the (slow, collective) checkpoint load
            a.port,
            a.read_timeout,
            max_batch_size=a.max_batch_size,
            batch_wait_ms=a.batch_wait_ms,
            max_queue=a.max_queue,
            heartbeat_s=a.heartbeat_seconds,
        )
    except ValueError as e:
        _error(0, str(e))
        return 2
    try:
        return _serve(a)
    finally:
        destroy_inference_distributed()


def _serve(a: argparse.Namespace) -> int:
    """Join the launched job and load (collective), bind on rank 0, then serve (rank 0) or follow rank 0."""
    from megatron.log import global_rank
    from megatron.text_generation.scheduler import serve_worker, world_size
    from megatron.text_generation.server import API_PATH, HEALTH_PATH, make_server

    try:
        gen = build_generator(a)  # init_inference_distributed, then TextGenerator.from_checkpoint
    except (ValueError, FileNotFoundError) as e:  # the same on every rank
        _error(global_rank(), str(e))
        return 2
    rank = global_rank()
    server, bind_error = None, None
    if gen.is_server_rank:
        try:
            server = make_server(
                gen,
                a.host,
                a.port,
                read_timeout=a.read_timeout,
                max_batch_size=a.max_batch_size,
                batch_wait_ms=a.batch_wait_ms,
                max_queue=a.max_queue,
                heartbeat_s=a.heartbeat_seconds,
            )
        except OSError as e:
            fix = "use another --host" if isinstance(e, socket.gaierror) else "use another --port"
            bind_error = f"cannot listen on {a.host}:{a.port} ({e.strerror or e}); {fix}."
    bind_error = gen.broadcast_work(bind_error)  # every rank learns whether rank 0 serves
    if bind_error is not None:
        if rank == 0:
            _error(rank, bind_error)
        return 2
    if server is None:
        note = f"rank {rank}: stop signal received; stopping when rank 0 stops\n".encode()
        previous = _on_stop_signals(lambda: os.write(2, note) and None)  # os.write: signal-safe
        try:
            serve_worker(gen)
        finally:
            _restore(previous)
        return 0
    host, port = server.server_address
    print(
        f"serving PUT http://{host}:{port}{API_PATH} and GET {HEALTH_PATH} on {world_size()} rank(s) "
        f"(pid {os.getpid()}; Ctrl-C or SIGTERM to stop)",
        flush=True,
    )
    previous = _on_stop_signals(server.stop)
    try:
        server.serve_forever()
    except Exception:
        logger.exception("generation failed on rank 0; the server stopped")
        return 1
    finally:
        server.server_close()
        _restore(previous)
    logger.info("stopped")
    return 0


def _on_stop_signals(stop: Callable[[], None]) -> dict[int, Any]:
    """SIGTERM and SIGINT call ``stop`` (signal-safe: it sets a flag); a second one is a hard stop. Returns the
    handlers it replaced (none off the main thread, where Python cannot set them)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    calls = [0]

    def handler(signum: int, frame: FrameType | None) -> None:
        calls[0] += 1
        if calls[0] > 1:
            raise KeyboardInterrupt
        stop()

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def _restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
