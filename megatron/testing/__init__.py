"""Test and self-check utilities: ``run_distributed`` spawns N CPU (gloo) or GPU (nccl) processes."""

from megatron.testing.spawn import DistributedTestError, find_free_port, run_distributed

__all__ = ["DistributedTestError", "find_free_port", "run_distributed"]
