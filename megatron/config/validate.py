"""``validate()``: every cross-check of a :class:`TridentConfig`, in one place, before any process group exists.

Each failure is one ``ValueError`` naming the flag and its value, the rule with the other values involved, and the
fix. It depends only on the flags, the world size and the device type, so every rank fails identically.
"""

from __future__ import annotations

from megatron.config.arguments import TridentConfig
from megatron.config.batch_rampup import check_rampup
from megatron.config.context_parallel import check_context_parallel
from megatron.config.eval_harness import check_eval_harness
from megatron.config.features import check_model_features
from megatron.config.logging_config import check_logging
from megatron.config.lora import check_lora
from megatron.config.moe_rules import check_moe
from megatron.config.plan import global_batch_size
from megatron.config.ranges import check_ranges, check_run_length
from megatron.config.rules import check_head_layout, check_tensor_parallel_split
from megatron.config.ulysses import check_ulysses


def _check_positive(cfg: TridentConfig) -> None:
    m, t = cfg.model, cfg.training
    for flag, value in (
        ("--num-layers", m.num_layers),
        ("--hidden-size", m.hidden_size),
        ("--num-attention-heads", m.num_attention_heads),
        ("--seq-length", m.seq_length),
        ("--micro-batch-size", t.micro_batch_size),
        ("--tensor-model-parallel-size", cfg.parallel.tensor_model_parallel_size),
        ("--pipeline-model-parallel-size", cfg.parallel.pipeline_model_parallel_size),
        ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by),
        ("--log-interval", cfg.logging.log_interval),
        ("--eval-interval", t.eval_interval),
    ):
        if value < 1:
            raise ValueError(f"{flag} ({value}) must be a positive integer.")
    if t.eval_iters < 0:
        raise ValueError(f"--eval-iters ({t.eval_iters}) must be >= 0 (0 disables evaluation).")
    for flag, rate in (
        ("--attention-dropout", m.attention_dropout),
        ("--hidden-dropout", m.hidden_dropout),
    ):
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"{flag} ({rate}) must be in [0, 1).")


def _check_model(cfg: TridentConfig) -> None:
    m = cfg.model
    check_head_layout(m)
    check_tensor_parallel_split(m, cfg.parallel.tensor_model_parallel_size)
    learned_positions = m.add_position_embedding and not m.use_rotary_position_embeddings
    if learned_positions and m.seq_length > m.max_positions:
        raise ValueError(
            f"--seq-length ({m.seq_length}) exceeds --max-position-embeddings ({m.max_positions}); "
            "raise --max-position-embeddings or use --use-rotary-position-embeddings."
        )


def _check_recompute(cfg: TridentConfig) -> None:
    m = cfg.model
    if m.recompute_num_layers < 1:
        raise ValueError(f"--recompute-num-layers ({m.recompute_num_layers}) must be >= 1.")
    if m.recompute_method is not None and m.recompute_granularity != "full":
        raise ValueError(
            f"--recompute-method {m.recompute_method} chooses which layers full recomputation checkpoints; add "
            "--recompute-granularity full (or --checkpoint-activations), or drop --recompute-method."
        )
    if m.recompute_method == "block" and cfg.parallel.pipeline_model_parallel_size > 1:
        raise ValueError(
            "--recompute-method block needs --pipeline-model-parallel-size 1: DeepSpeed's pipeline engine "
            "recomputes uniform chunks of --recompute-num-layers layers only; use --recompute-method uniform."
        )


def _check_packed_documents(cfg: TridentConfig) -> None:
    """--reset-attention-mask (and --sft, which packs conversations) at PP > 1 carries document ids through the
    pipeline (no dense mask); their attention has no dropout, so --attention-dropout must be 0 there (PP = 1 keeps
    the dense-mask path with dropout). --sft needs real conversations and their loss mask: no --mock-data."""
    d, pp = cfg.data, cfg.parallel.pipeline_model_parallel_size
    flag = "--sft" if d.sft else "--reset-attention-mask"
    if (d.reset_attention_mask or d.sft) and pp > 1 and cfg.model.attention_dropout > 0:
        raise ValueError(
            f"{flag} at --pipeline-model-parallel-size {pp} needs --attention-dropout 0 "
            f"(got {cfg.model.attention_dropout}): the pipeline carries document ids, whose attention has no "
            "dropout; set --attention-dropout 0, or use --pipeline-model-parallel-size 1 (dense mask, dropout)."
        )


