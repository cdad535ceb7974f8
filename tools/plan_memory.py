"""Plan a run's memory per rank, its FLOPs and collective bytes per step, from the flags of ``pretrain_gpt.py``.

    python -m tools.plan_memory --world-size 64 --gpu-type H100-80GB <the flags of pretrain_gpt.py>
    python -m tools.plan_memory --memory-gb 40 --num-layers 32 --hidden-size 4096 ... --bf16 --zero-stage 1

The flags are parsed and checked as a run would (the same one-line errors); the world size comes from
--world-size, else the launcher's WORLD_SIZE, else TP x PP x CP x Ulysses (DP 1). Arithmetic only: ``megatron/planning/memory_plan.py``
(``plan_for_config`` in ``megatron/training/preflight.py`` makes the run's checks first).
Exit codes: 0 fits (or no capacity given), 1 does not fit, 2 bad flags.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from megatron.checkpointing.model_args import read_checkpoint_model
from megatron.config import parse_args
from megatron.planning.memory_plan import GPU_MEMORY_GB, capacity_of, format_fit, format_plan
from megatron.planning.planner_config import PlannerConfig
from megatron.training.preflight import plan_for_config


class _Parser(argparse.ArgumentParser):
    """argparse that raises ValueError (reported by :func:`main` as one ``error:`` line, exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"{message} (run with --help for the list of flags)")


def _memory_gb(text: str) -> float:
    """--memory-gb: a positive finite number (``nan``, and ``1e400`` read as ``inf``, would fit every plan or none)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive finite number of GB (e.g. 80)"
        )
    return value


def _world_size(given: int | None, model_ranks: int) -> int:
    """--world-size, else WORLD_SIZE, else ``model_ranks`` = TP x PP x CP x Ulysses (a 0 given is an error, not
    "not given")."""
    if given is not None:
        if given < 1:
            raise ValueError(
                f"--world-size ({given}) must be at least 1; give the ranks in the job."
            )
        return given
    env = os.environ.get("WORLD_SIZE", "").strip()
    if not env:
        return model_ranks
    if not env.isdigit() or int(env) < 1:
        raise ValueError(
            f"WORLD_SIZE={env!r} (environment) is not a positive integer; unset it or pass --world-size."
        )
    return int(env)


def main(argv: list[str] | None = None) -> int:
    """CLI entry (see the module docstring for the exit codes)."""
    p = _Parser(
        prog="python -m tools.plan_memory", description=__doc__.splitlines()[0], add_help=False
    )
    p.add_argument(
        "--world-size", type=int, default=None, help="ranks in the job (default: WORLD_SIZE)"
    )
    p.add_argument("--gpu-type", choices=list(GPU_MEMORY_GB), default=None, help="device to fit")
    p.add_argument("--memory-gb", type=_memory_gb, default=None, help="device memory in GB to fit")
    try:
        own, rest = p.parse_known_args(argv)
        cfg = parse_args(rest, read_checkpoint_model=read_checkpoint_model)
        par = cfg.parallel
        model_ranks = (
            par.tensor_model_parallel_size
            * par.pipeline_model_parallel_size
            * par.context_parallel_size
            * par.ds_sequence_parallel_size
        )
        world = _world_size(own.world_size, model_ranks)
        capacity = capacity_of(own.gpu_type, own.memory_gb)
        plan, mp, ds_config = plan_for_config(cfg, world_size=world)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(format_plan(mp, plan)))
    if capacity is None:
        return 0
    pc = PlannerConfig.from_configs(cfg.model, cfg.parallel, cfg.training)
    print(format_fit(pc, plan, mp, capacity, ds_config))
    return 0 if mp.fits(capacity) else 1


if __name__ == "__main__":
    sys.exit(main())
