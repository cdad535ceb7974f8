"""Typed configuration: one frozen dataclass per concern, built once from Megatron-spelled flags."""

from megatron.config.arguments import TridentConfig, build_parser, config_from_namespace, parse_args
from megatron.config.checkpoint import CheckpointConfig
from megatron.config.data import DataConfig
from megatron.config.logging_config import LoggingConfig
from megatron.config.model import ModelConfig
from megatron.config.parallel import ParallelConfig
from megatron.config.plan import RunPlan
from megatron.config.training import TrainingConfig
from megatron.config.validate import validate

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "RunPlan",
    "TrainingConfig",
    "TridentConfig",
    "build_parser",
    "config_from_namespace",
    "parse_args",
    "validate",
]