def _check_sft(cfg: TridentConfig) -> None:
    """--sft reads conversations and their loss mask, packed by its own index: no --mock-data, no GPT index
    files or epoch count, and no EOD-based document flags (the conversations are the documents)."""
    d = cfg.data
    if not d.sft:
        return
    if d.mock_data:
        raise ValueError(
            "--sft trains on conversations and their loss mask, which --mock-data does not have; give "
            "--data-path P (P and P_loss_mask from tools/preprocess_data.py --sft)."
        )
    given = [
        flag
        for flag, on in (
            ("--train-doc-idx-path", d.train_doc_idx_path is not None),
            ("--train-sample-idx-path", d.train_sample_idx_path is not None),
            ("--train-shuffle-idx-path", d.train_shuffle_idx_path is not None),
            ("--train-data-exact-num-epochs", d.train_data_exact_num_epochs is not None),
            ("--reset-attention-mask", d.reset_attention_mask),
            ("--reset-position-ids", d.reset_position_ids),
            ("--eod-mask-loss", d.eod_mask_loss),
        )
        if on
    ]
    if given:
        raise ValueError(
            f"--sft with {', '.join(given)}: --sft packs whole conversations with an index of its own, "
            "each conversation its own document (positions restart, no attention across them) and the loss "
            "mask read from P_loss_mask; drop the flag(s)."
        )


_DS_CHECKPOINTING_OPTIONS = (
    ("partition_activations", "--partition-activations"),
    ("contiguous_checkpointing", "--contiguous-checkpointing"),
    ("checkpoint_in_cpu", "--checkpoint-in-cpu"),
    ("synchronize_each_layer", "--synchronize-each-layer"),
    ("profile_backward", "--profile-backward"),
)


def _check_deepspeed_checkpointing(cfg: TridentConfig, device_type: str) -> None:
    """--deepspeed-activation-checkpointing and its options (see megatron/training/activation_checkpointing.py)."""
    m = cfg.model
    given = [flag for field, flag in _DS_CHECKPOINTING_OPTIONS if getattr(m, field)]
    if given and not m.deepspeed_activation_checkpointing:
        raise ValueError(
            f"{', '.join(given)} configure DeepSpeed activation checkpointing; add "
            "--deepspeed-activation-checkpointing (with --checkpoint-activations), or drop them."
        )
    if not m.deepspeed_activation_checkpointing:
        return
    if m.recompute_granularity != "full":
        raise ValueError(
            f"--deepspeed-activation-checkpointing checkpoints whole layer chunks, but --recompute-granularity is "
            f"{m.recompute_granularity}; add --checkpoint-activations (or --recompute-granularity full)."
        )
    if m.contiguous_checkpointing and not m.partition_activations:
        raise ValueError(
            "--contiguous-checkpointing stores partitioned checkpoints only; add --partition-activations."
        )
    if m.partition_activations and cfg.parallel.sequence_parallel_enabled:
        raise ValueError(
            "--partition-activations splits layer inputs that are identical on every TP rank, but under "
            "--sequence-parallel each rank holds other tokens; drop one of the two."
        )
    if m.checkpoint_in_cpu and not m.partition_activations and device_type == "cpu":
        # DeepSpeed's unpartitioned CPU path moves the inputs to the CPU and then empties them in place: on a
        # CPU device that is the same tensor, and the recomputation reads an empty one.
        raise ValueError(
            "--checkpoint-in-cpu without --partition-activations needs a GPU (on CPU the activations are in CPU "
            "memory already); drop it, or add --partition-activations."
        )


def _check_parallel(cfg: TridentConfig, world_size: int) -> None:
    p, m = cfg.parallel, cfg.model
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ValueError(
            f"world size ({world_size}) must be divisible by --tensor-model-parallel-size ({tp}) x "
            f"--pipeline-model-parallel-size ({pp}) = {tp * pp}; launch a multiple of {tp * pp} processes "
            "or change the degrees."
        )
    if pp > m.num_layers:
        raise ValueError(
            f"--pipeline-model-parallel-size ({pp}) exceeds --num-layers ({m.num_layers}): every stage needs "
            f"at least one layer; use at most {m.num_layers} stages."
        )
    if p.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero-stage ({p.zero_stage}) must be 0, 1, 2 or 3.")
    if pp > 1 and p.zero_stage > 1:
        raise ValueError(
            f"--zero-stage ({p.zero_stage}) is incompatible with --pipeline-model-parallel-size ({pp}) "
            "(DeepSpeed's pipeline engine supports ZeRO 0 and 1); use --zero-stage 1, or "
            "--pipeline-model-parallel-size 1 --no-pipeline-parallel."
        )
    if pp > 1 and p.no_pipeline_parallel:
        raise ValueError(
            f"--no-pipeline-parallel needs --pipeline-model-parallel-size 1 (got {pp})."
        )


