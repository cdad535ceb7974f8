"""Trident: 3D-parallel GPT/LLaMA pretraining (tensor parallelism from ``megatron.mpu``, ZeRO and pipeline
parallelism from DeepSpeed), in the Megatron-DeepSpeed tradition."""

__version__ = "0.1.0"
