"""Logging helpers: ``logging`` loggers plus a rank-0 filter. No ``print`` anywhere in ``megatron/``."""

from __future__ import annotations

import logging
import os

_FORMAT = "[%(asctime)s] [%(levelname)s] [%(name)s] %(message)s"


def global_rank() -> int:
    """The global rank of this process: torch.distributed's if initialized, else the RANK variable, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def setup_logging(level: int = logging.INFO) -> None:
    """Configure the root logger once (idempotent); entry points call this, library code never does."""
    root = logging.getLogger()
    if not any(getattr(h, "_trident", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler._trident = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)


def log_rank_0(logger: logging.Logger, msg: str, *args: object, level: int = logging.INFO) -> None:
    """Log ``msg`` on global rank 0 only."""
    if global_rank() == 0:
        logger.log(level, msg, *args)
