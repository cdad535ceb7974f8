"""Loading weight files without executing pickled code: safetensors, or ``torch.load(weights_only=True)``.

A ``.bin``/``.pt`` file that holds arbitrary pickled objects is refused with an explanation instead of being
unpickled: unpickling runs code chosen by whoever wrote the file. Everything here works offline on local paths.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

_SAFETENSORS_SUFFIX = ".safetensors"
_CONVERT_HINT = (
    'python -c "import torch, safetensors.torch as s; '
    "s.save_file(torch.load('{path}', weights_only=False), '{stem}.safetensors')\""
)


_REFUSED = re.compile(r"Unsupported global: GLOBAL ([\w.]+)|got <class '([\w.]+)'>")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def refused_class(err: BaseException) -> str | None:
    """The class a weights-only ``torch.load`` refused to unpickle, read from its error (None: another failure)."""
    found = _REFUSED.search(_ANSI.sub("", str(err)))
    return next(g for g in found.groups() if g) if found else None


def load_weights_only(
    path: Path, *, allowed: Sequence[Any] = (), mmap: bool = False, kind: str = "checkpoint file"
) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU, unpickling no class but those in ``allowed``.

    Args:
        path: a ``torch.save`` file.
        allowed: classes the file may hold (e.g. DeepSpeed's ZeRO stage enum).
        mmap: map the file instead of reading it (only the tensors used are paged in).
        kind: what the file should be, for the message.

    Raises:
        ValueError: one line naming the file and the class that was refused, or why it is unreadable.
    """
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # noqa: BLE001 - unpickling refused or corrupt file: one clear message
        refused = refused_class(err)
        if refused:
            raise ValueError(
                f"{path} holds a pickled {refused}, which Trident does not unpickle (it could run code); if "
                "the file is from a trusted run, re-save its tensors as safetensors."
            ) from None
        text = _ANSI.sub("", str(err))
        raise ValueError(
            f"{path} cannot be read with torch.load(weights_only=True) ({type(err).__name__}: "
            f"{text.splitlines()[0] if text else ''}); is it a {kind}?"
        ) from None


def _load_pickle_weights_only(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        refused = refused_class(err)
        if refused:
            raise ValueError(
                f"{path} contains pickled Python objects (e.g. {refused}), which Trident refuses to "
                "unpickle because that can run arbitrary code. It must come from a trusted source; if it "
                "does, convert it once to safetensors with: "
                + _CONVERT_HINT.format(path=path, stem=path.with_suffix(""))
            ) from None
        raise ValueError(
            f"{path} is not a readable PyTorch weights file (corrupt, truncated or another format): {err}"
        ) from None
    except Exception as err:  # noqa: BLE001 - text, truncated or foreign bytes fail anywhere in the unpickler
        text = _ANSI.sub("", str(err)).strip()
        detail = f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
        raise ValueError(
            f"{path} is not a readable PyTorch weights file (corrupt, truncated or another format; torch.load "
            f"said {detail}); re-save the weights with save_pretrained() or use model.safetensors."
        ) from None


def torch_load_checkpoint_file(path: Path) -> Any:
    """A Trident/DeepSpeed checkpoint file (``*_model_states.pt``) read with ``torch.load(weights_only=True)``.

    Raises:
        ValueError: unpickling was refused or the file is corrupt (one message naming the file).
    """
    return load_weights_only(path, kind="Trident/DeepSpeed checkpoint file")


def load_state_dict_of(
    path: Path, *, allowed: Sequence[Any] = (), mmap: bool = False
) -> dict[str, Any]:
    """:func:`load_weights_only` of a DeepSpeed state-dict file, which must hold a dict.

    Raises:
        ValueError: as :func:`load_weights_only`, or the file holds something else than a dict.
    """
    obj = load_weights_only(path, allowed=allowed, mmap=mmap, kind="DeepSpeed checkpoint file")
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a {type(obj).__name__}, not a DeepSpeed state dict.")
    return obj


def _check_state_dict(obj: Any, path: Path) -> dict[str, torch.Tensor]:
    if not isinstance(obj, dict):
        raise ValueError(
            f"{path} holds a {type(obj).__name__}, not a state dict (a dict of name -> tensor)."
        )
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        nested = [k for k in bad if isinstance(obj.get(k), dict)]
        hint = (
            f" It looks like a training checkpoint; the weights may be under {nested[:3]}."
            if nested
            else ""
        )
        raise ValueError(
            f"{path} is not a flat state dict: {len(bad)} entries are not tensors "
            f"(e.g. {bad[:3]}).{hint}"
        )
    return obj


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a flat ``{name: tensor}`` weights file onto the CPU without unpickling arbitrary objects.

    Args:
        path: a ``.safetensors`` file (preferred), or a ``torch.save`` file (``.bin``/``.pt``) readable with
            ``torch.load(weights_only=True)``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is corrupt, holds pickled objects (refused; the message says how to convert a
            trusted file), or is not a flat dict of tensors.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"weights file {p} does not exist (or is not a file).")
    if p.suffix == _SAFETENSORS_SUFFIX:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(p), device="cpu")
        except SafetensorError as err:
            raise ValueError(f"{p} is not a valid safetensors file: {err}") from None
    return _check_state_dict(_load_pickle_weights_only(p), p)


