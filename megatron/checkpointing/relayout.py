"""Resume at a new layout in one step: a regular checkpoint saved at another TP / PP / DP size or ZeRO stage is
converted on the way in (no separate command), through DeepSpeed's universal checkpoint.

Why the universal form: DeepSpeed's ``ds_to_universal`` turns the ZeRO partitions (fp32 master weights and Adam
moments, flattened and split over the data-parallel ranks) into one folder per parameter, whole, and the engine's
``load_universal`` path cuts those back into any TP slice and any ZeRO partition (stages 1, 2, 3, bf16). That is
the path ``tools/checkpoint/to_universal`` + ``--universal-checkpoint`` already takes and tests; doing it on load
only removes the manual step, so both give the same state and the same next losses.

On load (``engine.py``, when :func:`megatron.checkpointing.rules.converts_on_load` says so; the same decision the
start-up rules made on every rank):

1. rank 0 checks every file of the source tag against its recorded checksums and unpickles it restricted
   (:func:`check_converter_inputs`: ``ds_to_universal`` itself unpickles without restrictions), then writes the
   universal form into :func:`relayout_dir` -- a hidden folder in --save (shared by every node), else in --load --
   and adds the other parameter-naming scheme (:func:`add_name_aliases`: GPTModel <-> GPTModelPipe names, so PP = 1
   <-> PP > 1 works);
2. every rank loads it with ``load_universal`` switched on for that one load; the conversion is logged
   (``converting checkpoint ... from TP2 PP2 DP1 ZeRO-1 to TP1 PP2 DP2 ZeRO-1``, with the time);
3. rank 0 removes the folder. Nothing in the source tag is written: the folder is outside it, and a run killed
   mid-conversion leaves a stale folder the next conversion replaces.

MoE checkpoints are not converted here (``ds_to_universal`` does not read ``deepspeed.moe`` expert files; fp32 ones
at TP = PP = 1 are converted by name in ``relayout_moe.py``), nor ZeRO-3 ones (its ZeRO-3 branch writes flat
tensors without the shape and TP metadata DeepSpeed's ZeRO-1/2 loader reads): the rules refuse another layout for
them with the paths that work.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

from megatron.checkpointing.checksums import verify_checkpoint_files
from megatron.checkpointing.safe_load import load_state_dict_of, load_weights_only
from megatron.deepspeed_internals import ds_to_universal, zero_checkpoint_classes
from megatron.layout.names import pipe_layer_key, pipe_to_megatron_name

RELAYOUT_PREFIX = ".relayout-"
"""Name prefix of the hidden folder a load converts into (``.relayout-{tag}``)."""

_NOT_UNPICKLED = (".json", ".safetensors", ".txt")
"""Files in a tag that ``ds_to_universal`` never unpickles (meta, RNG states, checksum records)."""


def _aliases(name: str, num_layers: int) -> list[str]:
    if name.startswith("language_model."):
        idx, local = pipe_layer_key(name, num_layers)
        out = [f"{idx}.{local}"]
        if idx == 1:
            out.append(f"tied_modules.embed.{local}")
        return out
    return [pipe_to_megatron_name(name, num_layers)]


def add_name_aliases(universal_dir: Path, num_layers: int) -> int:
    """Symlink every ``zero/<param>`` folder under its other-scheme names; returns how many were added."""
    zero = universal_dir / "zero"
    added = 0
    for folder in sorted(p for p in zero.iterdir() if p.is_dir() and not p.is_symlink()):
        try:
            names = _aliases(folder.name, num_layers)
        except ValueError:
            continue  # not a GPT parameter (left as is)
        for alias in names:
            target = zero / alias
            if not target.exists():
                os.symlink(folder.name, target)
                added += 1
    return added


_MP_FILE = re.compile(r"(?:zero_pp_rank_\d+_)?mp_rank_(\d+)_model_states\.pt$")


def add_model_state_aliases(universal_dir: Path) -> int:
    """Give every model-parallel rank's model-state file both names DeepSpeed looks for in a universal folder:
    ``mp_rank_XX_model_states.pt`` (a ZeRO-0/1/2 run) and ``zero_pp_rank_0_mp_rank_XX_model_states.pt`` (a
    ZeRO-3 run), so a checkpoint of either kind loads into the other. Under ``load_universal`` DeepSpeed reads only
    the client state and metadata from that file (the weights come from ``zero/``). Returns the links added."""
    by_rank: dict[int, str] = {}
    for path in sorted(universal_dir.glob("*model_states.pt")):
        m = _MP_FILE.fullmatch(path.name)
        if m is not None and not path.is_symlink():
            by_rank.setdefault(int(m.group(1)), path.name)
    added = 0
    for mp, name in by_rank.items():
        for alias in (
            f"mp_rank_{mp:02d}_model_states.pt",
            f"zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt",
        ):
            if not (universal_dir / alias).exists():
                os.symlink(name, universal_dir / alias)
                added += 1
    return added


def add_stage3_optimizer_state(universal_dir: Path) -> bool:
    """Make ``zero/optimizer_state.pt`` of a ZeRO-1/2 checkpoint readable by DeepSpeed's ZeRO-3 universal loader
    too: that loader reads the Adam step and the group settings from a nested ``optimizer_state_dict`` (which
    ``ds_to_universal`` writes only for ZeRO-3 sources); the step is the one in every parameter's ``step.pt``.
    Returns whether it added the entry (the ZeRO-1/2 loader ignores it)."""
    path = universal_dir / "zero" / "optimizer_state.pt"
    allowed = zero_checkpoint_classes()
    state = load_weights_only(path, allowed=allowed, kind="converted optimizer state")
    if not isinstance(state, dict) or "optimizer_state_dict" in state:
        return False
    steps = sorted((universal_dir / "zero").glob("*/step.pt"))
    if not steps:
        return False
    step = load_weights_only(steps[0], allowed=allowed, kind="converted optimizer step")
    state["optimizer_state_dict"] = {
        "state": {0: {"step": step}},
        "param_groups": state.get("param_groups", []),
    }
    torch.save(state, path)
    return True


def pad_vocab_rows(universal_dir: Path, rows: int) -> int:
    """Zero-pad the vocabulary parameters (``vocab_tensor`` in their ``fp32`` / ``exp_avg`` / ``exp_avg_sq``
    files) of a universal folder to ``rows`` rows, the run's padded vocabulary: DeepSpeed's ZeRO-3 universal loader
    reads each tensor as the parameter's whole flat storage (the ZeRO-1/2 loader pads itself, with zeros too).
    Returns the files rewritten."""
    padded = 0
    for folder in sorted(
        p for p in (universal_dir / "zero").iterdir() if p.is_dir() and not p.is_symlink()
    ):
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            path = folder / f"{key}.pt"
            if not path.is_file():
                continue
            state = load_weights_only(path, kind="converted parameter state")
            if not (isinstance(state, dict) and state.get("vocab_tensor")):
                break  # not a vocabulary parameter
            param = state["param"]
            if param.shape[0] < rows:
                pad = param.new_zeros((rows - param.shape[0], *param.shape[1:]))
                state["param"] = torch.cat([param, pad])  # [V', h] -> [v, h]
                torch.save(state, path)
                padded += 1
    return padded


def check_converter_inputs(tag_dir: Path, meta: dict[str, Any], *, hashes: bool = True) -> None:
    """Before ``ds_to_universal`` (which unpickles with ``weights_only=False``, so a crafted file runs code): every
    file it may read has its recorded size and SHA-256, and unpickles with ``torch.load(weights_only=True)``
    allowing only tensors, plain containers and DeepSpeed's own checkpoint classes (``hashes=False``: sizes
    only, ``--no-verify-checkpoint-checksums``; the restricted unpickling still runs).

    Raises:
        ValueError / FileNotFoundError: one line naming the first file that fails.
    """
    verify_checkpoint_files(tag_dir, meta, hashes=hashes)
    allowed = zero_checkpoint_classes()
    for path in sorted(p for p in tag_dir.rglob("*") if p.is_file() or p.is_symlink()):
        if path.suffix in _NOT_UNPICKLED:
            continue
        if path.is_symlink():
            raise ValueError(
                f"{path} is a symlink; to_universal converts only regular files of the checkpoint (a link could "
                "make DeepSpeed unpickle a file from elsewhere). Copy the real file in its place."
            )
        try:
            load_weights_only(path, allowed=allowed, mmap=True, kind="DeepSpeed checkpoint file")
        except ValueError as err:
            raise ValueError(
                f"{err} to_universal refuses it: DeepSpeed's ds_to_universal unpickles every checkpoint file "
                "without restrictions."
            ) from None


def union_of_universal_infos(tag_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """(the first model-state file, the union of every model-parallel rank's ``universal_checkpoint_info``) when
    that file's info lacks patterns of other ranks; None otherwise. ``ds_to_universal`` reads the info of the
    first file only, and each rank saved the patterns its own parameters use: under a pipeline, stage 0's info
    lacks the last stage's (the final norm would be merged as if TP-split)."""
    files = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    if len(files) < 2:
        return None
    allowed = zero_checkpoint_classes()
    infos = [
        load_state_dict_of(f, allowed=allowed, mmap=True).get(UNIVERSAL_CHECKPOINT_INFO) or {}
        for f in files
    ]
    merged = dict(infos[0])
    for info in infos[1:]:
        for key, value in info.items():
            if isinstance(value, list) and all(isinstance(p, str) for p in value):
                merged[key] = list(dict.fromkeys([*merged.get(key, []), *value]))
    return (files[0], merged) if merged != infos[0] else None


def converter_input(tag_dir: Path, scratch: Path) -> Path:
    """What ``ds_to_universal`` reads: ``tag_dir`` itself, or (:func:`union_of_universal_infos`) ``scratch``
    holding links to its files and a copy of the first model-state file with the complete info (the source is
    never written)."""
    union = union_of_universal_infos(tag_dir)
    if union is None:
        return tag_dir
    first, info = union
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    for path in sorted(tag_dir.iterdir()):
        if path.is_file() and path != first:
            os.symlink(path.resolve(), scratch / path.name)
    state = load_state_dict_of(first, allowed=zero_checkpoint_classes())
    state[UNIVERSAL_CHECKPOINT_INFO] = info
    torch.save(state, scratch / first.name)
    return scratch


def write_universal_form(
    tag_dir: Path, out: Path, meta: dict[str, Any], *, workers: int = 1, hashes: bool = True
) -> None:
    """The universal form of the checkpoint tag ``tag_dir`` (with its ``meta``) in ``out`` (replaced if there):
    inputs checked (:func:`check_converter_inputs`), ``ds_to_universal`` (given every rank's parameter
    patterns: :func:`converter_input`), both parameter-naming schemes and both
    model-state file names (:func:`add_model_state_aliases`), the ZeRO-3 loader's view of the optimizer state
    (:func:`add_stage3_optimizer_state`). ``tag_dir`` is only read.

    Raises:
        ValueError / FileNotFoundError: a source file fails its checks, or DeepSpeed refused the checkpoint.
    """
    check_converter_inputs(tag_dir, meta, hashes=hashes)
    if out.exists():
        shutil.rmtree(out)
    scratch = out.parent / f".input-{out.name}"
    try:
        ds_to_universal(str(converter_input(tag_dir, scratch)), str(out), workers=workers)
    except AssertionError as err:
        raise ValueError(f"ds_to_universal refused {tag_dir}: {err}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    add_name_aliases(out, int(meta["model"]["num_layers"]))
    add_model_state_aliases(out)
    add_stage3_optimizer_state(out)


def relayout_dir(save: str | None, load: str, tag: str) -> Path:
    """Where a load converts ``tag`` of ``load``: ``{save}/.relayout-{tag}`` (--save: written by this run anyway,
    seen by every node), else ``{load}/.relayout-{tag}``; never inside the source tag."""
    return Path(save or load) / f"{RELAYOUT_PREFIX}{tag}"


def layout_words(*, tp: int, pp: int, dp: int, stage: int) -> str:
    """``TP2 PP2 DP1 ZeRO-1``: a layout as the conversion log line names it."""
    return f"TP{tp} PP{pp} DP{dp} ZeRO-{stage}"


def convert_for_load(
    load: str,
    tag: str,
    meta: dict[str, Any],
    work: Path,
    *,
    zero3_vocab_rows: int | None = None,
    hashes: bool = True,
) -> tuple[str, float]:
    """Rank 0's part of an on-load conversion: the universal form of ``load/tag`` under ``work`` (created);
    returns (the directory and tag to hand ``engine.load_checkpoint``: ``work`` and ``tag``, the seconds taken).
    ``zero3_vocab_rows``: the run is ZeRO-3 (at TP 1) with that padded vocabulary (:func:`pad_vocab_rows`).

    Raises:
        ValueError / FileNotFoundError: as :func:`write_universal_form`.
    """
    start = time.perf_counter()
    if work.exists():
        shutil.rmtree(work)  # a conversion killed half-way: start over
    work.mkdir(parents=True)
    write_universal_form(Path(load) / tag, work / tag, meta, hashes=hashes)
    if zero3_vocab_rows is not None:
        pad_vocab_rows(work / tag, zero3_vocab_rows)
    return str(work), time.perf_counter() - start


def saved_param_groups(work: Path, tag: str) -> list[dict[str, Any]]:
    """The optimizer groups' settings saved in the converted folder (``zero/optimizer_state.pt``).

    Raises:
        ValueError: the file cannot be read safely.
    """
    path = work / tag / "zero" / "optimizer_state.pt"
    state = load_weights_only(
        path, allowed=zero_checkpoint_classes(), kind="converted optimizer state"
    )
    groups = state.get("param_groups") if isinstance(state, dict) else None
    return list(groups) if isinstance(groups, list) else []


def remove_relayout_dir(work: Path) -> None:
    """Drop the converted copy once every rank loaded it (best effort: a leftover is replaced next time)."""
    shutil.rmtree(work, ignore_errors=True)
