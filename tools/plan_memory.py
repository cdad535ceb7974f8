"""Plan a run's memory per rank, its FLOPs and collective bytes per step, from the flags of ``pretrain_gpt.py``.

    python -m tools.plan_memory --world-size 64 --gpu-type H100-80GB <the flags of pretrain_gpt.py>
    python -m tools.plan_memory --memory-gb 40 --num-layers 32 --hidden-size 4096 ... --bf16 --zero-stage 1

The flags are parsed and checked as a run would (the same one-line errors); the world size comes from
--world-size, else the launcher's WORLD_SIZE, else TP x PP. Arithmetic only: ``megatron/planning/memory_plan.py``
(``plan_for_config`` in ``megatron/training/preflight.py`` makes the run's checks first).
Exit codes: 0 fits (or no capacity given), 1 does not fit, 2 bad flags.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron.config import parse_args
from megatron.planning.memory_plan import GPU_MEMORY_GB, capacity_of, format_fit, format_plan
from megatron.planning.planner_config import PlannerConfig
from megatron.training.preflight import plan_for_config


class _Parser(argparse.ArgumentParser):
    """argparse that raises ValueError (reported by :func:`main` as one ``error:`` line, exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"{message} (run with --help for the list of flags)")


def main(argv: list[str] | None = None) -> int:
    """CLI entry (see the module docstring for the exit codes)."""
    p = _Parser(
        prog="python -m tools.plan_memory", description=__doc__.splitlines()[0], add_help=False
    )
    p.add_argument(
        "--world-size", type=int, default=None, help="ranks in the job (default: WORLD_SIZE)"
    )
    p.add_argument("--gpu-type", choices=list(GPU_MEMORY_GB), default=None, help="device to fit")
    p.add_argument("--memory-gb", type=float, default=None, help="device memory in GB to fit")
    try:
        own, rest = p.parse_known_args(argv)
        cfg = parse_args(rest)
        par = cfg.parallel
        world = (
            own.world_size
            or int(os.environ.get("WORLD_SIZE", "0"))
            or (par.tensor_model_parallel_size * par.pipeline_model_parallel_size)
        )
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
