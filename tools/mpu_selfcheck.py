"""Self-check of the tensor-parallel core on this machine: every process group, TP layer, mapping and the
vocab-parallel cross entropy against single-process PyTorch references (forward and every gradient).

    python -m tools.mpu_selfcheck                       # 4 CPU ranks, TP 2 x PP 2 (gloo)
    python -m tools.mpu_selfcheck --world-size 8 --tp 4 --pp 1

Logs a PASS/FAIL table. Exit codes: 0 every check passed, 1 a check failed, 2 impossible degrees.
The checks are the test suite's oracle (``megatron.testing.mpu_oracle``): this CLI is a test driver, and the one
file outside ``tests/`` allowed to import ``megatron.testing`` (``tests/test_style.py``).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from megatron.log import setup_logging
from megatron.mpu.parallel_state import validate_degrees
from megatron.testing.mpu_oracle import run_selfcheck

logger = logging.getLogger("tools.mpu_selfcheck")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: exit 0 when every check passes, 1 when one fails, 2 on bad arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.mpu_selfcheck", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--world-size", type=int, default=4, help="number of CPU ranks to spawn (default 4)"
    )
    parser.add_argument(
        "--tp",
        "--tensor-model-parallel-size",
        type=int,
        default=2,
        dest="tp",
        help="tensor-parallel size (default 2)",
    )
    parser.add_argument(
        "--pp",
        "--pipeline-model-parallel-size",
        type=int,
        default=2,
        dest="pp",
        help="pipeline-parallel size (default 2)",
    )
    args = parser.parse_args(argv)
    setup_logging()
    try:
        validate_degrees(args.world_size, args.tp, args.pp)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    passed, table = run_selfcheck(args.world_size, args.tp, args.pp)
    logger.info("\n%s", table)
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
