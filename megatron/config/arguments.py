"""The one place that turns Megatron-spelled command-line flags into a typed, frozen :class:`TridentConfig`.

    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", ...])
    validate(cfg, world_size=8)        # raises ValueError naming flag, value, rule and fix

The parser is built from the config dataclasses (``flags.py`` holds the rule and its few exceptions): every field
is a flag with its type, default and docstring as help, grouped as the dataclasses are, so ``--help`` documents
every flag and a new field is a new flag. Flags keep Megatron-DeepSpeed's spelling so users' launch scripts carry
over; the DeepSpeed launcher's ``--local_rank`` and ``--deepspeed_config`` are accepted as it passes them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from megatron.config.checkpoint import CheckpointConfig
from megatron.config.checkpoint_args import ModelReader, checkpoint_model_for
from megatron.config.data import DataConfig
from megatron.config.flags import (
    CHECKPOINT_ACTIVATIONS,
    COMPAT_NO_OPS,
    INVERTED,
    NOT_FLAGS,
    PARSED,
    RECOMPUTE_ACTIVATIONS,
    field_docs,
    field_flags,
)
from megatron.config.logging_config import LoggingConfig
from megatron.config.model import ModelConfig
from megatron.config.parallel import ParallelConfig
from megatron.config.refused import REFUSED, RefuseAction
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


SECTIONS: tuple[tuple[str, str, type], ...] = (
    ("model", "model", ModelConfig),
    ("parallel", "parallelism", ParallelConfig),
    ("training", "training", TrainingConfig),
    ("data", "data and tokenizer", DataConfig),
    ("checkpoint", "checkpointing", CheckpointConfig),
    ("logging", "logging", LoggingConfig),
)
"""(``TridentConfig`` attribute, --help group title, dataclass) in --help order."""

_METAVARS = {int: "N", float: "X", str: "VALUE"}


def finite_float(text: str) -> float:
    """argparse type of every float flag: a number that is neither NaN nor infinite (``--lr=nan`` would train
    NaN weights, ``--lr=inf`` too, without a word)."""
    value = float(text)  # ValueError: argparse's own "invalid float value: 'abc'"
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number; give a finite value")
    return value


finite_float.__name__ = "float"  # argparse names the type in its "invalid float value" messages


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that raises ValueError instead of exiting, so callers decide how to report it."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"{message} (run with --help for the list of flags)")


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help when the default says something (not None, False or empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default in (None, False, [], (), "", argparse.SUPPRESS) or isinstance(
            action, argparse._StoreFalseAction
        ):
            return text
        return f"{text} (default: {default})"


def _unwrap_optional(hint: Any) -> Any:
    """``X | None`` -> ``X`` (any other hint unchanged)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _field_argument(f: dataclasses.Field, hint: Any) -> tuple[list[str], dict[str, Any]]:
    """(option strings, ``add_argument`` keywords) of the flag of field ``f`` (see ``flags.py`` for the rule)."""
    flags = list(field_flags(f.name))
    base = _unwrap_optional(hint)
    if base is bool:
        if f.name in INVERTED:
            return [INVERTED[f.name]], {"action": "store_false", "dest": f.name, "default": True}
        if f.default is not False:
            raise TypeError(
                f"bool field {f.name} defaults to True: give it a flag in flags.INVERTED"
            )
        return flags, {"action": "store_true", "dest": f.name, "default": False}
    kwargs: dict[str, Any] = {"dest": f.name, "default": f.default}
    if f.name in PARSED:
        kwargs.update(type=PARSED[f.name][0], metavar=PARSED[f.name][1])
    elif typing.get_origin(base) is Literal:
        kwargs["choices"] = list(typing.get_args(base))
        kwargs["type"] = type(kwargs["choices"][0])
    elif typing.get_origin(base) is tuple:
        # A None default stays None, so "given with no values" ([] -> ()) differs from "not given".
        default = list(f.default) if isinstance(f.default, tuple) else None
        item = typing.get_args(base)[0]
        if item is int:  # --num-experts: one or more integers
            kwargs.update(nargs="+", type=int, default=default, metavar="N")
        else:
            kwargs.update(nargs="*", type=str, default=default, metavar="VALUE")
    elif base in _METAVARS:
        kwargs.update(type=finite_float if base is float else base, metavar=_METAVARS[base])
    else:
        raise TypeError(f"no flag type for field {f.name}: {hint!r}")
    return flags, kwargs


