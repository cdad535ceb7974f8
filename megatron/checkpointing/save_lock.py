"""One --save, one run: a lock file in the --save directory for the life of the run that writes there.

Two launches that auto-resume into the same --save would otherwise overwrite each other's checkpoints and move
``latest`` back and forth, both exiting 0. Global rank 0 of a run holds ``<--save>/.trident_save.lock`` (one holder per
run, not per node: rank 0 is the rank that moves the pointers), created atomically (``O_CREAT | O_EXCL``) and
holding one JSON object::

    {"host": "node17", "pid": 4242, "start_ticks": 8812345, "boot_id": "5f0c...", "started_at": "...", "argv": "..."}

``start_ticks`` is field 22 of ``/proc/<pid>/stat`` (the process's start time in clock ticks since boot): with the
boot id it tells a live holder from a dead one whose PID the kernel gave to another process. Removed when the run
ends in any way Python sees (exit 0, 2-6, 130, an exception); a SIGKILL or a node crash leaves it behind.

Another run finding the lock:

* held by a process that is alive on this host -> ``ValueError`` naming its host, PID and start time;
* left by a process of this host that is gone (no such PID, or the PID started at another time or another boot)
  -> taken over, with one log line naming the old holder;
* written on another host -> ``ValueError`` naming the host and PID, and how to delete the file if that run is gone
  (this host cannot see another host's processes).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LOCK_FILE = ".trident_save.lock"
_READ_RETRIES = 20
"""Reads of a lock file that is still empty (its creator is between ``open`` and ``write``), 50 ms apart."""


def _start_ticks(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time in clock ticks since boot); None without /proc or the PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: count fields after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _identity() -> dict[str, Any]:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "start_ticks": _start_ticks(pid),
        "boot_id": _boot_id(),
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "argv": " ".join(sys.argv)[:500],
    }


def _alive_here(holder: dict[str, Any]) -> bool:
    """Whether the holder (written on this host) is still running: same PID, same start time, same boot."""
    pid = int(holder.get("pid", -1))
    if pid <= 0:
        return False
    if holder.get("boot_id") and _boot_id() and holder["boot_id"] != _boot_id():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by another user
    ticks = holder.get("start_ticks")
    now = _start_ticks(pid)
    return ticks is None or now is None or int(ticks) == now


def _describe(holder: dict[str, Any]) -> str:
    when = f", started {holder['started_at']}" if holder.get("started_at") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{when}"


def _read(path: Path) -> dict[str, Any] | None:
    """The holder recorded in ``path``; None when the file is gone.

    Raises:
        ValueError: the file stays unreadable (not a lock this code wrote).
    """
    what = "is empty"
    for _ in range(_READ_RETRIES):
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:  # binary never becomes a lock's JSON: no retry
            raise ValueError(_not_a_lock(path, f"byte {err.start} is not UTF-8 text")) from None
        except json.JSONDecodeError as err:
            what = f"not JSON: {err.msg} at line {err.lineno} column {err.colno}" if raw else what
        else:
            if _is_holder(data):
                return data
            what = "JSON, but not the object with 'host' and 'pid' a Trident run writes"
        time.sleep(0.05)
    raise ValueError(_not_a_lock(path, what))


def _is_holder(data: Any) -> bool:
    """A lock's JSON as :func:`_identity` writes it (enough of it for :func:`_alive_here` and the messages)."""
    if not isinstance(data, dict) or not isinstance(data.get("host"), str):
        return False
    ticks = data.get("start_ticks")
    pid_ok = isinstance(data.get("pid"), int) and not isinstance(data.get("pid"), bool)
    return pid_ok and (ticks is None or (isinstance(ticks, int) and not isinstance(ticks, bool)))


def _not_a_lock(path: Path, what: str) -> str:
    return (
        f"{path} is not a Trident save lock ({what}): that file marks its --save directory as being written by a "
        f"running save. If no run is saving to {path.parent} now, remove it (rm '{path}') and relaunch."
    )


def _create(path: Path, me: dict[str, Any]) -> bool:
    """Create the lock atomically; False when it exists already."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, (json.dumps(me, sort_keys=True) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


class SaveLock:
    """The held lock of a --save directory; :meth:`release` removes it (only while it is still ours)."""

    def __init__(self, path: Path, me: dict[str, Any]) -> None:
        self.path = path
        self.holder = me

    def release(self) -> None:
        """Remove the lock file if it still names this process (idempotent)."""
        try:
            current = _read(self.path)
        except ValueError:
            return
        mine = current is not None and all(
            current.get(k) == self.holder[k] for k in ("host", "pid", "start_ticks")
        )
        if mine:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def _take_over(path: Path, stale: dict[str, Any]) -> bool:
    """Move a stale lock aside and delete it; False when another process replaced it meanwhile."""
    aside = path.with_name(f"{LOCK_FILE}.stale.{os.getpid()}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return True  # someone removed it: just try to create ours
    try:
        moved = _read(aside)
    except ValueError:
        moved = None
    if moved != stale:  # a taker that was quicker created a live lock in between: put it back
        with contextlib.suppress(OSError):
            os.link(aside, path)
        with contextlib.suppress(OSError):
            aside.unlink()
        return False
    aside.unlink()
    return True


def acquire_save_lock(save_dir: str) -> SaveLock:
    """Hold ``<save_dir>/.trident_save.lock`` for this process (see the module docstring).

    Raises:
        ValueError: another live run holds it (naming host, PID and start), or it was written on another host.
    """
    path = Path(save_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    me = _identity()
    for _ in range(3):
        if _create(path, me):
            return SaveLock(path, me)
        holder = _read(path)
        if holder is None:
            continue  # released between our create and our read
        if holder.get("host") != me["host"]:
            raise ValueError(
                f"--save {save_dir} is locked by another run: {_describe(holder)} ({path}). Two runs must not "
                "write one --save directory. If that run is no longer running (this host cannot check another "
                f"host's processes), delete {path} and relaunch."
            )
        if _alive_here(holder):
            raise ValueError(
                f"--save {save_dir} is in use by a running process: {_describe(holder)} ({path}). Two runs must "
                "not write one --save directory: wait for it to finish, stop it, or choose another --save."
            )
        if _take_over(path, holder):
            logger.warning(
                "--save %s: taking over the stale lock of %s (that process is gone; killed or crashed?)",
                save_dir,
                _describe(holder),
            )
    raise ValueError(
        f"--save {save_dir}: could not take the lock {path} (other processes keep replacing it); make sure a "
        "single run uses this directory."
    )
