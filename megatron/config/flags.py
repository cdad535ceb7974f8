"""How the config dataclasses become command-line flags: the rule, and the small table of exceptions to it.

The rule: every field of ``ModelConfig``, ``ParallelConfig``, ``TrainingConfig``, ``DataConfig``,
``CheckpointConfig`` and ``LoggingConfig`` is the flag ``--field-name`` (Megatron's spelling), its type and default
from the annotation, its help the field's docstring, grouped as the dataclasses are. A ``bool`` field that defaults
to False is a switch; a ``Literal`` gives the choices; ``tuple[str, ...]`` takes any number of values.

The exceptions, all below: flags that turn a default-True field off (:data:`INVERTED`), extra spellings
(:data:`ALIASES`), fields that are not flags (:data:`NOT_FLAGS`), one flag that sets another field's value
(``--checkpoint-activations``), and Megatron-DeepSpeed flags accepted as deliberate no-ops, each with its reason
(:data:`COMPAT_NO_OPS`; README lists them).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

INVERTED: dict[str, str] = {
    "add_bias_linear": "--disable-bias-linear",
    "use_flash_attn": "--no-flash-attn",
    "layout_invariant_init": "--per-shard-init",
    "exit_signal_handler": "--no-exit-signal-handler",
    "verify_checkpoint_checksums": "--no-verify-checkpoint-checksums",
    "check_for_nan_in_loss_and_grad": "--no-check-for-nan-in-loss-and-grad",
}
"""Field -> the switch that sets it False (the field defaults to True)."""

ALIASES: dict[str, tuple[str, ...]] = {
    "local_rank": ("--local_rank", "--local-rank"),
    "deepspeed_config": ("--deepspeed_config", "--deepspeed-config"),
    "recompute_num_layers": ("--recompute-num-layers", "--checkpoint-num-layers"),
    "override_opt_param_scheduler": (
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
    ),
    "use_checkpoint_opt_param_scheduler": (
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
    ),
}
"""Field -> every spelling of its flag (the deepspeed launcher passes ``--local_rank``; ``--deepspeed_config`` is
DeepSpeed's own spelling; ``--checkpoint-num-layers`` is Megatron's older name; Megatron spells the LR-schedule
resume switches ``--override-opt_param-scheduler``, the all-dash form is accepted too)."""

NOT_FLAGS: frozenset[tuple[str, str]] = frozenset(
    {("ModelConfig", "vocab_size"), ("DataConfig", "extra")}
)
"""Fields set by code, not by a flag: the true vocabulary comes from the tokenizer."""

CHECKPOINT_ACTIVATIONS = "--checkpoint-activations"
"""Megatron-DeepSpeed's switch for ``--recompute-granularity full`` (an explicit granularity wins)."""


@dataclass(frozen=True)
class CompatFlag:
    """A Megatron-DeepSpeed flag Trident accepts and deliberately ignores."""

    flags: tuple[str, ...]
    why: str
    """Why it has nothing to do here (the help text and the README's compatibility table)."""
    choices: tuple[str, ...] | None = None
    """The values it accepts, when it takes one."""


COMPAT_NO_OPS: tuple[CompatFlag, ...] = (
    CompatFlag(("--deepspeed",), "Trident always trains through the DeepSpeed engine."),
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
        ("--use-flash-attn", "--use-flash-attn-v2"),
        "torch SDPA (flash kernels on GPU) is already the attention; --no-flash-attn selects the reference path.",
    ),
    CompatFlag(
        ("--no-query-key-layer-scaling",),
        "attention softmax runs in fp32 (SDPA and the reference path), so Megatron's fp16 query-key layer "
        "scaling has nothing to rescale; the result is the same.",
    ),
    CompatFlag(
        ("--no-masked-softmax-fusion",),
        "there is no fused masked-softmax kernel to turn off: attention is SDPA or the reference path.",
    ),
    CompatFlag(
        ("--no-bias-gelu-fusion",),
        "there is no fused bias-GeLU kernel yet; the unfused bias + GeLU (the same math) always runs.",
    ),
    CompatFlag(
        ("--no-bias-dropout-fusion",),
        "there is no fused bias-dropout-add kernel yet; the unfused path (the same math) always runs.",
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
