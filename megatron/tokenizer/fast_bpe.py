"""A fast encoder for GPT-2-style byte-level BPE: tiktoken's BPE over the user's own vocabulary and merges.

Nothing is downloaded: the encoder is built from the files the flags name (``--vocab-file`` / ``--merge-file``, or a
byte-level BPE ``tokenizer.json`` as ``--tokenizer-model``), the way GPT-2 defines them: ``bytes_to_unicode`` maps
every byte to a printable character, merge ``k`` makes token rank ``256 + k``, the pre-tokenizer is GPT-2's regular
expression. ``GPT2BPETokenizer`` and ``HFTokenizer`` use it only when it encodes exactly like their reference (the
Hugging Face ``tokenizers`` encoder): :func:`probe_mismatch` compares both on :data:`PROBE_TEXTS` at start-up, which
cover the rules where BPE implementations differ (``<|endoftext|>`` inside text, contractions, digits, non-ASCII,
emoji, leading, trailing and very long whitespace runs, empty text). Without tiktoken, with files it cannot
represent, or on any mismatch, the reference stays in use and the tokenizer's ``encoder`` says why.

Measured on this 2-core box with the real GPT-2 files: ~10 MB/s per thread against ~1.5 MB/s for the reference.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import numpy as np

try:
    import tiktoken

    HAVE_TIKTOKEN = True
except ImportError:  # optional: the reference encoder is used
    HAVE_TIKTOKEN = False

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"""GPT-2's pre-tokenizer (the same expression as ``tokenizers.pre_tokenizers.ByteLevel(use_regex=True)``)."""

PROBE_TEXTS: tuple[str, ...] = (
    "",
    "Hello world! It's a test: they'll've done 1,234.5 things, I'd say; we're 100% sure.",
    "In the beginning God created the heaven and the earth.\nAnd the earth was without form, and void.",
    "text<|endoftext|>more text <|endoftext|> and <|endoftext|>",
    "naïve café déjà vu — 東京 🙂 ü Ω ß ﬁ e\u0301 \u200b zero\u00a0width",
    "  two leading spaces, trailing spaces   ",
    "tabs\tand\nnew\r\nlines\n\n\n",
    " " * 300 + "x" + "\n" * 200 + "y" + "\t " * 150,
    "def f(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n",
    "CamelCase_and_snake_case 0xDEADBEEF 3.14159e-10 ''' \"\"\" ``` $$$ @@@",
    "a" * 500 + " " + "ab" * 300,
)
"""Texts the fast encoder must encode exactly like the reference before it is used."""


