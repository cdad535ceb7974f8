"""Pretrain a GPT/LLaMA model with Trident (3D parallelism: TP from megatron.mpu, ZeRO + PP from DeepSpeed).

Launch with ``torchrun``, ``deepspeed``, a plain RANK/WORLD_SIZE/MASTER_* environment, or plain
``python pretrain_gpt.py ...`` (a world of one process). Flags keep Megatron-DeepSpeed's spelling; see
``--help`` and ``examples/``.

Exit codes (``megatron/launch/exit_codes.py``): 0 finished; 1 unexpected error (traceback); 2 bad flags or
missing files, a --save another run holds, LR flags that differ from the checkpoint's schedule (one ``error: ...``
line); 3 --exit-interval; 4 --exit-duration-in-mins; 5 SIGTERM; 6 a NaN/Inf loss or grad norm (or a step
DeepSpeed skipped in fp32/bf16); 7 the hang watchdog (--hang-timeout-minutes); 8 another rank died (one line naming
it); 130 Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from megatron.config import TridentConfig, parse_args
from megatron.config.checkpoint_args import CheckpointModel


def main(argv: list[str] | None = None) -> int:
    """Parse, check (before any process group), train; returns the process exit code.

    The flags are parsed before torch and DeepSpeed are imported, so ``--help`` and a mistyped flag answer at once
    (argparse's one line and exit 2) instead of after several seconds of imports.
    """
    try:
        cfg = parse_args(argv, read_checkpoint_model=_read_checkpoint_model)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2  # EXIT_CONFIG_ERROR of megatron/launch/exit_codes.py (importing it would import torch first)
    from megatron.launch.exit_codes import EXIT_INTERRUPTED

    try:
        return _main(cfg)
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (start-up, or a second Ctrl-C)
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED


def _read_checkpoint_model(load: str, load_tag: str | None, universal: bool) -> CheckpointModel:
    """--use-checkpoint-args: the --load checkpoint's model record (imported here, so only that flag pays for it)."""
    from megatron.checkpointing.model_args import read_checkpoint_model

    return read_checkpoint_model(load, load_tag, universal)


def eval_harness_factory(cfg: TridentConfig) -> Callable[[Any], Any] | None:
    """--eval-harness-tasks: ``megatron.evaluation``'s harness over the training model (the training package does
    not import evaluation, so the entry point hands it to ``pretrain``); None without the flag."""
    if not cfg.training.eval_harness_tasks:
        return None
    from megatron.evaluation.during_training import training_harness

    return training_harness


def _main(cfg: TridentConfig) -> int:
    from megatron.checkpointing.engine import CheckpointSaveError
    from megatron.launch.elastic import record_failure
    from megatron.launch.exit_codes import EXIT_CONFIG_ERROR, EXIT_PEER_LOST, ConfigError
    from megatron.launch.peers import PeerLostError
    from megatron.log import setup_logging
    from megatron.training import preflight, pretrain
    from megatron.training.initialize import destroy_distributed

    try:
        setup_logging(getattr(logging, cfg.logging.log_level))
        checked = preflight(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        result = pretrain(cfg, checked=checked, eval_harness=eval_harness_factory(cfg))
    except (
        FileNotFoundError,
        ConfigError,
        CheckpointSaveError,
    ) as e:  # + a save that failed (disk full)
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except PeerLostError as e:  # the groups are broken: no teardown
        print(str(e), file=sys.stderr)
        record_failure(str(e))  # for the restart line of torchrun's next round
        return EXIT_PEER_LOST
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
