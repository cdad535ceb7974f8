"""The trainer's interface to checkpointing (implemented by ``megatron/checkpointing``'s DeepSpeed save/load).

``pretrain(cfg, checkpoint_hooks=hooks)`` calls ``hooks.load`` once the engine and the LR schedule exist (before the
data iterators are built, so ``state.consumed_train_samples`` positions the sampler) and ``hooks.save`` every
--save-interval iterations and before every early exit (--exit-interval, --exit-duration-in-mins, SIGTERM).

What a save must contain to resume exactly: the engine (``engine.save_checkpoint``: weights, optimizer, ZeRO
partitions), ``scheduler.state_dict()``, ``state.iteration``, ``state.consumed_train_samples`` (the sampler's
position) and the RNG states. Without explicit hooks, ``pretrain`` uses
``megatron.checkpointing.engine.DeepSpeedCheckpointer`` whenever --save or --load is given.
"""

from __future__ import annotations

from typing import Any, Protocol

from megatron.training.lr_scheduler import OptimizerParamScheduler
from megatron.training.state import TrainState


class CheckpointHooks(Protocol):
    """Save/load callbacks of a run (every rank calls them; they may use collectives)."""

    def load(self, engine: Any, scheduler: OptimizerParamScheduler, state: TrainState) -> None:
        """Restore from --load (if it holds a checkpoint): engine, scheduler, ``state`` fields."""

    def restore_rng(self) -> None:
        """Restore the loaded RNG states; called after the data iterators exist (creating a DataLoader iterator
        draws from torch's default generator, so restoring earlier would shift every later dropout mask)."""

    def save(self, engine: Any, scheduler: OptimizerParamScheduler, state: TrainState) -> None:
        """Write a checkpoint of the current iteration to --save (or, --async-save, start writing it; hooks
        that write in the background also have ``finalize_save(blocking=...)``, called by the trainer at each
        iteration's end and before the run exits)."""