def _byte_to_char() -> dict[int, str]:
    """GPT-2's ``bytes_to_unicode``: each byte as a printable character (printable ASCII/Latin-1 map to
    themselves, the other bytes to 256, 257, ...). Its order is the order of the 256 single-byte ranks."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {b: chars[b] for b in [*printable, *(b for b in range(256) if b not in printable)]}


class FastBPE:
    """tiktoken's BPE with the ranks of one byte-level BPE vocabulary and its merges, giving the vocabulary's ids.

    Args:
        encoding: the tiktoken encoding (ranks: the 256 bytes, one per merge, then the special tokens).
        rank_to_id: id of each rank, or None when every rank is its own id (the original GPT-2 files).
    """

    def __init__(self, encoding: tiktoken.Encoding, rank_to_id: np.ndarray | None) -> None:
        self._enc = encoding
        self._ids = rank_to_id
        self._specials = bool(encoding.special_tokens_set)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens only where the vocabulary has them as added tokens (a
        tokenizer.json), never for vocab.json + merges.txt (``<|endoftext|>`` in text is plain characters there)."""
        if self._specials:
            ranks = self._enc.encode(text, allowed_special="all")
        else:
            ranks = self._enc.encode_ordinary(text)
        return ranks if self._ids is None else self._ids[ranks].tolist()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text (one thread; parallelism is preprocessing's workers)."""
        return [self.encode(t) for t in texts]


def _as_bytes(tokens: list[str], table: dict[int, str]) -> list[bytes | None]:
    """Each byte-level token as its bytes (None for a token outside the byte alphabet, e.g. a special token);
    one ``str.translate`` over all of them at once."""
    translated = (
        "\uffff".join(tokens).translate(table).split("\uffff")
    )  # U+FFFF is no byte's character
    out: list[bytes | None] = []
    for latin in translated:
        try:
            out.append(latin.encode("latin-1"))
        except UnicodeEncodeError:
            out.append(None)
    return out


def fast_bpe(
    vocab: dict[str, int], merges: Sequence[tuple[str, str]], special: dict[str, int] | None = None
) -> tuple[FastBPE | None, str]:
    """The fast encoder of a byte-level BPE (GPT-2's byte alphabet and pre-tokenizer), or None and why it cannot
    represent it.

    Needs every single byte and every merge result in the vocabulary, and no merge result twice: tiktoken ranks a
    merged token by the merge that made it (``256 + k``), which must then equal the pair ranks of the merges.

    Args:
        vocab: token string -> id.
        merges: the merges in rank order.
        special: added tokens matched as whole strings before BPE (token -> id).
    """
    if not HAVE_TIKTOKEN:
        return None, "tiktoken is not installed (pip install tiktoken)"
    chars = _byte_to_char()
    table = str.maketrans({c: chr(b) for b, c in chars.items()})
    ranks: dict[bytes, int] = {}
    ids: list[int] = []
    for byte, char in chars.items():
        if char not in vocab:
            return None, f"the vocabulary lacks the single-byte token {char!r}"
        ranks[bytes([byte])] = len(ids)
        ids.append(vocab[char])
    merged = [a + b for a, b in merges]
    for k, (token, token_bytes) in enumerate(zip(merged, _as_bytes(merged, table), strict=True)):
        if token_bytes is None or token not in vocab:
            return None, f"merge {' '.join(merges[k])!r} makes a token outside the vocabulary"
        if token_bytes in ranks:
            return None, f"merge {' '.join(merges[k])!r} makes a token that an earlier merge makes"
        ranks[token_bytes] = len(ids)
        ids.append(vocab[token])
    specials = {}
    for token, token_id in (special or {}).items():
        specials[token] = len(ids)
        ids.append(token_id)
    encoding = tiktoken.Encoding(
        "trident-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )
    rank_to_id = np.asarray(ids, dtype=np.int64)
    identity = bool((rank_to_id == np.arange(len(ids))).all())
    return FastBPE(encoding, None if identity else rank_to_id), ""


def build_fast_bpe(vocab_file: str, merge_file: str) -> tuple[FastBPE | None, str]:
    """:func:`fast_bpe` of GPT-2's files: vocab.json and merges.txt (one merge ``a b`` per line)."""
    with open(vocab_file, encoding="utf-8") as f:
        vocab: dict[str, int] = json.load(f)
    with open(merge_file, encoding="utf-8") as f:
        lines = [ln for ln in f.read().split("\n") if ln and not ln.startswith("#version")]
    words = " ".join(lines).split(" ")
    if len(words) != 2 * len(lines):
        return None, "a merges line is not two tokens separated by one space"
    return fast_bpe(vocab, list(zip(words[0::2], words[1::2], strict=True)))


_PLAIN_ADDED = {"single_word": False, "lstrip": False, "rstrip": False}


def fast_bpe_from_tokenizer_json(path: str) -> tuple[FastBPE | None, str]:
    """:func:`fast_bpe` of a Hugging Face ``tokenizer.json`` holding a GPT-2-style byte-level BPE: a BPE model
    without dropout, unknown token or subword affixes, a ByteLevel pre-tokenizer (regex on, no prefix space), no
    normalizer, added tokens matched as plain strings."""
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or any(
        model.get(k)
        for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")
    ):
        return None, "the model is not a plain BPE"
    if spec.get("normalizer") or pre != {
        **pre,
        "type": "ByteLevel",
        "add_prefix_space": False,
        "use_regex": True,
    }:
        return None, "the pre-tokenizer is not GPT-2's byte-level one (or there is a normalizer)"
    added = spec.get("added_tokens") or []
    if any({k: a.get(k) for k in _PLAIN_ADDED} != _PLAIN_ADDED for a in added):
        return None, "an added token has matching rules (single_word / lstrip / rstrip)"
    merges = [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])
    ]
    if any(len(m) != 2 for m in merges):
        return None, "a merge is not a pair of tokens"
    return fast_bpe(model.get("vocab", {}), merges, {a["content"]: a["id"] for a in added})  # type: ignore[arg-type]


def probe_mismatch(
    fast: FastBPE, reference: Callable[[Sequence[str]], list[list[int]]]
) -> str | None:
    """None when ``fast`` encodes every probe text like ``reference``; else the first text that differs."""
    for text, want in zip(PROBE_TEXTS, reference(PROBE_TEXTS), strict=True):
        got = fast.encode(text)
        if got != want:
            return f"{text[:30]!r}...: {got[:6]}... instead of {want[:6]}..."
    return None
