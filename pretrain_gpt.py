"""Pretrain a GPT/LLaMA model with Trident (3D parallelism: TP from megatron.mpu, ZeRO + PP from DeepSpeed).

Launch with ``torchrun``, ``deepspeed``, a plain RANK/WORLD_SIZE/MASTER_* environment, or plain
``python pretrain_gpt.py ...`` (a world of one process). Flags keep Megatron-DeepSpeed's spelling; see
``--help`` and ``examples/``.

Exit codes (``megatron/training/exit_codes.py``): 0 finished; 1 unexpected error (traceback); 2 bad flags or
missing files (one ``error: ...`` line); 3 --exit-interval; 4 --exit-duration-in-mins; 5 SIGTERM.
"""

from __future__ import annotations

import logging
import sys

from megatron.config import parse_args
from megatron.log import setup_logging
from megatron.training import preflight, pretrain
from megatron.training.exit_codes import EXIT_CONFIG_ERROR


def main(argv: list[str] | None = None) -> int:
    """Parse, check (before any process group), train; returns the process exit code."""
    try:
        cfg = parse_args(argv)
        setup_logging(getattr(logging, cfg.logging.log_level))
        checked = preflight(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        result = pretrain(cfg, checked=checked)
    except FileNotFoundError as e:  # a data or tokenizer file that vanished or was never there
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
