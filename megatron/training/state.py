"""``TrainState``: the mutable progress of a run (what a checkpoint restores besides the engine)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainState:
    """Mutable progress of a run (what a checkpoint must restore besides the engine)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_train_tokens: int = 0
    """Tokens trained on so far (global batch x --seq-length per iteration): --train-tokens and the token LR
    schedule count them."""
    consumed_valid_samples: int = 0
    """Validation samples drawn so far (a resumed run continues the validation stream where it stopped)."""
    skipped_iterations: int = 0
    history: list[float] = field(default_factory=list)
    """lm loss of every iteration run by this process (for library callers and tests)."""
    grad_norms: list[float | None] = field(default_factory=list)
    moe_history: list[float] = field(default_factory=list)
    """MoE loss term (--moe-loss-coeff x aux losses) of every iteration run by this process (MoE models only)."""
    """grad norm of every iteration run by this process (None where DeepSpeed computed none)."""
    last_valid_loss: float | None = None
    """The latest validation loss."""
    last_eval_iteration: int = -1
    """Iteration of the latest evaluation."""
