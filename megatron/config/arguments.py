"""The one place that turns Megatron-spelled command-line flags into a typed, frozen :class:`TridentConfig`.

    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", ...])
    validate(cfg, world_size=8)        # raises ValueError naming flag, value, rule and fix

Flags keep Megatron-DeepSpeed's spelling so users' launch scripts carry over. A few DeepSpeed-launcher flags
(``--local_rank``, ``--deepspeed``, ``--deepspeed_config``) are accepted as the launcher passes them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from megatron.config.checkpoint import CheckpointConfig
from megatron.config.data import DataConfig
from megatron.config.logging_config import LoggingConfig
from megatron.config.model import ModelConfig
from megatron.config.parallel import ParallelConfig
from megatron.config.training import TrainingConfig


@dataclass(frozen=True)
class TridentConfig:
    """All settings of a run, one frozen dataclass per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that raises ValueError instead of exiting, so callers decide how to report it."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"{message} (run with --help for the list of flags)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-key-value-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--normalization", choices=["layernorm", "rmsnorm"], default="layernorm")
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--use-rotary-position-embeddings", action="store_true")
    g.add_argument("--rotary-position-embeddings-theta", type=float, default=10000.0)
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument(
        "--checkpoint-activations", action="store_true", help="= --recompute-granularity full"
    )
    g.add_argument("--checkpoint-num-layers", type=int, default=None)
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default="uniform")
    g.add_argument(
        "--no-flash-attn", action="store_true", help="plain attention instead of torch SDPA"
    )
    g.add_argument(
        "--use-flash-attn", "--use-flash-attn-v2", action="store_true", help="SDPA (default)"
    )
    g.add_argument(
        "--per-shard-init", action="store_true", help="fast TP-dependent init (not invariant)"
    )
    # Accepted for script compatibility; mathematically a no-op with SDPA's fp32-accumulating softmax.
    g.add_argument("--no-query-key-layer-scaling", action="store_true")
    g.add_argument("--no-masked-softmax-fusion", action="store_true")
    g.add_argument("--no-bias-gelu-fusion", action="store_true")
    g.add_argument("--no-bias-dropout-fusion", action="store_true")


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--zero-stage", type=int, default=0)
    g.add_argument("--no-pipeline-parallel", action="store_true")
    g.add_argument("--distributed-backend", choices=["auto", "nccl", "gloo"], default="auto")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None)
    g.add_argument(
        "--deepspeed", action="store_true", help="accepted; Trident always uses DeepSpeed"
    )
    g.add_argument(
        "--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None
    )


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine", "inverse-square-root"],
        default="linear",
    )
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--no-exit-signal-handler", action="store_true")
    g.add_argument(
        "--skip-train",
        action="store_true",
        help="skip training; evaluate the (loaded) model on the validation and test data, then exit",
    )
    g.add_argument("--peak-tflops", type=float, default=None)


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=[])
    g.add_argument("--split", default="969, 30, 1")
    g.add_argument("--train-data-path", nargs="*", default=[])
    g.add_argument("--valid-data-path", nargs="*", default=[])
    g.add_argument("--test-data-path", nargs="*", default=[])
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument(
        "--data-impl", choices=["mmap", "infer"], default="mmap", help="accepted; mmap only"
    )
    g.add_argument("--dataloader-type", choices=["single", "cyclic"], default="single")
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--tokenizer-type", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")


def _add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--load-tag", default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--universal-checkpoint", action="store_true")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--metrics-file", default=None)
    g.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], default="INFO")


def build_parser(prog: str = "pretrain_gpt.py") -> argparse.ArgumentParser:
    """The full Trident parser (every group)."""
    p = _ArgumentParser(prog=prog, allow_abbrev=False, description="Trident GPT/LLaMA pretraining")
    for add in (
        _add_model_args,
        _add_parallel_args,
        _add_training_args,
        _add_data_args,
        _add_checkpoint_args,
        _add_logging_args,
    ):
        add(p)
    return p


def config_from_namespace(a: argparse.Namespace) -> TridentConfig:
    """Build the frozen config from parsed flags (no validation; see :func:`validate`)."""
    recompute: Literal["full", "selective"] | None = a.recompute_granularity or (
        "full" if a.checkpoint_activations else None
    )
    model = ModelConfig(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads,
        kv_channels=a.kv_channels,
        ffn_hidden_size=a.ffn_hidden_size,
        seq_length=a.seq_length,
        max_position_embeddings=a.max_position_embeddings,
        normalization=a.normalization,
        layernorm_epsilon=a.layernorm_epsilon,
        swiglu=a.swiglu,
        use_rotary_position_embeddings=a.use_rotary_position_embeddings,
        rotary_position_embeddings_theta=a.rotary_position_embeddings_theta,
        add_bias_linear=not a.disable_bias_linear,
        untie_embeddings_and_output_weights=a.untie_embeddings_and_output_weights,
        attention_dropout=a.attention_dropout,
        hidden_dropout=a.hidden_dropout,
        init_method_std=a.init_method_std,
        make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
        recompute_granularity=recompute,
        recompute_num_layers=a.recompute_num_layers or a.checkpoint_num_layers or 1,
        use_flash_attn=not a.no_flash_attn,
        layout_invariant_init=not a.per_shard_init,
    )
    parallel = ParallelConfig(
        tensor_model_parallel_size=a.tensor_model_parallel_size,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size,
        sequence_parallel=a.sequence_parallel,
        zero_stage=a.zero_stage,
        no_pipeline_parallel=a.no_pipeline_parallel,
        distributed_backend=a.distributed_backend,
        distributed_timeout_minutes=a.distributed_timeout_minutes,
        local_rank=a.local_rank,
    )
    training = TrainingConfig(
        **{
            name: getattr(a, name)
            for name in TrainingConfig.__dataclass_fields__
            if name not in ("exit_signal_handler", "deepspeed_config")
        },
        exit_signal_handler=not a.no_exit_signal_handler,
        deepspeed_config=a.deepspeed_config,
    )
    data = DataConfig(
        data_path=tuple(a.data_path),
        split=a.split,
        train_data_path=tuple(a.train_data_path),
        valid_data_path=tuple(a.valid_data_path),
        test_data_path=tuple(a.test_data_path),
        data_cache_path=a.data_cache_path,
        mock_data=a.mock_data,
        dataloader_type=a.dataloader_type,
        num_workers=a.num_workers,
        tokenizer_type=a.tokenizer_type,
        vocab_file=a.vocab_file,
        merge_file=a.merge_file,
        tokenizer_model=a.tokenizer_model,
        vocab_size=a.vocab_size,
        eod_mask_loss=a.eod_mask_loss,
        reset_position_ids=a.reset_position_ids,
        reset_attention_mask=a.reset_attention_mask,
    )
    checkpoint = CheckpointConfig(
        **{n: getattr(a, n) for n in CheckpointConfig.__dataclass_fields__}
    )
    logging_cfg = LoggingConfig(**{n: getattr(a, n) for n in LoggingConfig.__dataclass_fields__})
    return TridentConfig(model, parallel, training, data, checkpoint, logging_cfg)


def parse_args(argv: Sequence[str] | None = None) -> TridentConfig:
    """Parse Megatron-spelled flags into a :class:`TridentConfig`. Unknown flags raise ValueError."""
    return config_from_namespace(build_parser().parse_args(argv))
