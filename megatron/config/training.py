"""``TrainingConfig``: batch sizes, optimizer, LR schedule, precision, iteration/exit control."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TrainingConfig:
    """Everything that drives the optimization loop (Megatron flag spellings)."""

    micro_batch_size: int = 1
    """--micro-batch-size: samples per rank per forward/backward."""
    global_batch_size: int | None = None
    """--global-batch-size: samples per optimizer step (None = micro_batch_size * data-parallel size)."""
    seed: int = 1234
    """--seed: the one seed; initialization and data order derive from it, never from the rank."""
    train_iters: int | None = None
    """--train-iters: optimizer steps (exclusive with --train-samples)."""
    train_samples: int | None = None
    """--train-samples: samples to train on (exclusive with --train-iters)."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """--optimizer: adam (decoupled weight decay, i.e. AdamW) or sgd."""
    lr: float = 1e-4
    """--lr: peak learning rate."""
    min_lr: float = 0.0
    """--min-lr: floor of the decay."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "linear"
    """--lr-decay-style."""
    lr_decay_iters: int | None = None
    """--lr-decay-iters (None = train iters)."""
    lr_decay_samples: int | None = None
    """--lr-decay-samples (sample-based schedule)."""
    lr_warmup_iters: int = 0
    """--lr-warmup-iters."""
    lr_warmup_fraction: float | None = None
    """--lr-warmup-fraction: warmup as a fraction of the decay length."""
    lr_warmup_samples: int = 0
    """--lr-warmup-samples."""
    weight_decay: float = 0.01
    """--weight-decay (not applied to biases and norm weights)."""
    adam_beta1: float = 0.9
    """--adam-beta1."""
    adam_beta2: float = 0.999
    """--adam-beta2."""
    adam_eps: float = 1e-8
    """--adam-eps."""
    sgd_momentum: float = 0.9
    """--sgd-momentum."""
    clip_grad: float = 1.0
    """--clip-grad: global grad-norm clipping (0 disables)."""
    bf16: bool = False
    """--bf16: bfloat16 parameters and activations (fp32 master weights in DeepSpeed)."""
    fp16: bool = False
    """--fp16: float16 with dynamic loss scaling (GPU only)."""
    loss_scale: float | None = None
    """--loss-scale: static loss scale for fp16 (None = dynamic)."""
    initial_loss_scale: float = 2.0**32
    """--initial-loss-scale: dynamic scaler's start."""
    min_loss_scale: float = 1.0
    """--min-loss-scale."""
    loss_scale_window: int = 1000
    """--loss-scale-window: clean steps before the scale grows."""
    hysteresis: int = 2
    """--hysteresis: overflows tolerated before the scale shrinks."""
    eval_interval: int = 1000
    """--eval-interval: iterations between evaluations."""
    eval_iters: int = 100
    """--eval-iters: batches per evaluation (0 disables)."""
    exit_interval: int | None = None
    """--exit-interval: stop (and save) when iteration % N == 0."""
    exit_duration_in_mins: float | None = None
    """--exit-duration-in-mins: stop (and save) after this wall time."""
    exit_signal_handler: bool = True
    """SIGTERM saves a checkpoint and exits (--no-exit-signal-handler disables)."""
    skip_train: bool = False
    """--skip-train: no training iterations; only the end-of-training evaluations (valid, test) of the model
    (e.g. a --load'ed checkpoint)."""
    deepspeed_config: str | None = None
    """--deepspeed_config / --deepspeed-config: JSON adding DeepSpeed keys Trident does not own."""
    peak_tflops: float | None = None
    """--peak-tflops: per-device peak for MFU (None = look up the GPU, or none on CPU)."""
