"""Test utilities, imported by ``tests/`` alone (and ``tools/mpu_selfcheck.py``, the CLI of the mpu oracle).

``run_distributed`` spawns N CPU (gloo) or GPU (nccl) ranks (``megatron.launch.spawn`` underneath);
``mpu_oracle`` checks every TP layer and mapping against single-process PyTorch; ``tokenizers`` makes altered
tokenizer files.
"""

from megatron.testing.spawn import DistributedTestError, find_free_port, run_distributed

__all__ = ["DistributedTestError", "find_free_port", "run_distributed"]
