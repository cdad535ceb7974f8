"""Tokenizer files for tests."""

from __future__ import annotations

import json
from pathlib import Path


def swapped_vocab(vocab_file: str | Path, out_file: str | Path, a: str = "a", b: str = "o") -> str:
    """Write a copy of a GPT-2 ``vocab.json`` with the ids of tokens ``a`` and ``b`` swapped; returns its path.

    The result is a tokenizer of the same type and size that encodes text into other ids.
    """
    vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    Path(out_file).write_text(json.dumps(vocab), encoding="utf-8")
    return str(out_file)
