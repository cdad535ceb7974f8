"""What a Hugging Face tokenizer's own files say about its special tokens: which are BOS/EOS/PAD, and which ids its
``encode`` puts around a text (Llama 3 adds ``<|begin_of_text|>``; Qwen2 adds nothing).

The rule is transformers 5's (``TokenizersBackend``), so ids match ``AutoTokenizer(text).input_ids``:

* ``bos_token`` / ``eos_token`` / ``pad_token``: ``tokenizer_config.json`` over ``special_tokens_map.json`` (a
  value may be a string or ``{"content": ...}``; an explicit ``null`` means none). Without either file, well-known
  names present in the vocabulary are used (``</s>``, ``<|endoftext|>``, ``<s>``, ``<|begin_of_text|>``, ...).
* added ids: when ``tokenizer_config.json`` sets ``add_bos_token`` or ``add_eos_token``, or ``tokenizer.json`` has no
  post-processor, the BOS (EOS) id when that flag is true and the token exists; otherwise what the
  post-processor's template adds (``TemplateProcessing``, alone or inside a ``Sequence``: its special tokens
  before and after ``$A``).

Preprocessing puts these ids around every document, and a generation prompt starts with the prefix exactly once.
Files that do not parse raise :class:`TokenizerFileError` naming the file and line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token")
WELL_KNOWN = {
    "eos_token": ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>"),
    "bos_token": ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"),
    "pad_token": ("<pad>", "[PAD]", "<|pad|>"),
}
"""Token names tried, in order, when no config file names the token."""


class TokenizerFileError(ValueError):
    """A tokenizer file is missing, is not JSON, or describes something we cannot load (a one-line message)."""


class TokenizerFileMissing(TokenizerFileError, FileNotFoundError):
    """The tokenizer path does not exist."""


def load_json(path: str, what: str) -> dict[str, Any]:
    """The JSON object in ``path``.

    Raises:
        TokenizerFileError: the file is not UTF-8 JSON or not an object (naming ``path:line`` and ``what``).
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise TokenizerFileError(
            f"{path}:{e.lineno}: {what} is not valid JSON ({e.msg}, column {e.colno}); restore the file "
            "(e.g. save the tokenizer again with transformers' save_pretrained)."
        ) from None
    except UnicodeDecodeError as e:
        raise TokenizerFileError(f"{path}: {what} is not UTF-8 text ({e.reason}).") from None
    if not isinstance(data, dict):
        raise TokenizerFileError(
            f"{path}:1: {what} must be a JSON object, not {type(data).__name__}."
        )
    return data


def _token(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class TokenizerConfig:
    """The special-token part of ``tokenizer_config.json`` + ``special_tokens_map.json``."""

    tokens: dict[str, str | None]
    """bos_token / eos_token / pad_token -> token string, or None where a file sets it to null."""
    add_flags: dict[str, bool]
    """add_bos_token / add_eos_token, where ``tokenizer_config.json`` sets them."""
    has_files: bool
    """Whether either file exists (without them, well-known token names are tried)."""


def read_tokenizer_config(directory: str) -> TokenizerConfig:
    """The special tokens and add flags the config files beside a ``tokenizer.json`` set.

    Raises:
        TokenizerFileError: a file that is not a JSON object.
    """
    tokens: dict[str, str | None] = {}
    flags: dict[str, bool] = {}
    found = False
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the second wins
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        found = True
        data = load_json(path, name)
        for key in SPECIAL_KEYS:
            if key in data:
                tokens[key] = _token(data[key])
        for key in ("add_bos_token", "add_eos_token"):
            if name == "tokenizer_config.json" and key in data:
                flags[key] = bool(data[key])
    return TokenizerConfig(tokens, flags, found)


def special_ids(
    config: TokenizerConfig, token_to_id: Callable[[str], int | None]
) -> dict[str, int | None]:
    """bos_token / eos_token / pad_token -> id (None: no such token)."""
    out: dict[str, int | None] = {}
    for key in SPECIAL_KEYS:
        if key in config.tokens:
            token = config.tokens[key]
            out[key] = None if token is None else token_to_id(token)
        else:
            ids = (token_to_id(c) for c in WELL_KNOWN[key])
            out[key] = next((i for i in ids if i is not None), None)
    return out


def _template_ids(processor: dict[str, Any] | None) -> tuple[list[int], list[int]] | None:
    """(ids before, ids after) ``$A`` in a TemplateProcessing's single template (searched inside a Sequence);
    None when there is no template."""
    if not processor:
        return None
    if processor.get("type") == "Sequence":
        for inner in processor.get("processors") or []:
            found = _template_ids(inner)
            if found is not None:
                return found
        return None
    if processor.get("type") != "TemplateProcessing":
        return None
    specials = processor.get("special_tokens") or {}
    before: list[int] = []
    after: list[int] = []
    side = before
    for piece in processor.get("single") or []:
        if "Sequence" in piece:
            side = after
        elif "SpecialToken" in piece:
            side.extend(
                int(i) for i in specials.get(piece["SpecialToken"]["id"], {}).get("ids", [])
            )
    return before, after


def added_ids(
    config: TokenizerConfig, spec: dict[str, Any], ids: dict[str, int | None]
) -> tuple[list[int], list[int]]:
    """(ids before, ids after) a text that the tokenizer's own ``encode`` adds (see the module docstring).

    Args:
        config: the config files' special tokens and flags.
        spec: the parsed ``tokenizer.json``.
        ids: :func:`special_ids`.
    """
    processor = spec.get("post_processor")
    if config.add_flags or processor is None:
        bos, eos = ids["bos_token"], ids["eos_token"]
        before = [bos] if config.add_flags.get("add_bos_token") and bos is not None else []
        after = [eos] if config.add_flags.get("add_eos_token") and eos is not None else []
        return before, after
    return _template_ids(processor) or ([], [])
