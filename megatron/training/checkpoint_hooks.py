"""The trainer's interface to checkpointing (implemented by ``megatron/checkpointing``'s DeepSpeed save/load).

``pretrain(cfg, checkpoint_hooks=hooks)`` calls ``hooks.load`` once the engine and the LR schedule exist (before the
data iterators are built, so ``state.consumed_train_samples`` positions the sampler) and ``hooks.save`` every
--save-interval iterations and before every early exit (--exit-interval, --exit-duration-in-mins, SIGTERM).

What a save must contain to resume exactly: the engine (``engine.save_checkpoint``: weights, optimizer, ZeRO
partitions), ``scheduler.state_dict()``, ``state.iteration``, ``state.consumed_train_samples`` (the sampler's
position) and the RNG states. Without hooks, --save/--load are refused before any process group is created.
"""

from __future__ import annotations

from typing import Any, Protocol

from megatron.training.loop import TrainState
from megatron.training.lr_scheduler import OptimizerParamScheduler


class CheckpointHooks(Protocol):
    """Save/load callbacks of a run (every rank calls them; they may use collectives)."""

    def load(self, engine: Any, scheduler: OptimizerParamScheduler, state: TrainState) -> None:
        """Restore from --load (if it holds a checkpoint): engine, scheduler, ``state`` fields."""

    def save(self, engine: Any, scheduler: OptimizerParamScheduler, state: TrainState) -> None:
        """Write a checkpoint of the current iteration to --save."""


def check_checkpoint_flags(save: str | None, load: str | None, hooks: object | None) -> None:
    """Refuse --save/--load when no checkpoint implementation is wired in (no silent no-op).

    Raises:
        ValueError: naming the flag.
    """
    if hooks is None and (save or load):
        flag = "--save" if save else "--load"
        raise ValueError(
            f"{flag} was given, but this build of the trainer has no checkpoint save/load wired in yet; "
            f"drop {flag} (and --save-interval/--load) for now."
        )
