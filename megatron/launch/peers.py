"""A peer's death seen from a surviving rank: one line instead of the transport's traceback.

When a rank dies (SIGKILL, the OOM killer, a crash), the collective every other rank is in (or enters next) fails at
once with the transport's error, e.g. gloo's ``RuntimeError: [.../pair.cc:537] Read error [127.0.0.1]:40165:
Connection reset by peer``. That traceback says nothing about which rank died. Each rank therefore records every
rank's (host, pid, process start time) once at start-up (one all-gather, in ``pretrain``); a surviving rank that
gets such an error looks at the peers on its own host:

* a peer whose process is a zombie (the launcher has not reaped it yet) shows its wait status in
  ``/proc/<pid>/stat`` (field 52): ``rank 1 (pid 4242) died with signal 9 (SIGKILL)`` or ``exited with code 3``;
* a peer whose pid is gone (or now belongs to a process that started at another time): ``rank 1 (pid 4242) is
  gone``;
* peers on other hosts cannot be seen from here: the line says so, and the launcher's own report (torchrun prints
  the exit code or signal of every rank it started) names them.

``pretrain_gpt.py`` prints the line (``rank R: lost contact with a peer (gloo: Connection reset by peer); rank K
(pid P) died with signal 9 (SIGKILL); stopping``) and exits with
:data:`~megatron.launch.exit_codes.EXIT_PEER_LOST`.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass

PEER_LOST_PHRASES: tuple[str, ...] = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",  # NCCL
    "NCCL communicator was aborted",
)
"""Transport messages that mean the other end of a connection went away (gloo's TCP pair, NCCL)."""


class PeerLostError(RuntimeError):
    """A collective failed because another rank went away; the message is the one line to print."""


@dataclass(frozen=True)
class Peer:
    """One rank's process, as recorded at start-up."""

    rank: int
    host: str
    pid: int
    start_ticks: int | None
    """Field 22 of ``/proc/<pid>/stat`` (start time since boot), so a reused pid is not taken for the peer."""


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (after the command name), or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def this_process(rank: int) -> Peer:
    """The :class:`Peer` record of the calling process."""
    fields = _stat_fields(os.getpid())
    return Peer(
        rank=rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        start_ticks=int(fields[19]) if fields else None,
    )


def peer_loss_reason(err: BaseException) -> str | None:
    """``"gloo: Connection reset by peer"`` when ``err`` says the other end of a connection went away, else None."""
    text = str(err)
    for phrase in PEER_LOST_PHRASES:
        if phrase in text:
            backend = "nccl" if "NCCL" in text or "nccl" in text else "gloo"
            return f"{backend}: {phrase}"
    return None


def _describe_status(status: int) -> str:
    """A ``waitpid`` status in words."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "unknown"
        return f"died with signal {sig} ({name})"
    if os.WIFEXITED(status):
        return f"exited with code {os.WEXITSTATUS(status)}"
    return "is gone"


def peer_fate(peer: Peer) -> str | None:
    """What became of ``peer`` (a process on this host): ``"died with signal 9 (SIGKILL)"``, ``"exited with code
    1"``, ``"is gone"``; None while it runs."""
    fields = _stat_fields(peer.pid)
    if fields is None:
        return "is gone"
    if peer.start_ticks is not None and int(fields[19]) != peer.start_ticks:
        return "is gone"  # the pid was reused
    if fields[0] in ("Z", "X"):  # a zombie: its wait status is readable until the launcher reaps it
        status = int(fields[49]) if len(fields) > 49 else 0
        return _describe_status(status) if status else "is gone"
    return None


def _local_fates(local: list[Peer], wait_s: float) -> list[str]:
    """What became of the ``local`` peers that stopped, polling up to ``wait_s`` seconds: a killed process closes
    its sockets (the survivor's error) before it turns into a zombie, so the first look can come too early."""
    deadline = time.monotonic() + wait_s
    while True:
        fates = [f"rank {p.rank} (pid {p.pid}) {fate}" for p in local if (fate := peer_fate(p))]
        if fates or time.monotonic() >= deadline:
            return fates
        time.sleep(0.05)


def peer_lost_message(rank: int, reason: str, peers: list[Peer], *, wait_s: float = 2.0) -> str:
    """The one line a surviving ``rank`` prints after ``reason`` (:func:`peer_loss_reason`); ``wait_s``: how long
    to wait for a local peer to show that it stopped."""
    host = socket.gethostname()
    local = [p for p in peers if p.host == host and p.rank != rank]
    fates = _local_fates(local, wait_s)
    remote = len([p for p in peers if p.host != host])
    if fates:
        what = "; ".join(fates)
    elif remote:
        what = (
            f"every rank on this host ({host}) still runs, so one of the {remote} ranks on other hosts died "
            "(see the launcher's report)"
        )
    else:
        what = "which one is not known here (see the launcher's report)"
    return f"rank {rank}: lost contact with a peer ({reason}); {what}; stopping"
