"""Runtime checkpointing: what training needs to save, find, check and load its checkpoints.

- :mod:`~megatron.checkpointing.engine`: ``DeepSpeedCheckpointer``, the save protocol and the load.
- :mod:`~megatron.checkpointing.pointers`: ``latest``, complete tags, auto-resume, crash-safe pointer updates.
- :mod:`~megatron.checkpointing.rules`: the start-up checks of --save/--load, with the resume-compatibility table.
- :mod:`~megatron.checkpointing.meta`: the ``trident_meta.json`` schema.
- readers: :mod:`~megatron.checkpointing.readers` (full weights of any layout), ``weights_only`` (one TP rank's
  weights, any ZeRO stage), ``zero3`` (ZeRO-3 partitions), ``safe_load`` (no pickle execution), ``rng``.

Offline conversions (Hugging Face, Megatron-DeepSpeed, universal, reshard) live in :mod:`megatron.conversion`; the
layout arithmetic they share with this package in :mod:`megatron.layout`.
"""