def _check_batch(cfg: TridentConfig, world_size: int) -> None:
    t, p = cfg.training, cfg.parallel
    dp = p.data_parallel_size(world_size)
    gbs = global_batch_size(cfg, world_size)
    if gbs % (t.micro_batch_size * dp):
        raise ValueError(
            f"--global-batch-size ({gbs}) must be divisible by --micro-batch-size ({t.micro_batch_size}) x "
            f"data-parallel size ({dp}) = {t.micro_batch_size * dp}; use a multiple of "
            f"{t.micro_batch_size * dp}."
        )
    if t.train_iters is not None and t.train_samples is not None:
        raise ValueError("--train-iters and --train-samples are exclusive; give one of them.")
    if gbs < 1:
        raise ValueError(f"--global-batch-size ({gbs}) must be a positive integer.")
    for flag, value in (("--train-iters", t.train_iters), ("--train-samples", t.train_samples)):
        if value is not None and value < 1:
            raise ValueError(
                f"{flag} ({value}) must be a positive integer (how long to train); to only evaluate a "
                "checkpoint, use --skip-train."
            )
    if t.exit_interval is not None and t.exit_interval < 1:
        raise ValueError(f"--exit-interval ({t.exit_interval}) must be >= 1 (or left out).")
    if cfg.data.num_workers < 0:
        raise ValueError(
            f"--num-workers ({cfg.data.num_workers}) must be >= 0 (0 = load in the main process)."
        )
    if p.distributed_timeout_minutes <= 0:
        raise ValueError(
            f"--distributed-timeout-minutes ({p.distributed_timeout_minutes}) must be positive."
        )


def _check_precision(cfg: TridentConfig, device_type: str) -> None:
    t = cfg.training
    if t.bf16 and t.fp16:
        raise ValueError("--bf16 and --fp16 are exclusive; choose one.")
    if t.fp16 and device_type != "cuda":
        raise ValueError(
            f"--fp16 needs a CUDA GPU (device here: {device_type}); use --bf16 or fp32 (no flag) on CPU."
        )
    if t.clip_grad < 0:
        raise ValueError(f"--clip-grad ({t.clip_grad}) must be >= 0 (0 disables clipping).")
    if t.lr_warmup_fraction is not None and (t.lr_warmup_iters or t.lr_warmup_samples):
        raise ValueError(
            "--lr-warmup-fraction is exclusive with --lr-warmup-iters/--lr-warmup-samples."
        )
    if t.lr < 0 or t.min_lr < 0:
        raise ValueError(f"--lr ({t.lr}) and --min-lr ({t.min_lr}) must not be negative.")
    if t.min_lr > t.lr:
        raise ValueError(f"--min-lr ({t.min_lr}) must not exceed --lr ({t.lr}).")
    if t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler:
        raise ValueError(
            "--override-opt_param-scheduler (the flags' LR schedule wins) and "
            "--use-checkpoint-opt_param-scheduler (the checkpoint's wins) are exclusive; give one of them."
        )
    if t.lr_warmup_fraction is not None and not 0.0 <= t.lr_warmup_fraction <= 1.0:
        raise ValueError(f"--lr-warmup-fraction ({t.lr_warmup_fraction}) must be in [0, 1].")
    # Megatron: iteration-based runs count the schedule in iterations, sample-based runs in samples.
    by_iters = t.train_samples is None
    wrong = (
        [("--lr-warmup-samples", t.lr_warmup_samples), ("--lr-decay-samples", t.lr_decay_samples)]
        if by_iters
        else [("--lr-warmup-iters", t.lr_warmup_iters), ("--lr-decay-iters", t.lr_decay_iters)]
    )
    for flag, value in wrong:
        if value:
            raise ValueError(
                f"{flag} ({value}) does not apply to a run length given by "
                f"{'--train-iters' if by_iters else '--train-samples'}; use "
                f"{flag.replace('samples', 'ITERS').replace('iters', 'samples').replace('ITERS', 'iters')}."
            )


def _check_tokens(cfg: TridentConfig) -> None:
    """Megatron-DeepSpeed's token schedule: --train-tokens adds a stop, --lr-*-tokens replace the LR lengths."""
    t = cfg.training
    for flag, value in (
        ("--train-tokens", t.train_tokens),
        ("--lr-decay-tokens", t.lr_decay_tokens),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} ({value}) must be a positive integer (or left out).")
    warmup = t.lr_warmup_tokens
    if warmup is None:
        return
    if warmup < 0:
        raise ValueError(f"--lr-warmup-tokens ({warmup}) must be >= 0 (or left out).")
    if t.lr_decay_tokens is None:
        raise ValueError(
            f"--lr-warmup-tokens ({warmup}) needs --lr-decay-tokens: a token warmup followed by an "
            "iteration/sample decay is not supported; add --lr-decay-tokens, or warm up with --lr-warmup-iters/"
            "--lr-warmup-samples."
        )
    if warmup > t.lr_decay_tokens:
        raise ValueError(
            f"--lr-warmup-tokens ({warmup}) exceeds --lr-decay-tokens ({t.lr_decay_tokens}); shorten the warmup "
            "or lengthen the decay."
        )
    if t.lr_warmup_iters or t.lr_warmup_samples or t.lr_warmup_fraction is not None:
        raise ValueError(
            "--lr-warmup-tokens is exclusive with --lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction; "
            "give one warmup length."
        )


