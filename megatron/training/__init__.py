"""Training: DeepSpeed config, optimizer, LR schedule, the loop, logging and metrics.

Public entry: :func:`pretrain` (``megatron.training.pretrain``); :func:`preflight` runs every user-input check
before any process group exists and builds the run plan. Exit codes: :mod:`megatron.launch.exit_codes`.
"""

from megatron.training.preflight import Preflight, preflight
from megatron.training.pretrain import TrainResult, pretrain

__all__ = ["Preflight", "TrainResult", "preflight", "pretrain"]
