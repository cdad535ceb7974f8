"""Training: DeepSpeed config, optimizer, LR schedule, the loop, logging and metrics.

Public entry: :func:`pretrain` (``megatron.training.pretrain``); :func:`preflight` runs every user-input check
before any process group exists. Exit codes: :mod:`megatron.training.exit_codes`.
"""

from megatron.training.pretrain import Preflight, TrainResult, preflight, pretrain

__all__ = ["Preflight", "TrainResult", "preflight", "pretrain"]
