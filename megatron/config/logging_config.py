"""``LoggingConfig``: what the run tells the user."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class LoggingConfig:
    """Progress lines, TensorBoard and the metrics JSONL."""

    log_interval: int = 100
    """Iterations between progress lines."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars into this directory."""
    metrics_file: str | None = None
    """JSONL file with one object per logged iteration and per evaluation (rank 0)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Python logging level."""
