"""``CheckpointConfig``: saving, loading and resuming."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoint flags (DeepSpeed layout: global_stepN/, latest, latest_checkpointed_iteration.txt)."""

    save: str | None = None
    """Directory to write checkpoints into."""
    save_interval: int | None = None
    """Iterations between saves (the last iteration and every early exit save too)."""
    async_save: bool = False
    """Write checkpoints in the background: training is blocked only while the state is copied to host memory;
    'latest' moves once every rank's files are written; at most one save in flight; the run's exit waits for it."""
    load: str | None = None
    """Directory to resume from (no checkpoint there: start from scratch; the same as --save: auto-resume)."""
    load_tag: str | None = None
    """Load this tag instead of the one 'latest' names."""
    no_load_optim: bool = False
    """Load weights, schedule and iteration but not the optimizer state."""
    no_load_rng: bool = False
    """Keep fresh RNG states instead of the checkpoint's."""
    no_load_lr_state: bool = False
    """Do not load the LR schedule's state: it starts from sample 0 with the flags' constants (warmup again)."""
    reset_iteration: bool = False
    """Load weights, optimizer, LR schedule and RNG but restart at iteration 0 with 0 consumed samples/tokens."""
    finetune: bool = False
    """Load weights only and start at iteration 0."""
    pretrained_checkpoint: str | None = None
    """LoRA (--lora-rank): the checkpoint directory the frozen base weights are read from (any TP/PP layout), on
    every start; --load/--save then hold the adapters only (Megatron-LM's flag)."""
    use_checkpoint_args: bool = False
    """Take the model's architecture flags from the --load checkpoint's trident_meta.json (its --seq-length too
    unless given); an explicit model flag that disagrees with the checkpoint is an error (Megatron settles it
    silently)."""
    universal_checkpoint: bool = False
    """Load a DeepSpeed universal checkpoint (any TP/PP/DP; from tools/checkpoint/to_universal)."""
    verify_checkpoint_checksums: bool = True
    """Check the SHA-256 of every checkpoint file a rank loads against the one recorded at save (sizes are
    always checked); --no-verify-checkpoint-checksums skips the hashing for huge checkpoints on trusted storage."""
    exit_on_missing_checkpoint: bool = False
    """Stop (exit 2) instead of starting from scratch when --load holds no checkpoint (a mistyped path)."""
