"""Map a function over a stream in forked worker processes, results in input order, safe to stop at any moment.

Why not ``multiprocessing.Pool``: its workers share one result queue guarded by a process-shared lock. When
``Pool.terminate`` kills a worker while that worker holds the lock (it was writing a result), the pool's task thread
then waits for the lock forever and ``terminate`` never returns (seen as a rare hang of ``preprocess_data.py`` on a
bad line with ``--workers 2``). A worker that dies on its own (out of memory) loses its task and ``get`` waits
forever too. Here every worker has its own two pipes and nothing is shared, so:

- results come back in submission order (item ``k`` goes to worker ``k % n``, each worker is FIFO), so the output
  does not depend on the worker count;
- at most ``in_flight`` items per worker are outstanding (memory stays flat however long the stream);
- an exception raised by ``fn`` in a worker is raised again in the caller, as it is (or as ``RuntimeError`` with its
  text when it cannot be pickled);
- a worker that dies is noticed at once (its process sentinel) and raises :class:`WorkerDied` naming it and its
  signal or exit code, also when it dies half-way through sending an answer (the partial message is dropped and
  the exit status read) or while the caller hands it an item (no ``BrokenPipeError``);
- closing the iterator early, an error or Ctrl-C kills and reaps every worker before the caller sees the exception:
  killing a process that holds no shared lock cannot wedge anything.

Each worker drains its task pipe on a reader thread, so the caller's ``send`` never waits on a worker that is itself
waiting to send a result (no pipe-buffer deadlock, whatever the size of an item).
"""

from __future__ import annotations

import collections
import multiprocessing
import pickle
import queue
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


_INTERRUPTS = {signal.SIGINT, signal.SIGTERM}


class WorkerDied(RuntimeError):
    """A worker process ended without answering (killed, e.g. by the out-of-memory killer)."""


def _ignore_interrupts() -> None:
    """Workers leave Ctrl-C to the caller (one message, not one traceback per worker); SIGTERM ends them at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(
        signal.SIG_UNBLOCK, _INTERRUPTS
    )  # blocked by the caller while it forked us


WORKER_NAME = "trident-worker"
"""The process name (``ps``, ``top``, ``/proc/<pid>/comm``) of every worker, on Linux."""


def _name_process(name: str) -> None:
    """Best effort: set this process's name as ``ps`` shows it (Linux ``prctl(PR_SET_NAME)``; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 (any pickling failure: send the text instead)
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _serve(
    fn: Callable[[Any], Any], tasks: Connection, results: Connection, inherited: list[Connection]
) -> None:
    """Worker body: answer ``(True, fn(item))`` or ``(False, exception)`` per item, in order, until ``None``."""
    _ignore_interrupts()
    _name_process(WORKER_NAME)
    # The caller's ends of every pipe: without closing them here the caller's exit is not seen as EOF.
    for conn in inherited:
        conn.close()
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def read() -> None:
        while True:
            try:
                item = tasks.recv()
            except (EOFError, OSError):  # the caller is gone
                item = None
            inbox.put(item)
            if item is None:
                return

    threading.Thread(target=read, daemon=True).start()
    while (item := inbox.get()) is not None:
        try:
            answer: tuple[bool, Any] = (True, fn(item))
        except Exception as e:  # noqa: BLE001 (re-raised in the caller)
            answer = (False, _picklable(e))
        try:
            results.send(answer)
        except (BrokenPipeError, OSError):
            return


class _Worker:
    def __init__(
        self, ctx: Any, fn: Callable[[Any], Any], index: int, inherited: list[Connection]
    ) -> None:
        task_r, self.tasks = ctx.Pipe(duplex=False)
        self.results, result_w = ctx.Pipe(duplex=False)
        self.index = index
        self.proc = ctx.Process(
            target=_serve,
            args=(fn, task_r, result_w, [*inherited, self.tasks, self.results]),
            name=f"trident-worker-{index}",
            daemon=True,
        )
        held = signal.pthread_sigmask(
            signal.SIG_BLOCK, _INTERRUPTS
        )  # no Ctrl-C between fork and handlers
        try:
            self.proc.start()
            task_r.close()  # the child's ends: later workers must not inherit them
            result_w.close()
            signal.pthread_sigmask(
                signal.SIG_SETMASK, held
            )  # a Ctrl-C held back meanwhile is raised here
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            if self.proc.pid is not None:  # not yet in the caller's pool: reap it here
                self.proc.kill()
                self.proc.join()
            raise

    def receive(self) -> Any:
        ready = wait([self.results, self.proc.sentinel])
        if self.results in ready:
            try:
                ok, value = self.results.recv()
            except (
                EOFError,
                OSError,
            ):  # OSError: "got end of file during message", killed mid-answer
                ok, value = False, None
            if ok:
                return value
            if value is not None:
                raise value
        raise self.died()

    def send(self, item: Any) -> None:
        """Give the worker ``item``; a worker that is gone is :meth:`died`, not a ``BrokenPipeError``."""
        try:
            self.tasks.send(item)
        except OSError:  # BrokenPipeError: it was killed since its last answer
            raise self.died() from None

    def died(self) -> WorkerDied:
        """The error for a worker that ended without answering, naming its signal or exit code."""
        self.proc.join(timeout=5)
        code = self.proc.exitcode
        how = (
            f"was killed by signal {-code}"
            if code is not None and code < 0
            else f"exited with code {code}"
        )
        return WorkerDied(
            f"worker {self.index} (pid {self.proc.pid}) {how} before answering"
            + (
                " (signal 9 is usually the out-of-memory killer: use fewer workers)"
                if code == -9
                else " (signal 6 is an abort, e.g. a C++ std::bad_alloc: out of memory)"
                if code == -6
                else ""
            )
        )

    def stop(self, graceful: bool) -> None:
        if graceful and self.proc.is_alive():
            try:
                self.tasks.send(None)
            except OSError:
                pass
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.tasks.close()
        self.results.close()


def ordered_map(
    fn: Callable[[T], R], items: Iterable[T], workers: int, in_flight: int = 2
) -> Iterator[R]:
    """``fn(item)`` for every item, computed in ``workers`` forked processes, yielded in input order.

    ``fn`` is inherited by the fork (a closure or a bound method is fine, nothing is pickled but items and results).
    The caller must not run threads of its own while the workers are forked (fork copies only the calling thread).
    Every worker is reaped when the iterator ends, raises or is closed.
    """
    if workers < 1:
        raise ValueError(f"workers ({workers}) must be at least 1")
    ctx = multiprocessing.get_context("fork")
    pool: list[_Worker] = []
    graceful = False
    try:
        for i in range(workers):
            pool.append(_Worker(ctx, fn, i, [c for w in pool for c in (w.tasks, w.results)]))
        source = iter(items)
        pending: collections.deque[_Worker] = collections.deque()
        submitted = 0

        def submit() -> bool:
            nonlocal submitted
            item = next(source, _END)
            if item is _END:
                return False
            worker = pool[submitted % workers]
            worker.send(item)
            pending.append(worker)
            submitted += 1
            return True

        while len(pending) < workers * in_flight and submit():
            pass
        while pending:
            value = pending.popleft().receive()
            submit()
            yield value
        graceful = True
    finally:
        for worker in pool:
            worker.stop(graceful)


_END = object()
