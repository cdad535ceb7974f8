"""``TrainingConfig``: batch sizes, optimizer, LR schedule, precision, iteration/exit control."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TrainingConfig:
    """Everything that drives the optimization loop (Megatron flag spellings)."""

    micro_batch_size: int = 1
    """Samples per rank per forward/backward."""
    global_batch_size: int | None = None
    """Samples per optimizer step (default: micro batch x data-parallel size)."""
    rampup_batch_size: tuple[str, ...] | None = None
    """START INCR SAMPLES: the global batch starts at START and grows by INCR over SAMPLES samples to
    --global-batch-size (Megatron's ramp-up; needs --train-samples)."""
    seed: int = 1234
    """The one seed: initialization and data order derive from it, never from the rank."""
    train_iters: int | None = None
    """Optimizer steps to train (exclusive with --train-samples)."""
    train_samples: int | None = None
    """Samples to train on (exclusive with --train-iters); the LR schedule then counts samples."""
    train_tokens: int | None = None
    """Also stop once this many tokens (global batch x --seq-length per iteration) are consumed, if that comes
    before --train-iters/--train-samples (Megatron-DeepSpeed)."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """adam (decoupled weight decay, i.e. AdamW) or sgd."""
    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the LR decay."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "linear"
    """Shape of the LR decay after warmup."""
    lr_decay_iters: int | None = None
    """Iterations the LR decays over (default: --train-iters)."""
    lr_decay_samples: int | None = None
    """Samples the LR decays over, for a --train-samples run (default: --train-samples)."""
    lr_decay_tokens: int | None = None
    """Tokens the LR decays over; replaces the iteration/sample decay (Megatron-DeepSpeed)."""
    lr_warmup_iters: int = 0
    """Iterations of linear LR warmup."""
    lr_warmup_fraction: float | None = None
    """LR warmup as a fraction of the decay length."""
    lr_warmup_samples: int = 0
    """Samples of linear LR warmup, for a --train-samples run."""
    lr_warmup_tokens: int | None = None
    """Tokens of linear LR warmup (needs --lr-decay-tokens; Megatron-DeepSpeed)."""
    override_opt_param_scheduler: bool = False
    """On resume, use the LR schedule of the flags where it differs from the checkpoint's."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, keep the checkpoint's LR schedule where it differs from the flags."""
    weight_decay: float = 0.01
    """Weight decay (not applied to biases and norm weights)."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.999
    """Adam's second-moment decay."""
    adam_eps: float = 1e-8
    """Adam's epsilon (added to the denominator)."""
    sgd_momentum: float = 0.9
    """Momentum of --optimizer sgd."""
    cpu_optimizer: bool = False
    """Adam runs on the CPU: DeepSpeed's CPU Adam (AdamW mode; a C++ op built with ninja at first use) with ZeRO
    optimizer offload to CPU (needs --zero-stage >= 1)."""
    cpu_torch_adam: bool = False
    """With --cpu-optimizer: torch's AdamW instead of DeepSpeed's CPU Adam (nothing to compile)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    bf16: bool = False
    """bfloat16 parameters and activations (fp32 master weights in DeepSpeed)."""
    fp16: bool = False
    """float16 with dynamic loss scaling (GPU only)."""
    loss_scale: float | None = None
    """Static fp16 loss scale (default: dynamic)."""
    check_for_nan_in_loss_and_grad: bool = True
    """Stop the run (exit code 6, no checkpoint saved) at the first iteration whose loss, or whose grad norm in a
    step the fp16 loss scaler did not skip, is NaN or infinite."""
    initial_loss_scale: float = 2.0**32
    """Starting value of the dynamic fp16 loss scale."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic fp16 loss scale."""
    loss_scale_window: int = 1000
    """Overflow-free steps before the dynamic loss scale grows."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic loss scale shrinks."""
    eval_interval: int = 1000
    """Iterations between evaluations on the validation split."""
    eval_iters: int = 100
    """Global batches per evaluation (0 disables evaluation)."""
    exit_interval: int | None = None
    """Stop (after saving) when the iteration is a multiple of this; exit code 3."""
    exit_duration_in_mins: float | None = None
    """Stop (after saving) once this many minutes have passed; exit code 4."""
    exit_signal_handler: bool = True
    """SIGTERM saves a checkpoint and exits with code 5."""
    hang_timeout_minutes: float | None = None
    """Hang watchdog: a rank whose training step (or checkpoint save) takes longer than this dumps its Python
    stacks to the log and exits with code 7 instead of waiting for the collective's timeout (0 or unset: off)."""
    hang_timeout_factor: float | None = None
    """Hang watchdog: a training step may take this many times the median step so far (from the 6th step on;
    with --hang-timeout-minutes, the larger of the two limits); exit code 7 (0 or unset: off)."""
    skip_train: bool = False
    """No training iterations: only the end-of-training evaluations (validation, test) of the model, e.g. of a
    --load'ed checkpoint."""
    deepspeed_config: str | None = None
    """A DeepSpeed JSON that adds keys Trident does not own (ZeRO tuning, offload); keys that contradict a flag
    are an error."""
    data_efficiency_curriculum_learning: bool = False
    """Run the seqlen_truncate curriculum of the DeepSpeed JSON's data_efficiency.data_sampling section
    (Megatron-DeepSpeed's data-efficiency curriculum; metrics that need DeepSpeed's data analysis are refused)."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device for MFU (default: looked up for known GPUs; none on CPU)."""
    eval_harness_tasks: tuple[str, ...] | None = None
    """lm-evaluation-harness tasks (names, groups or YAML tasks of --eval-harness-include-path) scored on the
    training model every --eval-harness-interval iterations; the scores go to the metrics file, TensorBoard and
    W&B (docs/evaluation.md)."""
    eval_harness_interval: int | None = None
    """Iterations between --eval-harness-tasks evaluations (default: --eval-interval)."""
    eval_harness_include_path: str | None = None
    """A directory of extra lm-evaluation-harness task YAMLs for --eval-harness-tasks."""
    eval_harness_limit: int | None = None
    """Score at most this many examples of each --eval-harness-tasks task (default: all)."""
    eval_harness_num_fewshot: int | None = None
    """Few-shot examples per prompt for --eval-harness-tasks (default: each task's own)."""
