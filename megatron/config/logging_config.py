"""``LoggingConfig``: what the run tells the user."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoggingConfig:
    """Progress lines, TensorBoard and the metrics JSONL."""

    log_interval: int = 100
    """--log-interval: iterations between progress lines."""
    tensorboard_dir: str | None = None
    """--tensorboard-dir: write TensorBoard scalars here."""
    metrics_file: str | None = None
    """--metrics-file: JSONL, one object per logged iteration and per evaluation (rank 0)."""
    log_level: str = "INFO"
    """--log-level: Python logging level."""
