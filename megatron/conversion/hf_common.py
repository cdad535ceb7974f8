"""Helpers shared by the Hugging Face converters: config normalization and strict key bookkeeping."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch


def config_to_dict(hf_config: Any) -> dict[str, Any]:
    """A plain dict from a ``transformers`` config object or a ``config.json`` dict."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    to_dict = getattr(hf_config, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise ValueError(
        f"hf_config must be a dict (config.json) or a transformers config, got {type(hf_config).__name__}."
    )


def require(cfg: Mapping[str, Any], key: str, model: str) -> Any:
    """``cfg[key]``, or a ValueError naming the missing config.json field."""
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"the {model} config.json has no '{key}'; is this a {model} checkpoint?")
    return cfg[key]


def require_size(cfg: Mapping[str, Any], key: str, model: str, default: int | None = None) -> int:
    """``cfg[key]`` (``default`` when absent) as a size: an integer >= 1, or a ValueError naming the config.json
    field and its value (``n_positions: 0`` would otherwise build a model with no positions and fail later, deep in
    a spawned rank)."""
    value = cfg.get(key) if default is not None else require(cfg, key, model)
    value = default if value is None else value
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value < 1:
        raise ValueError(
            f"the {model} config.json has {key}: {value!r}; it must be a whole number >= 1 (a size of the "
            "model); fix config.json."
        )
    return int(value)


def fold_layernorm_1p(
    full_state_dict: Mapping[str, torch.Tensor], model_config: Any
) -> tuple[Mapping[str, torch.Tensor], Any]:
    """A ``--apply-layernorm-1p`` model as the plain one it equals: every norm weight ``w`` becomes ``1 + w``
    (the scale the norm applies) and the config loses the flag; other models are returned unchanged."""
    if not getattr(model_config, "apply_layernorm_1p", False):
        return full_state_dict, model_config
    folded = {
        k: (v + 1.0 if k.endswith("layernorm.weight") else v) for k, v in full_state_dict.items()
    }
    return folded, dataclasses.replace(model_config, apply_layernorm_1p=False)


class _TrackedKeys:
    """A state dict read tensor by tensor (as fp32), remembering which keys were read, so that what a conversion
    leaves unread is an error instead of silently dropped weights."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._sd = tensors
        self._used: set[str] = set()

    def _missing(self, key: str) -> str:
        raise NotImplementedError

    def _unused(self, unused: list[str]) -> str:
        raise NotImplementedError

    def _read(self, key: str) -> torch.Tensor:
        if key not in self._sd:
            raise ValueError(self._missing(key))
        self._used.add(key)
        return self._sd[key].detach().to(torch.float32)

    def check_all_used(self) -> None:
        """ValueError listing the tensors the conversion did not read."""
        unused = sorted(set(self._sd) - self._used)
        if unused:
            raise ValueError(self._unused(unused))


class StrictKeys(_TrackedKeys):
    """Takes tensors out of an HF state dict by name and reports what was missing or left unused.

    Args:
        state_dict: the HF state dict (not modified).
        prefix: the model prefix to strip when every key carries it (``transformer.`` / ``model.``); a state dict
            of the bare base model (``GPT2Model``, ``LlamaModel``) works too.
        ignore_suffixes: non-weight buffers that old checkpoints carry (causal-mask buffers, rotary ``inv_freq``).
        model: name used in messages.
    """

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor],
        *,
        prefix: str,
        ignore_suffixes: Iterable[str] = (),
        model: str,
    ) -> None:
        self._model = model
        ignore = tuple(ignore_suffixes)
        tensors: dict[str, torch.Tensor] = {}
        for key, value in state_dict.items():
            if ignore and key.endswith(ignore):
                continue
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"{model} state dict entry '{key}' is a {type(value).__name__}, not a tensor."
                )
            tensors[key[len(prefix) :] if key.startswith(prefix) else key] = value
        super().__init__(tensors)

    def has(self, key: str) -> bool:
        """Whether ``key`` (without prefix) is present."""
        return key in self._sd

    def take(self, key: str) -> torch.Tensor:
        """The fp32 tensor at ``key`` (without prefix); ValueError naming the key when it is missing."""
        return self._read(key)

    def _missing(self, key: str) -> str:
        return (
            f"{self._model} state dict has no '{key}' (first keys: {sorted(self._sd)[:5]}); the checkpoint "
            f"does not match its config.json or is not a {self._model} model."
        )

    def _unused(self, unused: list[str]) -> str:
        return (
            f"{self._model} state dict has {len(unused)} tensors this converter does not map "
            f"(e.g. {unused[:5]}); the checkpoint uses a variant Trident does not support."
        )


class MegatronKeys(_TrackedKeys):
    """Callable lookup into a full Megatron state dict (fp32) that remembers which keys were read.

    Exporters call it per tensor and finish with :meth:`check_all_used`, so a state dict that does not match the
    ``ModelConfig`` (e.g. an output layer in a tied model) is an error instead of silently dropped weights.
    """

    def __init__(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        super().__init__(dict(state_dict))

    def __call__(self, key: str) -> torch.Tensor:
        return self._read(key)

    def _missing(self, key: str) -> str:
        return (
            f"Megatron state dict has no '{key}'; pass the full (TP- and PP-merged) model whose ModelConfig "
            "you gave."
        )

    def _unused(self, unused: list[str]) -> str:
        return (
            f"Megatron state dict has {len(unused)} tensors the ModelConfig does not account for "
            f"(e.g. {unused[:5]}); check --num-layers, --untie-embeddings-and-output-weights and "
            "--disable-bias-linear."
        )
