"""DeepSpeed activation checkpointing (--deepspeed-activation-checkpointing), configured once per run.

With the flag and full recomputation (--checkpoint-activations / --recompute-granularity full) the model checkpoints
its layer chunks through ``deepspeed.checkpointing.checkpoint`` (:func:`megatron.model.transformer.checkpoint_chunk`,
PP = 1 and PP > 1 alike) instead of ``mpu.random.checkpoint``. This module sets DeepSpeed's side up, as
Megatron-DeepSpeed's ``setup_deepspeed_random_and_activation_checkpointing`` does:

* ``deepspeed.checkpointing.configure(mpu_=<the run's ParallelState>, ...)`` with the five options (partition over the TP group,
  contiguous buffers sized for ``ceil(num_layers / recompute_num_layers)`` chunks, CPU copies, synchronize,
  profile); the JSON's ``activation_checkpointing`` section is not read (every option comes from a flag, as in
  Megatron-DeepSpeed, whose flags override all of it);
* ONE RNG tracker. Dropout draws from Trident's tracker (``mpu.random.get_cuda_rng_tracker()``: seeded by
  ``model_parallel_cuda_manual_seed``, saved and restored by ``megatron/checkpointing/rng.py``); DeepSpeed's
  checkpoint saves and restores ``deepspeed.checkpointing.get_cuda_rng_tracker()``. Megatron-DeepSpeed makes its
  mpu functions delegate to DeepSpeed's tracker; Trident does the reverse: DeepSpeed's accessor is pointed at
  Trident's tracker object (``deepspeed_internals.share_rng_tracker``). The object, its ``{"cpu", "cuda"}`` states,
  its seeding and its checkpoint format stay as they are, whichever checkpoint function runs, so a resume is as
  exact as without the flag; DeepSpeed only calls ``get_states`` / ``set_states`` on it.

The default generators are handled alike by both checkpoint functions (CPU state + the accelerator's state saved
before the forward, restored for the recomputation), so the recomputed masks equal the forward's.
"""

from __future__ import annotations

import logging
import math

from megatron import mpu
from megatron.config import ModelConfig
from megatron.deepspeed_internals import share_rng_tracker
from megatron.mpu.parallel_state import ParallelState

logger = logging.getLogger(__name__)


def num_checkpoints(config: ModelConfig) -> int:
    """Checkpointed chunks per forward of the whole stack (DeepSpeed sizes the contiguous buffers with it)."""
    if config.recompute_method == "block":
        return min(config.recompute_num_layers, config.num_layers)
    return math.ceil(config.num_layers / config.recompute_num_layers)


def configure_deepspeed_checkpointing(config: ModelConfig, state: ParallelState) -> bool:
    """Configure ``deepspeed.checkpointing`` for this process and share the RNG tracker; False when the flag is off.

    ``state``: the run's groups (``initialize_model_parallel``'s result), DeepSpeed's ``mpu_``: it reads the TP
    group from it. Call before the first forward. Calling it again (another run in the same process) reconfigures
    from scratch.
    """
    if not config.deepspeed_activation_checkpointing:
        return False
    import deepspeed

    share_rng_tracker(mpu.get_cuda_rng_tracker())
    deepspeed.checkpointing.configure(
        state,
        partition_activations=config.partition_activations,
        contiguous_checkpointing=config.contiguous_checkpointing,
        num_checkpoints=num_checkpoints(config),
        checkpoint_in_cpu=config.checkpoint_in_cpu,
        synchronize=config.synchronize_each_layer,
        profile=config.profile_backward,
    )
    if config.partition_activations and state.get_tensor_model_parallel_world_size() == 1:
        logger.info(
            "--partition-activations at TP = 1: each rank keeps its checkpoints whole (as DeepSpeed)"
        )
    return True
