"""The JIT build cache's safety parts (``loader.jit_build`` uses them): the build lock, the record that vouches for a
built library, atomic writes and the summary of a failed compile.

- **The lock** (``<folder>.lock`` beside the build folder) is an ``flock``: the kernel drops it when its holder dies,
  so a crashed build never blocks the next one on that host. Its holder writes ``pid <pid> host <host> since <t>``
  into the file, so a waiter can log who it waits for (at once, then every ``LOG_EVERY`` seconds) and give up after
  ``$TRIDENT_KERNEL_LOCK_TIMEOUT`` seconds (default 1800) with one error naming the file. Where a filesystem keeps
  the lock of a process that is gone (a network filesystem's lock server), a holder recorded on this host whose pid
  is dead is taken over: the lock file is replaced by a new one (the build itself stays race-free, see the loader).
- **The record** (``trident-build.json`` in the build folder: the library's name, size and sha256) is written last,
  atomically, after a successful build, and checked before the library is opened: a library cut short (a full disk
  during a copy of the cache) would otherwise be mapped by ``dlopen`` and kill the process with SIGBUS when a page
  past its end is touched. A missing or different record means a rebuild, never a load.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_TIMEOUT_ENV = "TRIDENT_KERNEL_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 1800.0
LOG_EVERY = 30.0
"""Seconds between two 'still waiting for the kernel build lock' lines."""
POLL = 0.2
STALE_GRACE = 1.0
"""Seconds a dead holder's record must stay before the lock is taken over (a new holder writes its own at once)."""
RECORD = "trident-build.json"


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: readers see the old file or the whole new
    one, never a part."""
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_record(library: Path) -> None:
    """Vouch for ``library`` (a freshly built ``.so``): its name, size and sha256 into ``RECORD`` beside it."""
    entry = {"file": library.name, "size": library.stat().st_size, "sha256": _digest(library)}
    write_atomic(library.parent / RECORD, (json.dumps(entry) + "\n").encode())


def record_problem(library: Path) -> str | None:
    """Why ``library`` must not be opened (None: its record vouches for it, size and sha256)."""
    record = library.parent / RECORD
    try:
        entry = json.loads(record.read_text(encoding="utf-8"))
        want_name, want_size, want_sha = entry["file"], int(entry["size"]), str(entry["sha256"])
    except FileNotFoundError:
        return f"{record} is missing (an interrupted build, or a cache copied without it)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{record} is unreadable ({exc})"
    if want_name != library.name:
        return f"{record} vouches for {want_name}, not {library.name}"
    size = library.stat().st_size
    if size != want_size:
        return f"{library} has {size} bytes, its build wrote {want_size} (cut short?)"
    if _digest(library) != want_sha:
        return f"{library} differs from what its build wrote (sha256 mismatch)"
    return None


# ------------------------------------------------------------------------------------------------- the build lock


def lock_timeout() -> float:
    """``$TRIDENT_KERNEL_LOCK_TIMEOUT`` seconds (default 1800).

    Raises:
        ValueError: the variable is not a positive number.
    """
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_LOCK_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{LOCK_TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


def _holder(handle_fd: int) -> tuple[str, int | None, str | None]:
    """(how to name the holder, its pid, its host) from the lock file's record."""
    try:
        text = os.pread(handle_fd, 512, 0).decode("utf-8", "replace")
    except OSError:
        text = ""
    found = re.match(r"pid (\d+) host (\S+) since (\S+)\n", text)
    if not found:
        return "a process that recorded nothing (an older Trident, or another tool)", None, None
    pid, host, since = int(found.group(1)), found.group(2), found.group(3)
    return f"pid {pid} on host {host} since {since}", pid, host


def _dead_here(pid: int | None, host: str | None) -> bool:
    if pid is None or host != socket.gethostname():
        return False  # a holder on another host cannot be checked from here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _take_over(path: Path, fd: int) -> None:
    """Replace the lock file whose holder is dead (only if it is still the file ``fd`` has open)."""
    with contextlib.suppress(FileNotFoundError):
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)


def _wait(path: Path, timeout: float) -> int:
    """An fd of ``path`` holding its lock; waits at most ``timeout`` seconds, logging who holds it."""
    start = time.monotonic()
    next_log = start
    dead_seen: dict[
        str, float
    ] = {}  # a dead holder's record -> when first seen (grace: a new holder)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if _try_lock(fd):
            return fd
        who, pid, host = _holder(fd)
        now = time.monotonic()
        if _dead_here(pid, host) and now - dead_seen.setdefault(who, now) >= STALE_GRACE:
            logger.warning(
                "fused kernels: taking over the build lock %s: its holder, %s, is no longer running",
                path,
                who,
            )
            _take_over(path, fd)
            os.close(fd)
            continue
        os.close(fd)
        if now - start >= timeout:
            raise RuntimeError(
                f"gave up after {now - start:.0f} s waiting for the kernel build lock {path}, held by {who}; "
                f"if no build is running there, delete {path} (or set {LOCK_TIMEOUT_ENV} to wait longer)"
            )
        if now >= next_log:
            logger.warning(
                "fused kernels: waiting for the build lock %s (held by %s; %.0f s so far, giving up after "
                "%.0f s)",
                path,
                who,
                now - start,
                timeout,
            )
            next_log = now + LOG_EVERY
        time.sleep(POLL)


@contextlib.contextmanager
def build_lock(path: Path, timeout: float | None = None) -> Iterator[None]:
    """Hold the build lock ``path`` (created if missing) for the ``with`` body, recording this process in it.

    Raises:
        RuntimeError: the lock stayed taken for ``timeout`` seconds (default :func:`lock_timeout`), naming it.
    """
    fd = _wait(path, lock_timeout() if timeout is None else timeout)
    try:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} host {socket.gethostname()} since {stamp}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


# ------------------------------------------------------------------------------------------ a failed compile


_ERROR = re.compile(r"\berror\b|\bfatal\b|undefined reference", re.IGNORECASE)


def error_lines(output: str, limit: int = 3, width: int = 240) -> str:
    """The first ``limit`` lines of a compiler's ``output`` that report an error, joined into one line (the first
    non-empty line where none does), each cut at ``width`` characters."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if _ERROR.search(ln) and not ln.startswith(("[", "FAILED:"))]
    picked = errors[:limit] or lines[:1] or ["(no output)"]
    return " | ".join(ln if len(ln) <= width else ln[: width - 3] + "..." for ln in picked)
