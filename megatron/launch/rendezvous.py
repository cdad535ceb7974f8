"""The rendezvous environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every way a rank is
started.

Launchers: ``deepspeed`` (passes ``--local_rank`` and sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*), ``torchrun``
(sets the same variables), a plain environment with those variables, Slurm's ``srun`` (one task per GPU; the
variables are derived from ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``, the first host of
``SLURM_STEP_NODELIST`` and a port derived from ``SLURM_JOB_ID``, see :func:`slurm_rendezvous_env`), or a bare
``python pretrain_gpt.py`` with none of them: then this is a world of one process and :func:`ensure_rendezvous_env`
sets the variables itself (DeepSpeed would otherwise try MPI discovery and fail on ``mpi4py``).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

logger = logging.getLogger(__name__)

_RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: ``"gpu[007-010,12],cpu1"`` -> ``"gpu007"``, ``"r[1-2]-n[5-6]"`` ->
    ``"r1-n5"``.

    Raises:
        ValueError: an empty or unbalanced hostlist.
    """
    first, depth = "", 0
    for ch in nodelist.strip():
        if ch == "," and depth == 0:
            break
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0:
            break
        first += ch
    out, rest = "", first
    while "[" in rest:
        head, _, tail = rest.partition("[")
        inside, closed, rest = tail.partition("]")
        if not closed:
            depth = 1
            break
        out += head + inside.split(",")[0].split("-")[0]
    out += rest
    if not out or depth != 0 or "]" in out:
        raise ValueError(
            f"cannot read the Slurm node list {nodelist!r}; set MASTER_ADDR to the first node's address."
        )
    return out


def slurm_rendezvous_env(environ: Mapping[str, str]) -> dict[str, str]:
    """RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT for a task started by ``srun`` (empty dict otherwise).

    Only job steps (``SLURM_STEP_NUM_TASKS`` set by ``srun``) count: a batch script's own shell also has
    ``SLURM_PROCID``/``SLURM_NTASKS`` but is one process. MASTER_ADDR is the first host of the step's node list,
    MASTER_PORT from the job and step ids (:func:`_slurm_port`); values already set win.
    """
    if "SLURM_STEP_NUM_TASKS" not in environ or "SLURM_PROCID" not in environ:
        return {}
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
    env = {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_STEP_NUM_TASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_slurm_host(nodelist or "127.0.0.1"),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(_slurm_port(environ)),
    }
    return env


def _slurm_port(environ: Mapping[str, str]) -> int:
    """15000 + 16 * (job id mod 1000) + (step id mod 16): the same on every task of a step, different for
    concurrent steps of a job, and below Linux's ephemeral range (32768+), where the OS picks client ports."""

    def number(var: str) -> int:
        digits = "".join(ch for ch in environ.get(var, "") if ch.isdigit())
        return int(digits) if digits else 0

    return 15000 + 16 * (number("SLURM_JOB_ID") % 1000) + number("SLURM_STEP_ID") % 16


def ensure_rendezvous_env(local_rank: int | None = None) -> bool:
    """Make the environment describe a process group; returns True when a world of 1 was set up here.

    With RANK or WORLD_SIZE present (any launcher) only LOCAL_RANK is filled in (from ``--local_rank`` or 0); the
    rest must be there. Under ``srun`` without them, they come from Slurm's variables (:func:`slurm_rendezvous_env`).
    With none of them: RANK=0, WORLD_SIZE=1, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT.

    Raises:
        ValueError: a launcher environment lacks one of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
    """
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        slurm = slurm_rendezvous_env(os.environ)
        if slurm:
            os.environ.update(slurm)
            logger.info(
                "srun task %s of %s: rendezvous at %s:%s",
                slurm["RANK"],
                slurm["WORLD_SIZE"],
                slurm["MASTER_ADDR"],
                slurm["MASTER_PORT"],
            )
    created = "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    if created:
        os.environ["RANK"] = "0"
        os.environ["WORLD_SIZE"] = "1"
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(local_rank if local_rank is not None else 0)
    missing = [v for v in _RENDEZVOUS_VARS if v not in os.environ]
    if missing:
        raise ValueError(
            f"incomplete launch environment: {', '.join(missing)} not set (RANK={os.environ.get('RANK')}, "
            f"WORLD_SIZE={os.environ.get('WORLD_SIZE')}); launch with torchrun or deepspeed, or set "
            "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."
        )
    return created


def world_size_from_env() -> int:
    """WORLD_SIZE as an int (call :func:`ensure_rendezvous_env` first)."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"WORLD_SIZE={value!r} is not an integer.") from None


def local_world_size() -> int:
    """Ranks of this job on this node: LOCAL_WORLD_SIZE (torchrun, the spawner) or LOCAL_SIZE (DeepSpeed's launcher),
    else WORLD_SIZE (every rank counted here: the safe side)."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE"):
        value = os.environ.get(key, "")
        if value.strip().isdigit() and int(value) > 0:
            return int(value)
    return 1