def build_parser(prog: str = "pretrain_gpt.py") -> argparse.ArgumentParser:
    """The full Trident parser: one group per config dataclass, then the accepted no-op compatibility flags."""
    p = _ArgumentParser(
        prog=prog,
        allow_abbrev=False,
        description="Trident GPT/LLaMA pretraining (Megatron-DeepSpeed flag spellings).",
        formatter_class=_HelpFormatter,
    )
    for _, title, cls in SECTIONS:
        group = p.add_argument_group(title, (cls.__doc__ or "").strip().splitlines()[0])
        _add_fields(p, group, cls)
        if cls is ModelConfig:
            group.add_argument(
                CHECKPOINT_ACTIVATIONS,
                action="store_true",
                help="Megatron-DeepSpeed's name for --recompute-granularity full.",
            )
    compat = p.add_argument_group(
        "accepted for compatibility",
        "Megatron-DeepSpeed flags that have nothing to do in Trident (each says why); they change nothing.",
    )
    for flag in COMPAT_NO_OPS:
        extra: dict[str, Any] = {"action": "store_true"}
        if flag.choices:
            extra = {"choices": list(flag.choices), "default": None}
        elif flag.takes_value:
            extra = {"metavar": "VALUE", "default": None}
        compat.add_argument(
            *flag.flags,
            dest=f"compat_{flag.flags[0].lstrip('-')}",
            help=f"No effect: {flag.why}",
            **extra,
        )
    compat.add_argument(
        RECOMPUTE_ACTIVATIONS,
        action="store_const",
        const="selective",
        dest="recompute_granularity",
        help="Megatron's name for --recompute-granularity selective.",
    )
    _add_refused(p)
    return p


def _add_fields(p: argparse.ArgumentParser, group: Any, cls: type) -> None:
    """The flags of ``cls``'s fields into ``group``; a nested dataclass field (``ModelConfig.moe``) gets a group of
    its own, its fields flags like any other."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if (cls.__name__, f.name) in NOT_FLAGS:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            sub = hints[f.name]
            _add_fields(p, p.add_argument_group(sub.__doc__.strip().splitlines()[0]), sub)
            continue
        flags, kwargs = _field_argument(f, hints[f.name])
        text = f"Turn off: {docs[f.name]}" if f.name in INVERTED else docs[f.name]
        group.add_argument(*flags, help=text, **kwargs)


def _values(a: argparse.Namespace, cls: type) -> dict[str, Any]:
    """``cls``'s field values from parsed flags (nested dataclass fields built recursively)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if (cls.__name__, f.name) in NOT_FLAGS:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            values[f.name] = hints[f.name](**_values(a, hints[f.name]))
            continue
        value = getattr(a, f.name)
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return values


def _add_refused(p: argparse.ArgumentParser) -> None:
    """The group of Megatron-DeepSpeed flags refused by name (``refused.py``): each stops the parse with one line."""
    group = p.add_argument_group(
        "refused",
        "Megatron-DeepSpeed features Trident does not have: passing one stops the run with the reason.",
    )
    for entry in REFUSED:
        group.add_argument(
            *entry.flags,
            action=RefuseAction,
            refused=entry,
            dest=f"refused_{entry.flags[0].lstrip('-')}",
            default=argparse.SUPPRESS,
            metavar="VALUE" if entry.takes_value else None,
            help=f"Refused: {entry.why}; {entry.instead}.",
        )


def config_from_namespace(a: argparse.Namespace) -> TridentConfig:
    """Build the frozen config from parsed flags (no validation; see :func:`validate`)."""
    sections: dict[str, Any] = {}
    for attr, _, cls in SECTIONS:
        sections[attr] = cls(**_values(a, cls))
    model: ModelConfig = sections["model"]
    if model.recompute_granularity is None and a.checkpoint_activations:
        sections["model"] = dataclasses.replace(model, recompute_granularity="full")
    data: DataConfig = sections["data"]
    if data.tokenizer_type is None and data.vocab_file and data.merge_file:
        # Megatron(-DeepSpeed)'s pretrain_gpt.py defaults the type to GPT2BPETokenizer; their scripts rely on it.
        sections["data"] = dataclasses.replace(data, tokenizer_type="GPT2BPETokenizer")
    return TridentConfig(**sections)


def parse_args(
    argv: Sequence[str] | None = None, *, read_checkpoint_model: ModelReader | None = None
) -> TridentConfig:
    """Parse Megatron-spelled flags into a :class:`TridentConfig`. Unknown flags raise ValueError.

    With ``--use-checkpoint-args`` the model's architecture comes from the --load checkpoint, read by
    ``read_checkpoint_model`` (the entry point passes it: config reads no checkpoint; see ``checkpoint_args.py``),
    before the config is built.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    a = parser.parse_args(args)
    if a.use_checkpoint_args:
        checkpoint_model_for(a, parser, args, read_checkpoint_model)
    return config_from_namespace(a)
