"""--async-save: the checkpoint's state copied to host memory and written to disk by a background thread.

The training loop is blocked only while the save builds the state dicts (``engine.save_checkpoint`` routed to
:func:`snapshot`: their structure is copied, each tensor gets a host buffer) and, if the copy is slower than a
forward and backward, at the next optimizer step, which waits for it. The thread copies the tensors (while the
next forward and backward run: they change no parameter or optimizer state in place), then writes the files
through the same writer as a synchronous save (``checksums.ChecksumRecorder``: SHA-256 while writing, one sidecar
per rank); the completion marker and pointers move only once every rank's files are on disk::

    iteration N (save)   structure + host buffers, RNG bytes; thread starts: copy, then write
    iteration N+1        forward, backward; optimizer step waits for the copy (hold_optimizer_steps)
    each iteration end   all-reduce (max) of [my write still running, my write failed]: all done -> rank 0
                         writes trident_meta.json, 'latest' and the iteration file (``commit.py``), barrier
    next save / exit     waits for the write still in flight (logged with the wait), then commits it

A SIGKILL while the thread writes leaves a tag directory without ``trident_meta.json``: incomplete, never loaded;
``latest`` still names the previous complete checkpoint. Only the training thread runs collectives; the writer
thread copies tensors and writes files. The host buffers stay for the next save (one checkpoint of this rank in
host memory, pinned on GPU, for the run): a fresh buffer pays a page fault per 4 KiB page on first touch.

Why a thread and not a process: the copy to host memory is needed anyway on GPU (device memory changes at the next
step) and makes the state the thread writes private to it; a forked writer would copy-on-write the same pages
but fork a process that runs gloo/NCCL and OpenMP threads (locks held by those threads stay locked in the child).
The writer's Python work is pickling a few objects per file; the bytes are copied, written and hashed with the GIL
released.

Why not DeepSpeed's own asynchronous engines (0.19.8: ``DecoupledCheckpointEngine``, ``FastCheckpointEngine``):
they write ``latest`` themselves with a plain ``open`` (not atomic), record no checksums, commit inside
``engine.step``, hand the live state dict to another process without a snapshot, and need DeepSpeed's async-I/O
op (libaio). Trident keeps its own protocol and routes DeepSpeed's ``checkpoint_engine.save`` calls to
:func:`snapshot` instead (``deepspeed_internals.checkpoint_saves_through``).
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


def _host_buffer(t: torch.Tensor, pin: bool, buffer: torch.Tensor | None) -> torch.Tensor:
    """``buffer`` when it can take a copy of ``t`` (same shape and dtype; pinned if needed), else a new host
    tensor (pinned when ``pin`` and ``t`` is on a GPU)."""
    to_pin = pin and t.device.type == "cuda"
    if (
        buffer is not None
        and buffer.shape == t.shape
        and buffer.dtype == t.dtype
        and (not to_pin or buffer.is_pinned())
    ):
        return buffer
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=to_pin)


@dataclass
class Snapshot:
    """A state dict's structure with host buffers in place of its tensors, and the copies that fill them."""

    state: Any
    """A deep copy of the state dict whose tensors are the host buffers (valid once :meth:`copy` ran)."""
    buffers: list[torch.Tensor]
    """The host buffers in traversal order (hand them to the next snapshot of the same file to reuse)."""
    copies: list[tuple[torch.Tensor, torch.Tensor]]
    """``(source, buffer)`` pairs."""

    def copy(self) -> None:
        """Fill the buffers (from a GPU: queued on the current stream, then waited for on each source device;
        the calling thread's current device may be another one)."""
        devices: set[torch.device] = set()
        for src, dst in self.copies:
            if src.device.type == "cuda":
                devices.add(src.device)
            dst.copy_(src.detach(), non_blocking=src.device.type == "cuda" and dst.is_pinned())
        for device in devices:
            torch.cuda.synchronize(device)


