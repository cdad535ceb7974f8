"""The record of a run's tokenizer that checkpoints keep (``trident_meta.json``'s ``"tokenizer"`` entry), and the
tokenizer built back from it (by the HF export and text generation).

    {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "/abs/vocab.json", "merge_file": "/abs/merges.txt",
     "fingerprint": "<encoding_fingerprint>"}
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron.tokenizer.tokenizer import MegatronTokenizer, build_tokenizer

TOKENIZER_KEYS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")
"""The flags a record keeps (file paths absolute)."""

_NEEDS = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "HFTokenizer": ("tokenizer_model",),
}


def tokenizer_info(
    *,
    tokenizer_type: str | None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    fingerprint: str | None = None,
) -> dict[str, str] | None:
    """The ``"tokenizer"`` entry of ``trident_meta.json`` (absolute paths), or None without a tokenizer type.

    ``fingerprint``: ``megatron.tokenizer.encoding_fingerprint`` of the tokenizer (how it encodes fixed texts).
    """
    if not tokenizer_type:
        return None
    info = {"tokenizer_type": tokenizer_type}
    if fingerprint:
        info["fingerprint"] = fingerprint
    for key, value in (
        ("vocab_file", vocab_file),
        ("merge_file", merge_file),
        ("tokenizer_model", tokenizer_model),
    ):
        if value:
            info[key] = os.path.abspath(value)
    return info


def recorded_file(info: dict[str, str], key: str) -> Path:
    """The existing file a record names under ``key`` (FileNotFoundError naming the flag to pass otherwise)."""
    value = info.get(key)
    flag = "--" + key.replace("_", "-")
    if not value:
        raise FileNotFoundError(
            f"--tokenizer-type {info.get('tokenizer_type')} needs {flag}, which is neither recorded in the "
            f"checkpoint nor given; pass {flag}."
        )
    path = Path(value)
    if not path.exists():
        raise FileNotFoundError(
            f"{flag} {path} (recorded at training time) no longer exists; pass {flag} with its new place."
        )
    return path


def tokenizer_from_info(info: dict[str, str]) -> MegatronTokenizer:
    """The tokenizer a record describes (its files checked first, naming the flag to pass).

    Raises:
        FileNotFoundError: a recorded file is not given or no longer exists.
        ValueError: the tokenizer cannot be built from the files.
    """
    for key in _NEEDS.get(info["tokenizer_type"], ()):
        recorded_file(info, key)
    return build_tokenizer(**{k: info.get(k) for k in TOKENIZER_KEYS})
