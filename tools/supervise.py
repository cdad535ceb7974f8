"""Restart a training job from `latest` when a rank dies or hangs (for the ``deepspeed`` launcher, ``srun`` or a
plain process; torchrun restarts by itself with ``--max-restarts``).

    python -m tools.supervise --max-restarts 4 -- deepspeed pretrain_gpt.py ... --save ck --load ck
    python -m tools.supervise --max-restarts 4 -- srun --kill-on-bad-exit=1 python pretrain_gpt.py ... --save ck --load ck

Each restart is one ``supervise:`` line (cause, iterations lost, time it took); see docs/reliability.md.
Exit status: the last round's (0 when the run finished); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron.launch.supervisor import Supervisor, SupervisorConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-restarts", type=int, default=3, help="restart budget (default 3)")
    p.add_argument("--save", type=Path, help="where `latest` is (default: the command's --save)")
    p.add_argument("--metrics-file", type=Path, help="default: the command's --metrics-file")
    p.add_argument("--restarts-file", type=Path, help="append one JSON object per restart here")
    p.add_argument(
        "--grace-seconds",
        type=float,
        default=10.0,
        help="after a failed round: SIGTERM to SIGKILL of what is left of it (default 10)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the launch command")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("no command: give the launch command after --")
    if a.max_restarts < 0 or a.grace_seconds < 0:
        p.error("--max-restarts and --grace-seconds must be >= 0")
    cfg = SupervisorConfig(
        command=command,
        max_restarts=a.max_restarts,
        save=a.save,
        metrics_file=a.metrics_file,
        grace_s=a.grace_seconds,
        restarts_file=a.restarts_file,
    )
    try:
        return Supervisor(cfg).run()
    except OSError as err:  # the command cannot be started (not found, not executable)
        print(f"error: cannot run {command[0]!r}: {err.strerror or err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
