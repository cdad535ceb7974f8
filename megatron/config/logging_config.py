"""``LoggingConfig``: what the run tells the user (progress lines, timers, TensorBoard, Weights & Biases)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

DEFAULT_STRAGGLER_THRESHOLD = 1.5
"""--straggler-threshold when --log-straggler is given without it."""


@dataclass(frozen=True)
class LoggingConfig:
    """Progress lines, timers, TensorBoard, Weights & Biases and the metrics JSONL."""

    log_interval: int = 100
    """Iterations between progress lines."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars into this directory."""
    metrics_file: str | None = None
    """JSONL file with one object per logged iteration and per evaluation (rank 0)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Python logging level."""
    timing_log_level: Literal[0, 1, 2] = 0
    """Which timers exist: 0 iteration time only; 1 also forward-backward and optimizer (once per iteration);
    2 also forward-compute, backward-compute, batch-generator and the pipeline send/recv (per micro-batch)."""
    timing_log_option: Literal["max", "minmax", "all"] = "minmax"
    """Timer line over ranks: the max, the (min, max), or every rank's time."""
    barrier_with_level_1_timing: bool = True
    """Level-1 timers start and stop with a barrier over all ranks (times then exclude waiting for others)."""
    tensorboard_log_interval: int = 1
    """Iterations between TensorBoard/W&B training scalars (the progress line keeps --log-interval)."""
    tensorboard_queue_size: int = 1000
    """TensorBoard events kept in memory before a write to disk."""
    log_timers_to_tensorboard: bool = False
    """Write the timers (max over ranks, seconds per iteration) and the iteration time to TensorBoard."""
    log_batch_size_to_tensorboard: bool = False
    """Write the global batch size to TensorBoard."""
    log_learning_rate_to_tensorboard: bool = True
    """Write the learning rate to TensorBoard."""
    log_loss_scale_to_tensorboard: bool = True
    """Write the loss scale to TensorBoard."""
    log_validation_ppl_to_tensorboard: bool = False
    """Write the validation (and test) perplexity to TensorBoard."""
    log_optimizer_states_to_tensorboard: bool = False
    """Write L1/L2 norms and abs-max of Adam's moments and of the weights to TensorBoard."""
    log_memory_to_tensorboard: bool = False
    """Write memory use to TensorBoard (CUDA allocator stats; the process RSS on CPU)."""
    log_world_size_to_tensorboard: bool = False
    """Write the world size to TensorBoard."""
    log_params_norm: bool = False
    """Compute the L2 norm of the parameters (progress line and TensorBoard)."""
    log_num_zeros_in_grad: bool = False
    """Count the zero entries of the gradients the optimizer applies (progress line and TensorBoard)."""
    log_straggler: bool = False
    """Every --log-interval, name the ranks slower than --straggler-threshold x the median of their peers (rank,
    host, slowdown) in the log, the metrics file and TensorBoard."""
    straggler_threshold: float | None = None
    """--log-straggler names a rank whose own work per iteration (step time less the time it waited in
    collectives or was kept off a CPU) exceeds this multiple of its peers' median (default 1.5; only with
    --log-straggler)."""

    @property
    def straggler_threshold_or_default(self) -> float:
        """--straggler-threshold, else its default (1.5)."""
        return (
            DEFAULT_STRAGGLER_THRESHOLD
            if self.straggler_threshold is None
            else self.straggler_threshold
        )

    wandb_project: str | None = None
    """Log to Weights & Biases in this project (needs pip install wandb; offline unless WANDB_MODE is set)."""
    wandb_exp_name: str | None = None
    """The Weights & Biases run name."""
    wandb_save_dir: str | None = None
    """Directory of the Weights & Biases run files (default: <--save>/wandb, else ./wandb)."""


_NEEDS_A_SINK = (
    ("--log-timers-to-tensorboard", "log_timers_to_tensorboard"),
    ("--log-batch-size-to-tensorboard", "log_batch_size_to_tensorboard"),
    ("--log-validation-ppl-to-tensorboard", "log_validation_ppl_to_tensorboard"),
    ("--log-optimizer-states-to-tensorboard", "log_optimizer_states_to_tensorboard"),
    ("--log-memory-to-tensorboard", "log_memory_to_tensorboard"),
    ("--log-world-size-to-tensorboard", "log_world_size_to_tensorboard"),
)


def check_logging(o: LoggingConfig, *, optimizer: str, zero_stage: int = 0) -> None:
    """The logging flags' cross-checks (``validate()`` calls it): ``ValueError`` naming the flag and the fix."""
    for flag, on in (
        ("--log-params-norm", o.log_params_norm),
        ("--log-num-zeros-in-grad", o.log_num_zeros_in_grad),
    ):
        if on and zero_stage == 3:
            raise ValueError(
                f"{flag} is not supported with --zero-stage 3 (each rank holds only a partition of every "
                f"parameter and gradient, which the statistic does not gather yet); drop {flag} or use "
                "--zero-stage 0, 1 or 2."
            )
    for flag, value in (
        ("--tensorboard-log-interval", o.tensorboard_log_interval),
        ("--tensorboard-queue-size", o.tensorboard_queue_size),
    ):
        if value < 1:
            raise ValueError(f"{flag} ({value}) must be a positive integer.")
    wandb_on = bool(o.wandb_project) or bool(o.wandb_exp_name)
    if not o.tensorboard_dir and not wandb_on:
        for flag, field in _NEEDS_A_SINK:
            if getattr(o, field):
                raise ValueError(
                    f"{flag} writes to TensorBoard, but no --tensorboard-dir (nor --wandb-project) is given; "
                    f"add --tensorboard-dir DIR or drop {flag}."
                )
    if o.straggler_threshold is not None and not o.log_straggler:
        raise ValueError(
            f"--straggler-threshold ({o.straggler_threshold:g}) is used only by --log-straggler, which is not "
            "given; add --log-straggler or drop --straggler-threshold."
        )
    if o.wandb_save_dir and not wandb_on:
        raise ValueError(
            f"--wandb-save-dir ({o.wandb_save_dir}) without --wandb-project or --wandb-exp-name logs nothing; "
            "add --wandb-project NAME or drop --wandb-save-dir."
        )
    if wandb_on and importlib.util.find_spec("wandb") is None:
        flag = "--wandb-project" if o.wandb_project else "--wandb-exp-name"
        raise ValueError(
            f"{flag} asks for Weights & Biases logging, but the wandb package is not installed: "
            f"pip install wandb (or drop {flag})."
        )
    if o.log_optimizer_states_to_tensorboard and optimizer != "adam":
        raise ValueError(
            f"--log-optimizer-states-to-tensorboard logs Adam's moments, but --optimizer is {optimizer}; "
            "use --optimizer adam or drop the flag."
        )
