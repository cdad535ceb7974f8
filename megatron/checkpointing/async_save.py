"""--async-save: the checkpoint's state copied to host memory, its files written by a background thread.

The training loop is blocked only while the state is copied; the files are written while training goes on, through
the same writer as a synchronous save (``checksums.ChecksumRecorder``: SHA-256 while writing, one sidecar per rank),
and the completion marker and pointers move only once every rank's files are on disk::

    iteration N (save)   [snapshot: engine.save_checkpoint routed to host copies, RNG bytes] -> thread starts
    iterations N+1, ...  training; the thread writes the tag's files, then this rank's checksum sidecar
    each iteration end   all-reduce (max) of [my write still running, my write failed]: all done -> rank 0
                         writes trident_meta.json, 'latest' and the iteration file (``engine.py``), barrier
    next save / exit     waits for the write still in flight (logged with the wait), then commits it

A SIGKILL while the thread writes leaves a tag directory without ``trident_meta.json``: incomplete, never loaded;
``latest`` still names the previous complete checkpoint. Only the training thread runs collectives; the writer
thread touches files only.

Why a thread and not a process: the copy to host memory is needed anyway on GPU (the device memory changes at the
next step) and makes the state the thread writes private to it; a forked writer would copy-on-write the same pages
but fork a process that runs gloo/NCCL and OpenMP threads (locks held by those threads stay locked in the child).
The writer's Python work is pickling a few objects per file; the bytes are written and hashed with the GIL
released.

Why not DeepSpeed's own asynchronous engines (0.19.8: ``DecoupledCheckpointEngine``, ``FastCheckpointEngine``):
they write ``latest`` themselves with a plain ``open`` (not atomic), record no checksums, commit inside
``engine.step`` and need DeepSpeed's async-I/O op (libaio); Trident keeps its own protocol and routes DeepSpeed's
``checkpoint_engine.save`` calls to :func:`snapshot` instead (``deepspeed_internals.checkpoint_saves_through``).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.commit import SaveCommit, any_rank_max, background_failure, commit
from megatron.log import global_rank

logger = logging.getLogger(__name__)


def _tensors_in(obj: Any, found: dict[int, torch.Tensor]) -> None:
    """Every tensor reachable from ``obj`` through dicts, lists and tuples, by ``id``."""
    if isinstance(obj, torch.Tensor):
        found[id(obj)] = obj
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors_in(v, found)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _tensors_in(v, found)


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A copy of ``t`` in host memory (pinned when ``pin`` and ``t`` is on a GPU), of the same type
    (a ``Parameter`` stays one)."""
    to_pin = pin and t.device.type == "cuda"
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=to_pin)
    out.copy_(t.detach(), non_blocking=to_pin)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out


def snapshot(state: Any, *, pin: bool = True) -> Any:
    """A deep copy of ``state`` (a state dict as DeepSpeed saves it) whose tensors are host-memory copies.

    Tensors inside dicts, lists and tuples are copied to host memory (pinned from a GPU, the copies queued on the
    current stream and waited for once); everything else is deep-copied, so later training steps, which change the
    parameters and optimizer states in place, cannot change what the background writer saves. Views that shared
    one storage are saved as separate tensors of their own size (a load copies values, so it reads the same).
    """
    found: dict[int, torch.Tensor] = {}
    _tensors_in(state, found)
    memo: dict[int, Any] = {key: _host_copy(t, pin) for key, t in found.items()}
    out = copy.deepcopy(state, memo)
    if any(t.device.type == "cuda" for t in found.values()):
        torch.cuda.synchronize()
    return out


@dataclass
class FileJob:
    """One file of the checkpoint: what to write where."""

    path: Path
    state: Any
    """A snapshot (for ``torch.save``) or bytes (written as they are: the RNG file)."""
    zipped: bool = True
    """torch's zip serialization (DeepSpeed's checkpoint engine setting)."""


@dataclass
class Writers:
    """How the background thread writes a checkpoint (the checksum recorder's methods, or plain ones)."""

    torch_save: Callable[[Any, Path, bool], None]
    write_bytes: Callable[[Path, bytes], None]
    finish: Callable[[], None]
    """Called after the last file (writes this rank's checksum sidecar)."""


class BackgroundSave:
    """The files of one rank's checkpoint ``iteration``, written by a (non-daemon) thread.

    Non-daemon: a process that ends in any way Python sees (exit code, exception) finishes writing the files first;
    they then stay uncommitted (no marker) unless the training thread committed them.
    """

    def __init__(self, iteration: int, jobs: list[FileJob], writers: Writers) -> None:
        self.iteration = iteration
        self.error: BaseException | None = None
        self.write_seconds: float | None = None
        self._jobs = jobs
        self._writers = writers
        self._thread = threading.Thread(
            target=self._run, name=f"trident-async-save-{iteration}", daemon=False
        )
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            while self._jobs:
                job = self._jobs.pop(0)  # drop each snapshot once written: host memory back early
                if isinstance(job.state, bytes):
                    self._writers.write_bytes(job.path, job.state)
                else:
                    self._writers.torch_save(job.state, job.path, job.zipped)
            self._writers.finish()
        except BaseException as err:  # noqa: BLE001 - handed to the training thread, which raises it
            self.error = err
        self.write_seconds = time.perf_counter() - start

    def done(self) -> bool:
        """The thread has finished (written every file, or failed: :attr:`error`)."""
        return not self._thread.is_alive()

    def wait(self) -> float:
        """Block until the thread finished; returns the seconds waited."""
        start = time.perf_counter()
        self._thread.join()
        return time.perf_counter() - start


class AsyncSaves:
    """The one --async-save in flight on this rank and its commit; every rank calls these methods at the same
    points of the run (the save, each iteration's end, the exit), since :meth:`finalize` runs a collective."""

    def __init__(self) -> None:
        self._in_flight: tuple[BackgroundSave, SaveCommit] | None = None

    def start(self, jobs: list[FileJob], writers: Writers, save: SaveCommit) -> None:
        """Start writing ``jobs`` in the background (the previous save must be finished: :meth:`wait_previous`)."""
        self._in_flight = (BackgroundSave(save.iteration, jobs, writers), save)

    def wait_previous(self, iteration: int) -> None:
        """At most one save in flight: wait for (and commit) the previous one, logging how long it blocked."""
        if self._in_flight is None:
            return
        pending = self._in_flight[0]
        waited = pending.wait()
        if global_rank() == 0:
            logger.info(
                "--async-save: the save of iteration %d waited %.2f s for the checkpoint of iteration %d still "
                "being written (one save in flight at a time)",
                iteration,
                waited,
                pending.iteration,
            )
        self.finalize(blocking=True)

    def finalize(self, *, blocking: bool) -> None:
        """Commit the save in flight once every rank's files are written (one all-reduce); with ``blocking``,
        wait for this rank's writer first. Nothing in flight: nothing to do (no collective).

        Raises:
            CheckpointSaveError: a rank's background write failed; 'latest' still names the previous checkpoint.
        """
        if self._in_flight is None:
            return
        pending, save = self._in_flight
        if blocking:
            pending.wait()
        rank = global_rank()
        running, failed = any_rank_max(
            [0.0 if pending.done() else 1.0, rank + 1.0 if pending.error else 0.0]
        )
        if failed:
            self._in_flight = None
            raise background_failure(save, pending.error, int(failed) - 1)
        if running:
            return
        self._in_flight = None
        commit(save)
        if rank == 0:
            logger.info(
                "saved checkpoint %s at iteration %d (written in the background in %.2f s)",
                save.tag_dir,
                save.iteration,
                pending.write_seconds or 0.0,
            )