def snapshot(
    state: Any, *, pin: bool = True, buffers: list[torch.Tensor] | None = None
) -> Snapshot:
    """The structure of ``state`` (a state dict as DeepSpeed saves it) copied now, its tensors by
    :meth:`Snapshot.copy` into host buffers (reusing ``buffers`` where shapes and dtypes match).

    Everything but the tensors (dicts, lists, numbers, DeepSpeed's small objects) is deep-copied here; each tensor
    inside dicts, lists and tuples gets a host buffer (pinned for a GPU tensor). The values are copied by
    :meth:`Snapshot.copy`, which the caller runs before anything changes them in place (``async_save``: before the
    next optimizer step). A reused buffer has its pages mapped already; a fresh one costs a page fault per 4 KiB
    on first touch (on CPU that, not the copy, is most of a first snapshot's time). Views that shared one storage
    become separate tensors of their own size (a load copies values, so it reads the same). A ``Parameter`` stays
    one. The caller must not pass ``buffers`` that a writer may still be reading.
    """
    found: dict[int, torch.Tensor] = {}
    _tensors_in(state, found)
    old = list(buffers or [])
    memo: dict[int, Any] = {}
    used: list[torch.Tensor] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, (key, t) in enumerate(found.items()):
        buf = _host_buffer(t, pin, old[i] if i < len(old) else None)
        used.append(buf)
        copies.append((t, buf))
        is_param = isinstance(t, torch.nn.Parameter)
        memo[key] = torch.nn.Parameter(buf, requires_grad=t.requires_grad) if is_param else buf
    return Snapshot(copy.deepcopy(state, memo), used, copies)


@dataclass
class FileJob:
    """One file of the checkpoint: what to write where."""

    path: Path
    state: Snapshot | bytes
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
    """One rank's checkpoint ``iteration``: a (non-daemon) thread fills the snapshots' host buffers, then writes
    the files.

    Non-daemon: a process that ends in any way Python sees (exit code, exception) finishes writing the files first;
    they then stay uncommitted (no marker) unless the training thread committed them.
    """

    def __init__(self, iteration: int, jobs: list[FileJob], writers: Writers) -> None:
        self.iteration = iteration
        self.error: BaseException | None = None
        self.copy_seconds: float | None = None
        self.write_seconds: float | None = None
        self.copied = threading.Event()
        """Set once every host buffer holds its value (the training state may change from then on)."""
        self._jobs = jobs
        self._writers = writers
        self._thread = threading.Thread(
            target=self._run, name=f"trident-async-save-{iteration}", daemon=False
        )
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            try:
                for job in self._jobs:
                    if isinstance(job.state, Snapshot):
                        job.state.copy()
            finally:
                self.copy_seconds = time.perf_counter() - start
                self.copied.set()
            while self._jobs:
                job = self._jobs.pop(0)  # drop each structure once written
                if isinstance(job.state, bytes):
                    self._writers.write_bytes(job.path, job.state)
                else:
                    self._writers.torch_save(job.state.state, job.path, job.zipped)
            self._writers.finish()
        except BaseException as err:  # noqa: BLE001 - handed to the training thread, which raises it
            self.error = err
        self.write_seconds = time.perf_counter() - start

    def done(self) -> bool:
        """The thread has finished (written every file, or failed: :attr:`error`)."""
        return not self._thread.is_alive()

    def wait_copied(self) -> float:
        """Block until the host buffers are filled; returns the seconds waited."""
        if self.copied.is_set():
            return 0.0
        start = time.perf_counter()
        self.copied.wait()
        return time.perf_counter() - start

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
        self.step_wait_seconds = 0.0
        """Seconds optimizer steps waited for the copies of the save in flight (training blocked)."""
        self.buffers: dict[str, list[torch.Tensor]] = {}
        """The host copies of the last save, by file name in the tag: reused by the next snapshot of each file
        (:func:`snapshot`; free once the previous write finished, which :meth:`wait_previous` ensures). The price:
        host memory for one checkpoint of this rank, held for the run (as Megatron-LM's persistent buffers)."""

    @property
    def in_flight(self) -> bool:
        """A save was started and not committed yet."""
        return self._in_flight is not None

    def start(self, jobs: list[FileJob], writers: Writers, save: SaveCommit) -> None:
        """Start copying and writing ``jobs`` in the background (the previous save must be finished:
        :meth:`wait_previous`)."""
        self.step_wait_seconds = 0.0
        self._in_flight = (BackgroundSave(save.iteration, jobs, writers), save)

    def before_optimizer_step(self) -> None:
        """Hold the optimizer step (which changes parameters and optimizer states in place) until the save in
        flight has copied them; a no-op when nothing is in flight or the copy is done. Local: no collective."""
        if self._in_flight is not None:
            self.step_wait_seconds += self._in_flight[0].wait_copied()

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
                "saved checkpoint %s at iteration %d (copied in %.2f s and written in %.2f s in the background; "
                "the next optimizer step waited %.3f s for the copy)",
                save.tag_dir,
                save.iteration,
                pending.copy_seconds or 0.0,
                pending.write_seconds or 0.0,
                self.step_wait_seconds,
            )
