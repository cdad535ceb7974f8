"""How the config dataclasses become command-line flags: the rule, and the small table of exceptions to it.

The rule: every field of ``ModelConfig``, ``ParallelConfig``, ``TrainingConfig``, ``DataConfig``,
``CheckpointConfig`` and ``LoggingConfig`` is the flag ``--field-name`` (Megatron's spelling), its type and default
from the annotation, its help the field's docstring, grouped as the dataclasses are. A ``bool`` field that defaults
to False is a switch; a ``Literal`` gives the choices; ``tuple[str, ...]`` takes any number of values,
``tuple[int, ...]`` one or more integers (``--num-experts``). A field that is itself a dataclass (``ModelConfig.moe``,
a ``MoEConfig``) is a group of its own whose fields follow the same rule.

The exceptions, all below: values with a parser of their own (:data:`PARSED`), flags that turn a default-True field off (:data:`INVERTED`), extra spellings
(:data:`ALIASES`), fields that are not flags (:data:`NOT_FLAGS`), one flag that sets another field's value
(``--checkpoint-activations``), and Megatron-DeepSpeed flags accepted as deliberate no-ops, each with its reason
(:data:`COMPAT_NO_OPS`; docs/megatron-deepspeed.md lists them). Megatron-DeepSpeed flags whose feature Trident does not have are known
by name and refused with their reason (``refused.py``).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron.config.model import parse_window_size

INVERTED: dict[str, str] = {
    "add_bias_linear": "--disable-bias-linear",
    "use_flash_attn": "--no-flash-attn",
    "layout_invariant_init": "--per-shard-init",
    "exit_signal_handler": "--no-exit-signal-handler",
    "verify_checkpoint_checksums": "--no-verify-checkpoint-checksums",
    "check_for_nan_in_loss_and_grad": "--no-check-for-nan-in-loss-and-grad",
    "barrier_with_level_1_timing": "--no-barrier-with-level-1-timing",
    # Megatron-DeepSpeed's spelling (sic: "learnig"), kept so their scripts carry over.
    "log_learning_rate_to_tensorboard": "--no-log-learnig-rate-to-tensorboard",
    "log_loss_scale_to_tensorboard": "--no-log-loss-scale-to-tensorboard",
    "async_tensor_model_parallel_allreduce": "--no-async-tensor-model-parallel-allreduce",
    "add_position_embedding": "--no-position-embedding",
    "masked_softmax_fusion": "--no-masked-softmax-fusion",
    "bias_gelu_fusion": "--no-bias-gelu-fusion",
    "bias_swiglu_fusion": "--no-bias-swiglu-fusion",
    "apply_rope_fusion": "--no-rope-fusion",
    "persist_layer_norm": "--no-persist-layer-norm",
    "cross_entropy_loss_fusion": "--no-cross-entropy-loss-fusion",
    "moe_token_dropping": "--disable-moe-token-dropping",
    "moe_top2_2nd_expert_sampling": "--disable-moe-top2-2nd-expert-sampling",
}
"""Field -> the switch that sets it False (the field defaults to True)."""

ALIASES: dict[str, tuple[str, ...]] = {
    "local_rank": ("--local_rank", "--local-rank"),
    "recompute_num_layers": ("--recompute-num-layers", "--checkpoint-num-layers"),
    # Megatron-DeepSpeed spells it "contigious"; both spellings set the same field.
    "contiguous_checkpointing": ("--contiguous-checkpointing", "--contigious-checkpointing"),
    "override_opt_param_scheduler": (
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
    ),
    "use_checkpoint_opt_param_scheduler": (
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
    ),
    "cpu_torch_adam": ("--cpu_torch_adam", "--cpu-torch-adam"),
    # Megatron-DeepSpeed: for GPT, --encoder-num-layers / --encoder-seq-length are other names of these two.
    "num_layers": ("--num-layers", "--encoder-num-layers"),
    "seq_length": ("--seq-length", "--encoder-seq-length"),
    "deepspeed_config": ("--deepspeed_config", "--deepspeed-config", "--deepscale_config"),
}
"""Field -> every spelling of its flag (the deepspeed launcher passes ``--local_rank``; ``--deepspeed_config`` is
DeepSpeed's own spelling; ``--checkpoint-num-layers`` is Megatron's older name; Megatron spells the LR-schedule
resume switches ``--override-opt_param-scheduler``, the all-dash form is accepted too)."""


def _window_size(text: str) -> tuple[int, int]:
    try:
        return parse_window_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


_window_size.__name__ = "window size"


PARSED: dict[str, tuple[Callable[[str], Any], str]] = {
    "window_size": (_window_size, "W|L,R"),
}
"""Field -> (argparse type, metavar) for a value the type rule cannot parse: ``--window-size`` takes ``W`` or
``L,R`` in one word (Megatron-LM's spelling of the pair)."""


def field_flags(name: str) -> tuple[str, ...]:
    """Every spelling of the flag of field ``name``: ``--field-name`` by the rule, or its :data:`ALIASES` (a bool
    field in :data:`INVERTED` is turned off by that switch instead)."""
    return ALIASES.get(name, ("--" + name.replace("_", "-"),))


NOT_FLAGS: frozenset[tuple[str, str]] = frozenset(
    {("ModelConfig", "vocab_size"), ("DataConfig", "extra")}
)
"""Fields set by code, not by a flag: the true vocabulary comes from the tokenizer."""

CHECKPOINT_ACTIVATIONS = "--checkpoint-activations"
"""Megatron-DeepSpeed's switch for ``--recompute-granularity full`` (an explicit granularity wins)."""

RECOMPUTE_ACTIVATIONS = "--recompute-activations"
"""Megatron's switch for ``--recompute-granularity selective`` (the later of the two flags wins)."""


@dataclass(frozen=True)
class CompatFlag:
    """A Megatron-DeepSpeed flag Trident accepts and deliberately ignores."""

    flags: tuple[str, ...]
    why: str
    """Why it has nothing to do here (the help text and docs/megatron-deepspeed.md's compatibility table)."""
    choices: tuple[str, ...] | None = None
    """The values it accepts, when it takes one."""
    takes_value: bool = False
    """Whether it takes one value of any kind (``choices`` limits it; a switch otherwise)."""


COMPAT_NO_OPS: tuple[CompatFlag, ...] = (
    CompatFlag(
        ("--deepspeed", "--deepscale"), "Trident always trains through the DeepSpeed engine."
    ),
    CompatFlag(
        ("--check-for-nan-in-loss-and-grad",),
        "the check is on by default; --no-check-for-nan-in-loss-and-grad turns it off.",
    ),
    CompatFlag(
        ("--data-impl",),
        "datasets are always Megatron's mmap .bin/.idx format (infer finds the same files).",
        choices=("mmap", "infer"),
    ),
    CompatFlag(
        (
            "--use-flash-attn",
            "--use-flash-attn-v1",
            "--use-flash-attn-v2",
            "--use-flash-attn-triton",
            "--use-flash-attn-builder",
        ),
        "torch SDPA (flash kernels on GPU) is already the attention; --no-flash-attn selects the reference path.",
    ),
    CompatFlag(
        ("--no-query-key-layer-scaling",),
        "attention softmax runs in fp32 (SDPA and the reference path), so Megatron's fp16 query-key layer "
        "scaling has nothing to rescale; the result is the same.",
    ),
    CompatFlag(
        ("--openai-gelu",),
        "the GeLU is always the tanh approximation (OpenAI's, and Megatron's fused bias-GeLU), so the flag selects "
        "what already runs.",
    ),
    CompatFlag(
        ("--cross-entropy-loss-fusion",),
        "the fused cross-entropy is already the default wherever the kernels are built; "
        "--no-cross-entropy-loss-fusion turns it off.",
    ),
    CompatFlag(
        ("--no-bias-dropout-fusion",),
        "there is no fused bias-dropout-add kernel yet; the unfused path (the same math) always runs.",
    ),
    *(
        CompatFlag(flags, why, takes_value=value)
        for flags, value, why in (
            (
                ("--exit-signal-handler",),
                False,
                "the SIGTERM handler (save, then exit 5) is on by default; "
                "--no-exit-signal-handler turns it off.",
            ),
            (("--attention-softmax-in-fp32",), False, "attention softmax always runs in fp32."),
            (
                ("--disable-mem-efficient-ln",),
                False,
                "the fused LayerNorm kernel keeps only the input and per-row statistics already; "
                "--no-persist-layer-norm turns the norm kernels off.",
            ),
            (
                ("--no-gradient-accumulation-fusion",),
                False,
                "there is no fused weight-grad accumulation "
                "kernel to turn off; autograd accumulates (the same math).",
            ),
            (
                ("--use-cpu-initialization",),
                False,
                "every weight is already drawn whole on CPU from the seed, "
                "then sharded (layout-invariant init).",
            ),
            (
                ("--no-initialization",),
                False,
                "weights are initialized, then --load overwrites them: the same "
                "model, a little more start-up time.",
            ),
            (
                ("--ds_fused_adam",),
                False,
                "Trident's Adam (torch's, foreach/fused kernels on GPU) does the same "
                "AdamW update as DeepSpeed's FusedAdam.",
            ),
            (
                (
                    "--no-scatter-gather-tensors-in-pipeline",
                    "--use-ring-exchange-p2p",
                    "--overlap-p2p-communication",
                ),
                False,
                "options of Megatron's own pipeline schedules; "
                "DeepSpeed's pipeline engine runs the pipeline (Megatron-DeepSpeed ignores them under DeepSpeed too).",
            ),
            (
                ("--no-contiguous-buffers-in-local-ddp", "--accumulate-allreduce-grads-in-fp32"),
                False,
                "options of Megatron's local DDP; the DeepSpeed engine owns gradient accumulation and reduction "
                "(Megatron-DeepSpeed ignores them under DeepSpeed too).",
            ),
            (
                ("--train-desc-path",),
                True,
                "Megatron's dataset description file is not used; forced index "
                "files (--train-doc/sample/shuffle-idx-path) are checked against the dataset itself.",
            ),
            (
                ("--mmap-warmup",),
                False,
                "warming the page cache of the .bin files changes start-up time only.",
            ),
            (
                ("--trust-remote-code",),
                False,
                "HFTokenizer reads local tokenizer files and never runs model code.",
            ),
            (
                (
                    "--scattered-embeddings",
                    "--memory-centric-tiled-linear",
                    "--zero-reduce-scatter",
                    "--zero-contigious-gradients",
                    "--use-pin-memory",
                ),
                False,
                "Megatron-DeepSpeed defines it but "
                "never reads it; ZeRO settings belong in the DeepSpeed JSON (zero_optimization).",
            ),
            (
                (
                    "--tile-factor",
                    "--zero-reduce-bucket-size",
                    "--zero-allgather-bucket-size",
                    "--aml-data-download-path",
                ),
                True,
                "Megatron-DeepSpeed defines it but never reads it; ZeRO "
                "settings belong in the DeepSpeed JSON (zero_optimization).",
            ),
        )
    ),
    CompatFlag(
        ("--DDP-impl",),
        "Megatron's DDP wrapper choice; the DeepSpeed engine is the data-parallel wrapper (Megatron-DeepSpeed "
        "ignores it under DeepSpeed too).",
        choices=("local", "torch", "FSDP"),
    ),
)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of the dataclass ``cls``, as one line of text.

    Raises:
        TypeError: a field has no docstring (every flag needs its help text).
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, after in zip(body, body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    fields = list(getattr(cls, "__dataclass_fields__", {}))
    missing = [f for f in fields if f not in docs]
    if missing:
        raise TypeError(f"{cls.__name__} fields without a docstring (their --help text): {missing}")
    return docs
