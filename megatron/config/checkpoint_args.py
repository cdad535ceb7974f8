"""``--use-checkpoint-args``: the model flags a checkpoint fixes, taken from its ``trident_meta.json``; and the same
flags as a command line (the converters' ``model_args.sh``).

Which fields a checkpoint fixes is one rule with two small tables, as in ``flags.py``: every field of
``ModelConfig`` (and of its nested ``MoEConfig``) describes the model the checkpoint holds, except

- :data:`RUN_FIELDS`: how this run computes or trains that same model (dropout, recomputation, kernel choices,
  initialization of weights the checkpoint overwrites); always the flags' values;
- :data:`DEFAULT_FIELDS`: the checkpoint's value is only the default (``--seq-length``: continued pretraining may
  train at another length than the one the model was converted or trained at, e.g. a long-context extension);
- ``vocab_size``: not a flag; the tokenizer sets it, and the load checks it against the checkpoint.

A field added to ``ModelConfig`` later is an architecture field unless listed here, so a new model feature is
taken from (and checked against) the checkpoint without touching this file.

The checkpoint's value replaces the flag's default; a model flag given explicitly with another value stops the
run with one line naming the flag, both values and the meta file. (Megatron's ``load_args_from_checkpoint`` takes a
fixed list of about twenty fields and settles a disagreement silently: the explicit flag wins for some, the
checkpoint for others. A launch script that says ``--num-layers 32`` beside a 24-layer checkpoint is a mistake
worth hearing about.)

``config`` imports no other package, so it reads no checkpoint itself: the entry point passes a
:data:`ModelReader` (``pretrain_gpt.py``: ``megatron.checkpointing.model_args.read_checkpoint_model``, which
resolves ``latest`` / ``--load-tag`` like the load does and reads the plain-JSON meta).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from megatron.config.flags import INVERTED, NOT_FLAGS, PARSED, field_flags
from megatron.config.model import ModelConfig

RUN_FIELDS: dict[str, str] = {
    **dict.fromkeys(("attention_dropout", "hidden_dropout"), "regularization of this run"),
    "init_method_std": "initializes weights that the checkpoint then replaces",
    "layout_invariant_init": "initializes weights that the checkpoint then replaces",
    **dict.fromkeys(
        (
            "recompute_granularity",
            "recompute_method",
            "recompute_num_layers",
            "deepspeed_activation_checkpointing",
            "partition_activations",
            "contiguous_checkpointing",
            "checkpoint_in_cpu",
            "synchronize_each_layer",
            "profile_backward",
        ),
        "activation recomputation trades memory for time; the model is the same",
    ),
    **dict.fromkeys(
        (
            "use_flash_attn",
            "masked_softmax_fusion",
            "bias_gelu_fusion",
            "bias_swiglu_fusion",
            "apply_rope_fusion",
            "persist_layer_norm",
            "cross_entropy_loss_fusion",
        ),
        "a kernel choice: the same math",
    ),
    **dict.fromkeys(
        (
            "moe_train_capacity_factor",
            "moe_eval_capacity_factor",
            "moe_min_capacity",
            "moe_token_dropping",
            "moe_top2_2nd_expert_sampling",
            "moe_loss_coeff",
            "create_moe_param_group",
        ),
        "DeepSpeed-MoE training settings (capacity, dropping, auxiliary loss, optimizer groups)",
    ),
    **dict.fromkeys(
        ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules"),
        "LoRA fine-tuning of the model (an adapter checkpoint's settings are checked at its load)",
    ),
}
"""``ModelConfig`` / ``MoEConfig`` / ``LoraConfig`` field -> why the run's flag decides it, not the checkpoint."""

DEFAULT_FIELDS: dict[str, str] = {
    "seq_length": "the training length may differ from the checkpoint's (e.g. a long-context extension)",
    "max_position_embeddings": "without a learned position table (rotary, or --no-position-embedding) it is no "
    "weight shape, and a long-context extension raises it; with a learned table it is one, and fixed",
}
"""Field -> why the checkpoint's value is only the default: an explicit flag wins without an error (for
``max_position_embeddings`` only when the checkpoint has no learned position table: :func:`_default_only`)."""

RESOLVED: dict[str, str] = {
    "num_key_value_heads": "num_query_groups",
    "kv_channels": "head_dim",
    "ffn_hidden_size": "ffn_size",
}
"""Field whose None means "derived" -> the ``ModelConfig`` property that resolves it: an explicit value equal to
the checkpoint's derived one (``--kv-channels 64`` for a checkpoint with None and hidden / heads = 64) agrees."""


