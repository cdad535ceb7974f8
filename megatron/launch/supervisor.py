"""Restart in the job for launchers that do not restart: the ``deepspeed`` launcher, Slurm's ``srun``, a plain
``python pretrain_gpt.py`` (``tools/supervise.py`` is the command line).

The supervisor runs the launch command (which must resume: ``--save D --load D``) in its own process group and
relays its output. When the command ends with a failure a relaunch can cure, it ends whatever is left of the
group, logs the restart and runs the same command again, which resumes from ``latest``::

    round 1  |== train ==x  (a rank dies: exit 8 / a signal; the watchdog: exit 7; a crash: exit 1)
                          |-- kill the group, read `latest`, log the restart --|
    round 2                                                                    |== load, train ==| exit 0

Restarted: exit 1 (an unexpected error), 7 (the hang watchdog), 8 (another rank died) and a death by a signal
(a negative status, 128 + n as shells and srun report it, 256 - n as DeepSpeed's launcher does; 130, Ctrl-C,
excepted). Not restarted: 0, 2 (bad
input), 3 and 4 (--exit-interval / --exit-duration-in-mins: stops the user asked for), 5 (SIGTERM), 6 (a NaN: the
same checkpoint would fail again) and 130. Each restart is one line with its cause (the exit code, or the most
telling line of the round's output: the watchdog's, a survivor's "lost contact" line, the launcher's report), the
iterations lost (the last iteration the round logged, from the metrics file or its output, against `latest`'s
iteration) and the time the restart took (the round's exit to the next round's first logged iteration). When
``max_restarts`` is spent, one final line and the last round's exit status.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from megatron.launch.exit_codes import (
    EXIT_HANG,
    EXIT_INTERRUPTED,
    EXIT_PEER_LOST,
    EXIT_REASONS,
)

RESTARTABLE_CODES = frozenset({1, EXIT_HANG, EXIT_PEER_LOST})
"""Exit codes a relaunch from ``latest`` can cure (besides deaths by a signal)."""

_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+")
_TELLING = ("hang watchdog:", "lost contact with a peer", "failed (exitcode:", "Error:", "error:")
"""Output lines that say why a round failed, most telling first."""


def signal_of(code: int) -> int:
    """The signal an exit status reports, else 0: ``-n`` (Python's ``Popen``), ``128 + n`` (shells, srun) and
    ``256 - n`` (a launcher that passed ``-n`` to ``sys.exit``, as DeepSpeed's does); 130 (Ctrl-C) is an exit."""
    if code < 0:
        return -code
    if 128 < code < 160 and code != EXIT_INTERRUPTED:
        return code - 128
    return 256 - code if 224 <= code < 256 else 0


def describe_status(code: int) -> str:
    """An exit status in words: ``"exit code 8 (another rank died)"``, ``"signal 9 (SIGKILL)"``."""
    sig = signal_of(code)
    if sig:
        try:
            return f"signal {sig} ({signal.Signals(sig).name})"
        except ValueError:
            return f"signal {sig}"
    reason = EXIT_REASONS.get(code)
    return f"exit code {code}" + (f" ({reason})" if reason else "")


def restartable(code: int) -> bool:
    """Whether a round that ended with ``code`` is relaunched (see the module docstring)."""
    return code in RESTARTABLE_CODES or signal_of(code) != 0


def flag_value(command: list[str], flag: str) -> str | None:
    """The value of ``flag`` in a command line (``--save D`` or ``--save=D``; the last one wins), else None."""
    value = None
    for i, arg in enumerate(command):
        if arg == flag and i + 1 < len(command):
            value = command[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def latest_iteration(save: Path | None) -> int | None:
    """The iteration of ``save/latest`` (``global_stepN``), or None without one."""
    try:
        tag = (save / "latest").read_text(encoding="utf-8").strip() if save else ""
    except OSError:
        return None
    found = re.fullmatch(r"global_step(\d+)", tag)
    return int(found.group(1)) if found else None


def last_logged_iteration(metrics_file: str | None) -> tuple[int, float] | None:
    """The last training iteration of a metrics JSONL and the file's modification time (when it was logged), or
    None (no file, no training row). Read before the resumed run truncates the file to its resume point."""
    if not metrics_file or not os.path.isfile(metrics_file):
        return None
    last = None
    with open(metrics_file, encoding="utf-8", errors="replace") as f:
        for line in f:
            if '"lm_loss"' not in line:
                continue
            try:
                last = int(json.loads(line)["iteration"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by the kill
    return None if last is None else (last, os.path.getmtime(metrics_file))


def last_metrics_iteration(metrics: Path | None) -> int | None:
    """The last training iteration in a metrics JSONL (``--metrics-file``), or None."""
    found = last_logged_iteration(str(metrics) if metrics else None)
    return None if found is None else found[0]


@dataclass
class Round:
    """One run of the command, as the supervisor saw it."""

    started: float
    exit_code: int = 0
    ended: float = 0.0
    first_iteration_at: float | None = None
    """When its first progress line appeared (``time.monotonic``)."""
    last_iteration: int | None = None
    """The last iteration its output logged."""
    last_iteration_at: float | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=400))


@dataclass(frozen=True)
class Restart:
    """One restart, as logged (and written to ``--restarts-file``)."""

    restart: int
    cause: str
    reached_iteration: int | None
    latest_iteration: int | None
    iterations_lost: int | None
    detect_s: float | None
    """The last logged iteration to the round's exit (how long the failure took to end the round)."""
    restart_s: float | None = None
    """The round's exit to the next round's first logged iteration (filled in once it appears)."""


def cause_of(rnd: Round) -> str:
    """The exit status and the most telling output line of a failed round."""
    status = describe_status(rnd.exit_code)
    for marker in _TELLING:
        for line in rnd.tail:
            if marker in line:
                return f"{status}: {line.strip()[:300]}"
    return status


@dataclass(frozen=True)
class SupervisorConfig:
    """What to run and how often to restart it."""

    command: list[str]
    max_restarts: int
    save: Path | None = None
    """Where `latest` is (default: the command's --save)."""
    metrics_file: Path | None = None
    """The run's metrics JSONL (default: the command's --metrics-file)."""
    grace_s: float = 10.0
    """After a round ends: seconds between SIGTERM and SIGKILL for what is left of its process group."""
    restarts_file: Path | None = None
    """Append one JSON object per restart here."""


class Supervisor:
    """Runs :class:`SupervisorConfig`'s command until it succeeds, fails for good or the budget is spent."""

    def __init__(
        self, cfg: SupervisorConfig, out: TextIO = sys.stdout, log: TextIO = sys.stderr
    ) -> None:
        self.cfg = cfg
        self.out, self.log = out, log
        self.save = cfg.save or _path(flag_value(cfg.command, "--save"))
        self.metrics = cfg.metrics_file or _path(flag_value(cfg.command, "--metrics-file"))
        self.restarts: list[Restart] = []
        self._child: subprocess.Popen[str] | None = None
        self._stopping = False
        self._restart_ended_at = 0.0

    def say(self, text: str) -> None:
        self.log.write(f"supervise: {text}\n")
        self.log.flush()

    def run(self) -> int:
        """Run the rounds; returns the exit status of the last one (0 when it finished)."""
        previous = _handle_stop_signals(self._stop)
        try:
            code = self._rounds()
            return code if code >= 0 else 128 - code  # a death by signal n, as a shell reports it
        finally:
            _handle_stop_signals(previous)

    def _rounds(self) -> int:
        while True:
            rnd = self._run_round()
            if rnd.exit_code == 0 or self._stopping or not restartable(rnd.exit_code):
                if rnd.exit_code != 0 and not self._stopping:
                    self.say(f"not restarted: {cause_of(rnd)}")
                return rnd.exit_code
            if len(self.restarts) >= self.cfg.max_restarts:
                self.say(
                    f"giving up: the restart budget ({self.cfg.max_restarts}) is spent; the last round ended "
                    f"with {cause_of(rnd)}"
                )
                return rnd.exit_code
            self._log_restart(rnd)

    def _run_round(self) -> Round:
        rnd = Round(started=time.monotonic())
        child = subprocess.Popen(  # noqa: S603 - the user's own launch command
            self.cfg.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        self._child = child
        reader = threading.Thread(target=self._relay, args=(child, rnd), daemon=True)
        reader.start()
        rnd.exit_code = child.wait()
        rnd.ended = time.monotonic()
        _end_group(child.pid, self.cfg.grace_s)
        reader.join(timeout=5)
        self._child = None
        return rnd

    def _relay(self, child: subprocess.Popen[str], rnd: Round) -> None:
        if child.stdout is None:  # opened with PIPE: never
            return
        for line in child.stdout:
            self.out.write(line)
            self.out.flush()
            rnd.tail.append(line)
            found = _ITERATION.search(line)
            if found:
                now = time.monotonic()
                rnd.last_iteration, rnd.last_iteration_at = int(found.group(1)), now
                if rnd.first_iteration_at is None:
                    rnd.first_iteration_at = now
                    if self.restarts:  # this round follows a restart: it is training again
                        self._came_back(rnd)

    def _log_restart(self, rnd: Round) -> None:
        reached = last_metrics_iteration(self.metrics)
        if reached is None or (rnd.last_iteration or 0) > reached:
            reached = rnd.last_iteration
        latest = latest_iteration(self.save)
        lost = None if reached is None else reached - (latest or 0)
        detect = None if rnd.last_iteration_at is None else rnd.ended - rnd.last_iteration_at
        restart = Restart(len(self.restarts) + 1, cause_of(rnd), reached, latest, lost, detect)
        self.restarts.append(restart)
        where = (
            "no checkpoint yet (starts over)"
            if latest is None
            else f"`latest` is iteration {latest}"
        )
        self.say(
            f"restart {restart.restart} of {self.cfg.max_restarts}: {restart.cause}; reached iteration "
            f"{_or_unknown(reached)}, {where}: {_or_unknown(lost)} iteration(s) lost"
            + (
                f"; the failure ended the round {detect:.1f} s after its last iteration"
                if detect
                else ""
            )
        )
        self._restart_ended_at = rnd.ended

    def _came_back(self, rnd: Round) -> None:
        last = self.restarts[-1]
        took = (rnd.first_iteration_at or 0.0) - self._restart_ended_at
        self.restarts[-1] = Restart(**{**asdict(last), "restart_s": took})
        self.say(
            f"restart {last.restart}: training again {took:.1f} s after the failed round ended"
        )
        if self.cfg.restarts_file is not None:
            with self.cfg.restarts_file.open("a", encoding="utf-8") as f:
                f.write(json.dumps(asdict(self.restarts[-1])) + "\n")

    def _stop(self, signum: int, _frame: object) -> None:
        """SIGTERM / SIGINT to the supervisor: passed on to the round, and no restart after it."""
        self._stopping = True
        if self._child is not None and self._child.poll() is None:
            os.killpg(self._child.pid, signum)


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


def _or_unknown(value: int | None) -> str:
    return "?" if value is None else str(value)


def _end_group(pgid: int, grace_s: float) -> None:
    """SIGTERM what is left of a round's process group, SIGKILL it after ``grace_s``: no rank of a dead round
    may still hold a port, a GPU or the save lock when the next round starts."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _handle_stop_signals(handler: Callable | dict | None) -> dict:
    """Install ``handler`` for SIGTERM and SIGINT (or restore a dict of previous handlers); returns the previous."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in previous:
        if isinstance(handler, dict):
            signal.signal(s, handler[s])
        elif handler is not None:
            signal.signal(s, handler)
    return previous
