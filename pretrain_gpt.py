"""Pretrain a GPT/LLaMA model with Trident (3D parallelism: TP from megatron.mpu, ZeRO + PP from DeepSpeed).

Launch with ``torchrun``, ``deepspeed``, a plain RANK/WORLD_SIZE/MASTER_* environment, or plain
``python pretrain_gpt.py ...`` (a world of one process). Flags keep Megatron-DeepSpeed's spelling; see
``--help`` and ``examples/``.

Exit codes (``megatron/training/exit_codes.py``): 0 finished; 1 unexpected error (traceback); 2 bad flags or
missing files (one ``error: ...`` line); 3 --exit-interval; 4 --exit-duration-in-mins; 5 SIGTERM.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

from megatron.config import parse_args
from megatron.log import setup_logging
from megatron.training import preflight, pretrain
from megatron.training.exit_codes import EXIT_CONFIG_ERROR
from megatron.training.initialize import destroy_distributed


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
    destroy_distributed()  # every rank returns here together (after an exception, others may be mid-collective)
    return result.exit_code


def exit_now(code: int) -> None:
    """Flush and end the process without interpreter finalization.

    Gloo's worker threads release the tensors of the last collectives asynchronously; a release that lands during
    interpreter finalization needs the GIL, cannot get it, and aborts the process ("terminate called without an
    active exception", exit -6) after a run that ended well (torch's own issue; seen in about 1 of 8 two-rank runs
    here). Everything this process writes is closed by ``pretrain`` before it returns.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        exit_code = main()
    except Exception:  # noqa: BLE001 - printed like Python would, then the same exit code 1
        traceback.print_exc()
        exit_code = 1
    exit_now(exit_code)