@dataclass(frozen=True)
class CheckpointModel:
    """The model record of a checkpoint, as its reader found it."""

    model: dict[str, Any]
    """``dataclasses.asdict`` of the checkpoint's ``ModelConfig`` (``trident_meta.json``'s ``"model"``)."""
    source: str
    """The file it was read from (named in every message)."""


ModelReader = Callable[[str, str | None, bool], CheckpointModel]
"""``read(load, load_tag, universal)``: the model record of the checkpoint --load (--load-tag,
--universal-checkpoint) names; raises ``ValueError`` with one line when there is none or it is unreadable."""


@dataclass(frozen=True)
class ModelField:
    """A ``ModelConfig`` field (or a field of one of its nested dataclasses) a checkpoint decides."""

    field: dataclasses.Field
    parent: str | None
    """The ``ModelConfig`` attribute holding it (``"moe"``), None for a field of ``ModelConfig`` itself."""

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def default(self) -> Any:
        f = self.field
        return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[operator]

    def saved(self, model: dict[str, Any]) -> Any:
        """Its value in a saved model record (a field the record lacks predates the checkpoint: its default)."""
        record = model.get(self.parent, {}) if self.parent else model
        value = record.get(self.name, self.default) if isinstance(record, dict) else self.default
        return tuple(value) if isinstance(value, list) else value

    def value(self, model: ModelConfig) -> Any:
        return getattr(getattr(model, self.parent) if self.parent else model, self.name)


def checkpoint_fields(cls: type = ModelConfig, parent: str | None = None) -> Iterator[ModelField]:
    """Every field a checkpoint decides (architecture fields and :data:`DEFAULT_FIELDS`), in declaration order;
    nested dataclass fields (``moe``) are walked. Their names are the argparse destinations of their flags."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from checkpoint_fields(hints[f.name], f.name)
        elif f.name not in RUN_FIELDS and (cls.__name__, f.name) not in NOT_FLAGS:
            yield ModelField(f, parent)


def _flag_text(name: str, value: Any) -> list[str]:
    """The flag (and value words) that sets field ``name`` to ``value``; [] when the default already does."""
    if isinstance(value, bool):
        return [INVERTED[name] if name in INVERTED else field_flags(name)[0]]
    if name in PARSED:  # one word the flag's own parser reads back (--window-size L,R)
        return [
            field_flags(name)[0],
            ",".join(map(str, value)) if isinstance(value, tuple) else str(value),
        ]
    words = value if isinstance(value, tuple) else (value,)
    return [field_flags(name)[0], *(repr(w) if isinstance(w, float) else str(w) for w in words)]


def model_flags(model: ModelConfig) -> list[str]:
    """The command line that gives ``model``'s architecture: every architecture field of ``ModelConfig`` with a
    value (None: derived, left out), switches only when not at their default, fields of nested dataclasses
    (``--num-experts``...) only when not at their default. ``--seq-length`` is left to the launch script; a
    learned position table's size is given as ``--max-position-embeddings`` (it is a weight shape).

    ``parse_args(model_flags(m))`` has the architecture fields of ``m`` (tests check the round trip)."""
    argv: list[str] = []
    for mf in checkpoint_fields():
        value = mf.value(model)
        if mf.name == "max_position_embeddings" and _learned_positions(model):
            value = model.max_positions
        if mf.name == "seq_length" or value is None:
            continue
        if (isinstance(value, bool) or mf.parent) and value == mf.default:
            continue
        argv += _flag_text(mf.name, value)
    return argv


_NOT_GIVEN = object()


def given_fields(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The fields of :func:`checkpoint_fields` whose flags ``argv`` gives explicitly (even at their default):
    parsed again into a namespace pre-filled with a marker, which argparse leaves alone for flags not given."""
    names = [mf.name for mf in checkpoint_fields()]
    probe = argparse.Namespace(**dict.fromkeys(names, _NOT_GIVEN))
    parser.parse_args(argv, namespace=probe)
    return {n for n in names if getattr(probe, n) is not _NOT_GIVEN}


def _learned_positions(model: ModelConfig) -> bool:
    return model.add_position_embedding and not model.use_rotary_position_embeddings


def _default_only(name: str, theirs: ModelConfig) -> bool:
    """Whether an explicit flag of field ``name`` may differ from the checkpoint ``theirs`` (:data:`DEFAULT_FIELDS`)."""
    if name == "max_position_embeddings":
        return not _learned_positions(theirs)
    return name in DEFAULT_FIELDS