def _check_hang_timeout(cfg: TridentConfig) -> None:
    t = cfg.training
    if t.hang_timeout_minutes is not None and t.hang_timeout_minutes < 0:
        raise ValueError(
            f"--hang-timeout-minutes ({t.hang_timeout_minutes}) must be >= 0 (0 turns the hang watchdog off)."
        )
    if t.hang_timeout_factor and t.hang_timeout_factor <= 1:  # 0 / unset: off
        raise ValueError(
            f"--hang-timeout-factor ({t.hang_timeout_factor}) must be > 1 (a step may take this many times the "
            "median step; every other step would exceed a factor <= 1); use e.g. 10, or 0 to turn it off."
        )


def _check_cpu_optimizer(cfg: TridentConfig) -> None:
    """--cpu-optimizer is Adam with ZeRO optimizer offload; --cpu_torch_adam only picks its implementation."""
    t, stage = cfg.training, cfg.parallel.zero_stage
    if t.cpu_torch_adam and not t.cpu_optimizer:
        raise ValueError(
            "--cpu_torch_adam chooses torch's AdamW as the optimizer --cpu-optimizer runs on the CPU; add "
            "--cpu-optimizer, or drop --cpu_torch_adam."
        )
    if not t.cpu_optimizer:
        return
    if t.optimizer != "adam":
        raise ValueError(
            f"--cpu-optimizer runs Adam on the CPU, but --optimizer is {t.optimizer}; use --optimizer adam or drop "
            "--cpu-optimizer."
        )
    if stage < 1:
        raise ValueError(
            f"--cpu-optimizer offloads the optimizer to the CPU through ZeRO, which --zero-stage {stage} does not "
            "have; pass --zero-stage 1 (or 2, 3)."
        )


def _check_position_flags(cfg: TridentConfig) -> None:
    """--rotary-percent needs rotary embeddings and an even, non-zero number of rotated channels per head."""
    m = cfg.model
    if not 0.0 < m.rotary_percent <= 1.0:
        raise ValueError(f"--rotary-percent ({m.rotary_percent}) must be in (0, 1].")
    if m.rotary_percent == 1.0:
        return
    if not m.use_rotary_position_embeddings:
        raise ValueError(
            f"--rotary-percent ({m.rotary_percent}) sets how much of each head rotary embeddings rotate; add "
            "--use-rotary-position-embeddings, or drop --rotary-percent."
        )
    rotary_dim = int(m.head_dim * m.rotary_percent)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(
            f"--rotary-percent ({m.rotary_percent}) x head dim ({m.head_dim}) rotates {rotary_dim} channels; "
            "rotary needs an even number >= 2: choose a fraction that gives one."
        )


def validate(cfg: TridentConfig, *, world_size: int, device_type: str = "cpu") -> None:
    """Raise ``ValueError`` for the first inconsistency in ``cfg`` for ``world_size`` ranks on ``device_type``."""
    if world_size < 1:
        raise ValueError(f"world size ({world_size}) must be at least 1.")
    check_ranges(cfg)
    _check_positive(cfg)
    _check_model(cfg)
    _check_recompute(cfg)
    _check_packed_documents(cfg)
    _check_sft(cfg)
    _check_deepspeed_checkpointing(cfg, device_type)
    _check_parallel(cfg, world_size)
    check_ulysses(cfg, world_size)
    check_context_parallel(cfg, world_size)
    check_moe(cfg, world_size)
    check_lora(cfg)
    _check_batch(cfg, world_size)
    check_run_length(cfg, global_batch_size(cfg, world_size))
    check_rampup(cfg, world_size)
    _check_precision(cfg, device_type)
    _check_tokens(cfg)
    check_logging(cfg.logging, optimizer=cfg.training.optimizer, zero_stage=cfg.parallel.zero_stage)
    _check_cpu_optimizer(cfg)
    _check_position_flags(cfg)
    check_model_features(cfg.model)
    _check_hang_timeout(cfg)
    check_eval_harness(cfg)