def _check_shard_name(index_path: Path, tensor: str, shard_name: Any) -> None:
    """A shard of an HF index names a file of the model directory: a relative path without ``..`` (the name is
    checked, not where a symlink leads: the Hub's cache links every file of a snapshot to its blob store).

    Raises:
        ValueError: naming the index file, the entry and the rule.
    """
    parts = Path(shard_name).parts if isinstance(shard_name, str) else ()
    if not parts or Path(shard_name).is_absolute() or ".." in parts or "\0" in shard_name:
        raise ValueError(
            f"{index_path}: weight_map entry {tensor!r}: {shard_name!r} is not a file name inside "
            f"{index_path.parent}; a shard index may only name files of its own directory (e.g. "
            "'model-00001-of-00002.safetensors'), never an absolute path or one with '..'."
        )


def _load_index(directory: Path, index_name: str) -> dict[str, torch.Tensor]:
    index_path = directory / index_name
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(
            f"{index_path} is not a valid HF shard index (needs 'weight_map'): {err}"
        ) from None
    if not isinstance(weight_map, dict):
        raise ValueError(
            f"{index_path}: 'weight_map' is a {type(weight_map).__name__}, not an object of tensor name -> "
            "shard file name."
        )
    for tensor, shard_name in weight_map.items():
        _check_shard_name(index_path, tensor, shard_name)
    state: dict[str, torch.Tensor] = {}
    for shard_name in sorted(set(weight_map.values())):
        state.update(load_state_dict_file(directory / shard_name))
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise ValueError(f"{index_path} lists tensors that no shard contains (e.g. {missing[:5]}).")
    return state


def load_hf_directory(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a local Hugging Face model directory: ``(state_dict, config_dict)``, offline.

    Looks, in order, for ``model.safetensors``, ``model.safetensors.index.json`` (sharded),
    ``pytorch_model.bin``, ``pytorch_model.bin.index.json``. ``.bin`` files go through the weights-only loader.

    Raises:
        FileNotFoundError: no directory, no ``config.json``, or no weights file of the names above.
        ValueError: unreadable config or weights (see :func:`load_state_dict_file`).
    """
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"HF model directory {d} does not exist.")
    config_path = d / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{d} has no config.json; point at a directory written by save_pretrained()."
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path} is not valid JSON: {err}") from None
    for single, index in (
        ("model.safetensors", "model.safetensors.index.json"),
        ("pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
        if (d / single).is_file():
            return load_state_dict_file(d / single), config
        if (d / index).is_file():
            return _load_index(d, index), config
    raise FileNotFoundError(
        f"{d} has no model.safetensors, model.safetensors.index.json, pytorch_model.bin or "
        "pytorch_model.bin.index.json."
    )
