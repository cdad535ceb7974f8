"""Check a node's network setup for NCCL / Gloo over RoCE or InfiniBand before a long job.

    python -m tools.check_cluster                        # report + warnings (exit 0)
    python -m tools.check_cluster --strict               # exit 1 when there is any warning
    python -m tools.check_cluster --json > node0.json    # the same as JSON
    python -m tools.check_cluster --hostfile hostfile    # also check what a multi-node launch forwards

Prints the NCCL / Gloo / launcher variables that are set, every RDMA port with its GID table and the GID index
RoCE v2 needs, the network interfaces, ``nvidia-smi topo -m`` where it exists, and warnings that each name the
variable to set. Run it on every node: each node's sysfs is its own. Rules: ``megatron/diagnostics/cluster_check.py``.
Exit codes: 0 done, 1 warnings with --strict, 2 bad flags.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron.diagnostics.cluster_check import Inputs, check_cluster, format_report

DEEPSPEED_DEFAULT_HOSTFILE = Path("/job/hostfile")


class _Parser(argparse.ArgumentParser):
    """argparse that raises ValueError (reported by :func:`main` as one ``error:`` line, exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"{message} (run with --help for the list of flags)")


def main(argv: list[str] | None = None) -> int:
    """CLI entry: exit 0 (1 with --strict and a warning, 2 on bad flags)."""
    p = _Parser(prog="python -m tools.check_cluster", description=__doc__.splitlines()[0])
    p.add_argument("--sysfs-root", type=Path, default=Path("/sys"), help="default /sys")
    p.add_argument(
        "--hostfile",
        type=Path,
        default=None,
        help="DeepSpeed hostfile of the launch (default: /job/hostfile when it exists, as deepspeed)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when there is any warning")
    p.add_argument("--no-topology", action="store_true", help="do not run nvidia-smi topo -m")
    try:
        a = p.parse_args(argv)
        if not a.sysfs_root.is_dir():
            raise ValueError(
                f"--sysfs-root {a.sysfs_root} is not a directory; pass /sys or a copy of it"
            )
        if a.hostfile is not None and not a.hostfile.is_file():
            raise ValueError(
                f"--hostfile {a.hostfile} does not exist; pass the hostfile of the launch"
            )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hostfile = a.hostfile or (
        DEEPSPEED_DEFAULT_HOSTFILE if DEEPSPEED_DEFAULT_HOSTFILE.is_file() else None
    )
    report = check_cluster(
        Inputs(
            sysfs_root=a.sysfs_root,
            hostfile=hostfile,
            nvidia_smi=None if a.no_topology else "nvidia-smi",
        )
    )
    print(json.dumps(report.to_dict(), indent=1) if a.json else format_report(report))
    return 1 if a.strict and report.warnings else 0


if __name__ == "__main__":
    raise SystemExit(main())