def _agrees(name: str, mine: Any, theirs: Any, theirs_cfg: ModelConfig) -> bool:
    """Whether the explicit value ``mine`` of field ``name`` gives the checkpoint's model: the same value, a
    :data:`DEFAULT_FIELDS` field, or the same resolved value (:data:`RESOLVED`)."""
    if mine == theirs or _default_only(name, theirs_cfg):
        return True
    prop = RESOLVED.get(name)
    if prop is None:
        return False
    mine_cfg = dataclasses.replace(theirs_cfg, **{name: mine})
    return getattr(mine_cfg, prop) == getattr(theirs_cfg, prop)


def _shown(name: str, theirs: Any, theirs_cfg: ModelConfig) -> str:
    """The checkpoint's value of field ``name`` in a conflict message."""
    if isinstance(theirs, bool):
        return f"{name}={theirs}"
    if theirs is None and name in RESOLVED:
        return f"{RESOLVED[name]} {getattr(theirs_cfg, RESOLVED[name])}"
    return " ".join(_flag_text(name, theirs)[1:])


def _saved_config(saved: dict[str, Any]) -> ModelConfig:
    """The ``ModelConfig`` of a saved model record (unknown keys ignored, missing ones at their defaults)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in saved.items() if k in names})


def apply_checkpoint_model(a: argparse.Namespace, given: set[str], saved: CheckpointModel) -> None:
    """Put the checkpoint's model into the parsed flags ``a`` (before the config is built from them): every field
    of :func:`checkpoint_fields` not in ``given`` takes the checkpoint's value.

    Raises:
        ValueError: one line listing every given architecture flag whose value differs from the checkpoint's,
            with both values and ``saved.source``.
    """
    theirs_cfg = _saved_config(saved.model)
    record = dict(saved.model)
    if _learned_positions(theirs_cfg):
        # the table's rows are a weight shape: fixed, whatever --seq-length this run trains at
        record["max_position_embeddings"] = theirs_cfg.max_positions
    conflicts = []
    for mf in checkpoint_fields():
        theirs = mf.saved(record)
        if mf.name not in given:
            setattr(a, mf.name, list(theirs) if isinstance(theirs, tuple) else theirs)
            continue
        mine = getattr(a, mf.name)
        mine = tuple(mine) if isinstance(mine, list) else mine
        if not _agrees(mf.name, mine, theirs, theirs_cfg):
            shown = _shown(mf.name, theirs, theirs_cfg)
            conflicts.append(f"{' '.join(_flag_text(mf.name, mine))} (checkpoint: {shown})")
    if conflicts:
        raise ValueError(
            f"--use-checkpoint-args: {'; '.join(conflicts)} disagree{'s' if len(conflicts) == 1 else ''} with "
            f"the checkpoint's model in {saved.source}; drop {'that flag' if len(conflicts) == 1 else 'them'} "
            "(the checkpoint sets the model) or --load a checkpoint of that shape."
        )


def checkpoint_model_for(
    a: argparse.Namespace,
    parser: argparse.ArgumentParser,
    argv: list[str],
    read: ModelReader | None,
) -> None:
    """``--use-checkpoint-args`` applied to the parsed flags ``a`` of ``argv`` (see :func:`apply_checkpoint_model`).
    The model comes from ``--pretrained-checkpoint`` when given (a LoRA run's frozen base), else from ``--load``.

    Raises:
        ValueError: neither --load nor --pretrained-checkpoint, no reader (an entry point that does not read checkpoints), or what ``read`` or
            :func:`apply_checkpoint_model` raise.
    """
    # a LoRA run's --load holds its own adapters (absent at the first start): the base fixes the model
    source = a.pretrained_checkpoint or a.load
    if not source:
        raise ValueError(
            "--use-checkpoint-args takes the model flags from the --load checkpoint (--pretrained-checkpoint with "
            "LoRA), but neither was given; add --load DIR (e.g. a checkpoint from tools/checkpoint/hf_to_trident.py)."
        )
    if read is None:
        raise ValueError(
            "--use-checkpoint-args: this program does not read checkpoints; pass the model flags instead "
            "(the converted checkpoint's model_args.sh lists them)."
        )
    if source != a.load:  # the base: its `latest`, as the LoRA load reads it
        model = read(source, None, False)
    else:
        model = read(a.load, a.load_tag, a.universal_checkpoint)
    apply_checkpoint_model(a, given_fields(parser, argv), model)
