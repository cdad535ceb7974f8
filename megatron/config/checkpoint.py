"""``CheckpointConfig``: saving, loading and resuming."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoint flags (DeepSpeed layout: global_stepN/, latest, latest_checkpointed_iteration.txt)."""

    save: str | None = None
    """--save: directory to write checkpoints into."""
    save_interval: int | None = None
    """--save-interval: iterations between saves."""
    load: str | None = None
    """--load: directory to resume from (no checkpoint there = start from scratch)."""
    load_tag: str | None = None
    """--load-tag: a specific tag instead of `latest`."""
    no_load_optim: bool = False
    """--no-load-optim: weights (and scheduler) only."""
    no_load_rng: bool = False
    """--no-load-rng: keep fresh RNG states."""
    finetune: bool = False
    """--finetune: load weights only and restart at iteration 0."""
    universal_checkpoint: bool = False
    """--universal-checkpoint: load a DeepSpeed universal checkpoint (any TP/PP/DP)."""
