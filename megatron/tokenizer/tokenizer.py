"""Megatron's tokenizers, offline: GPT-2 BPE, SentencePiece (two flavours), local Hugging Face files, and Null.

Every tokenizer shares one interface (:class:`MegatronTokenizer`): ``tokenize(text) -> list[int]``,
``tokenize_batch(texts)`` (the library's batch encoder, used by preprocessing), ``detokenize(ids)``, and the ids
``vocab_size``, ``eod``, ``bos``, ``pad`` (``None`` where the vocabulary has no such token). No special tokens are
added by ``tokenize``: preprocessing appends ``eod`` itself (``--append-eod``), and puts ``prefix_ids`` /
``suffix_ids`` around every document: the ids the tokenizer's own configuration adds (an ``HFTokenizer``'s
``add_bos_token`` or post-processor: Llama 3's ``<|begin_of_text|>``; none for the others).

Differences from Megatron, on purpose:

* ``GPT2BPETokenizer`` uses the Rust byte-level BPE of Hugging Face ``tokenizers`` built from the same vocab.json
  and merges.txt; ids equal the original regex-based Python encoder's (GPT-2 byte-level BPE), about 3x faster.
* ``HFTokenizer`` reads only local files (a directory or a ``tokenizer.json``; never the hub), reports ``bos`` as
  the real BOS token (Megatron returns EOS), counts added tokens in ``vocab_size`` (Megatron's excludes them, so
  an added token's id could fall outside the embedding), and turns off any padding/truncation stored in the file.

Padding of the vocabulary for tensor parallelism is a separate function, :func:`vocab_size_with_padding`.
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from megatron.config.rules import padded_vocab_size
from megatron.tokenizer.fast_bpe import (
    FastBPE,
    build_fast_bpe,
    fast_bpe_from_spec,
    probe_mismatch,
)
from megatron.tokenizer.hf_config import (
    SPECIAL_KEYS,
    WELL_KNOWN,
    TokenizerConfig,
    TokenizerFileError,
    TokenizerFileMissing,
    added_ids,
    load_json,
    read_tokenizer_config,
    special_ids,
)

if TYPE_CHECKING:
    from megatron.config.data import DataConfig

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HFTokenizer",
    "NullTokenizer",
)
GPT2_EOD_TOKEN = "<|endoftext|>"


vocab_size_with_padding = padded_vocab_size
"""Megatron's name for :func:`megatron.config.rules.padded_vocab_size` (the one implementation)."""


class MegatronTokenizer(ABC):
    """The interface every tokenizer implements (see the module docstring)."""

    name: str = "MegatronTokenizer"

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can emit (before padding), so every id is < vocab_size."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens added."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document id appended between documents."""

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[tokenize(t) for t in texts]``, through the library's batch encoder where it has one."""
        return [self.tokenize(t) for t in texts]

    def tokenize_prompt(self, text: str) -> list[int]:
        """Ids a generation prompt starts from: ``prefix_ids`` exactly once (not again when the text already starts
        with them, e.g. a literal ``<|begin_of_text|>``), then the text's ids; ``[eod]`` for an empty prompt of a
        tokenizer without a prefix."""
        ids = self.tokenize(text) if text else []
        prefix = list(self.prefix_ids)
        if prefix and ids[: len(prefix)] != prefix:
            ids = prefix + ids
        return ids or [self.eod]

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def bos(self) -> int | None:
        """Beginning-of-sequence id, or None when the vocabulary has none."""
        return None

    @property
    def pad(self) -> int | None:
        """Padding id, or None when the vocabulary has none."""
        return None

    prefix_ids: tuple[int, ...] = ()
    """Ids the tokenizer's own configuration puts before every text (Llama 3's ``<|begin_of_text|>``); preprocessing
    starts each document with them and a generation prompt starts with them exactly once."""
    suffix_ids: tuple[int, ...] = ()
    """Ids its configuration puts after every text (``add_eos_token``); preprocessing ends each document with them."""

    @property
    def vocab(self) -> dict[str, int]:
        raise NotImplementedError(f"{self.name} has no string vocabulary.")

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.vocab.items()}


def _require_file(path: str | None, flag: str, tokenizer_type: str) -> str:
    if not path:
        raise TokenizerFileError(f"--tokenizer-type {tokenizer_type} needs {flag}.")
    if not os.path.exists(path):
        raise TokenizerFileMissing(
            f"{flag} {path} does not exist (--tokenizer-type {tokenizer_type})."
        )
    return path


class _HFBackedTokenizer(MegatronTokenizer):
    """Shared encode/decode over a ``tokenizers.Tokenizer`` (Rust; batch encoding without offsets).

    A byte-level BPE encodes through tiktoken instead when it gives exactly the ids of the ``tokenizers`` encoder
    (the reference), checked on fixed probe texts (``fast_bpe.py``); ``encoder`` says which one runs and why.
    """

    def __init__(self, backend: Any) -> None:
        backend.no_padding()
        backend.no_truncation()
        self._tok = backend
        self._fast = hasattr(backend, "encode_batch_fast")
        self._tiktoken: FastBPE | None = None
        self.encoder = "tokenizers"
        """Which encoder tokenizes, and why the fast one is not used when it is not."""

    def _try_tiktoken(self, built: tuple[FastBPE | None, str]) -> None:
        """Encode through ``built``'s fast encoder if it agrees with the reference on every probe text."""
        candidate, why = built
        if candidate is not None:
            mismatch = probe_mismatch(candidate, self._reference_batch)
            if mismatch is None:
                self._tiktoken = candidate
            else:
                why = f"it encodes a probe text otherwise ({mismatch})"
        self.encoder = (
            "tiktoken (verified on the probe texts)"
            if self._tiktoken is not None
            else f"tokenizers (the reference; tiktoken not used: {why})"
        )

    def tokenize(self, text: str) -> list[int]:
        if self._tiktoken is not None:
            return self._tiktoken.encode(text)
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text`` (no special tokens added) from the reference encoder, and each token's character span
        ``[start, end)`` in ``text`` (a character split over several tokens is in each of their spans)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._tiktoken is not None:
            return self._tiktoken.encode_batch(texts)
        return self._reference_batch(texts)

    def _reference_batch(self, texts: Sequence[str]) -> list[list[int]]:
        texts = list(texts)
        if self._fast:
            encodings = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        else:
            encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)


class GPT2BPETokenizer(_HFBackedTokenizer):
    """GPT-2 byte-level BPE from ``--vocab-file`` (vocab.json) and ``--merge-file`` (merges.txt).

    Encodes with tiktoken's BPE over the same files when it gives the same ids as the reference (Hugging Face
    ``tokenizers``), checked at construction on fixed probe texts (``fast_bpe.py``); ``encoder`` says which one
    is in use and why. ``fast=False`` keeps the reference.

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: the files do not parse, or the vocabulary lacks ``<|endoftext|>``.
    """

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str, *, fast: bool = True) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # the Rust error names neither the flag nor the file
            raise TokenizerFileError(
                f"cannot load GPT-2 BPE from --vocab-file {vocab_file} and --merge-file {merge_file}: {e}"
            ) from e
        backend = Tokenizer(model)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        super().__init__(backend)
        eod = backend.token_to_id(GPT2_EOD_TOKEN)
        if eod is None:
            raise TokenizerFileError(
                f"--vocab-file {vocab_file} has no {GPT2_EOD_TOKEN!r} token, which GPT-2 uses as EOD."
            )
        self._eod = eod
        self._try_tiktoken(build_fast_bpe(vocab_file, merge_file) if fast else (None, "fast=False"))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int | None:
        return self._eod  # GPT-2's bos_token is <|endoftext|> as well


_MODEL_TYPES = ("BPE", "Unigram", "WordLevel", "WordPiece")


def _load_spec(json_path: str) -> dict[str, Any]:
    """The parsed tokenizer.json, checked to hold a model type the tokenizers library has."""
    spec = load_json(json_path, "tokenizer.json")
    model = spec.get("model")
    kind = model.get("type") if isinstance(model, dict) else None
    if kind not in _MODEL_TYPES:
        found = f"model type {kind!r}" if kind else "no model"
        raise TokenizerFileError(
            f"{json_path}: {found}; a tokenizer.json needs a model of type {', '.join(_MODEL_TYPES)} "
            "(pass the tokenizer.json that transformers' save_pretrained writes)."
        )
    return spec


def _from_file(json_path: str) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(json_path)
    except Exception as e:  # the Rust error names no file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TokenizerFileError(
            f"{json_path}: the tokenizers library cannot load it ({reason}); pass a tokenizer.json written by "
            "tokenizers or transformers."
        ) from None


class HFTokenizer(_HFBackedTokenizer):
    """A Hugging Face fast tokenizer from local files (``--tokenizer-model`` = directory or tokenizer.json).

    Special tokens and the ids put around a text (``prefix_ids``, ``suffix_ids``: Llama 3's
    ``<|begin_of_text|>``) follow the tokenizer's own files as transformers reads them (``hf_config.py``).

    Raises:
        TokenizerFileError: the path does not exist (the hub is never contacted; also a FileNotFoundError), a file
            is not JSON, or the model type is unknown.
        ValueError: the directory holds no loadable tokenizer.
    """

    name = "HFTokenizer"

    def __init__(self, path: str, *, fast: bool = True) -> None:
        if not os.path.exists(path):
            raise TokenizerFileMissing(
                f"--tokenizer-model {path} does not exist. HFTokenizer loads local files only (no model hub): "
                "pass a directory holding tokenizer.json, or the tokenizer.json itself."
            )
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        json_path = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        config = read_tokenizer_config(directory)
        if os.path.isfile(json_path):
            spec = _load_spec(json_path)
            backend = _from_file(json_path)
        else:
            backend = self._from_transformers(path, config)
            spec = json.loads(backend.to_str())
        super().__init__(backend)
        self._try_tiktoken(fast_bpe_from_spec(spec) if fast else (None, "fast=False"))
        self._path = path
        ids = special_ids(config, self._id)
        self._eos, self._bos, self._pad = ids["eos_token"], ids["bos_token"], ids["pad_token"]
        before, after = added_ids(config, spec, ids)
        self.prefix_ids, self.suffix_ids = tuple(before), tuple(after)

    @staticmethod
    def _from_transformers(path: str, config: TokenizerConfig) -> Any:
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:
            raise TokenizerFileError(
                f"--tokenizer-model {path}: no tokenizer.json and transformers could not load it: {e}"
            ) from e
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise TokenizerFileError(
                f"--tokenizer-model {path} is a slow (Python) tokenizer; save it as tokenizer.json first."
            )
        for key in SPECIAL_KEYS:
            if getattr(hf, key, None) and key not in config.tokens:
                config.tokens[key] = str(getattr(hf, key))
        return backend

    @property
    def vocab_size(self) -> int:
        return max(self._tok.get_vocab(with_added_tokens=True).values()) + 1

    @property
    def eod(self) -> int:
        if self._eos is None:
            raise ValueError(
                f"the HF tokenizer at {self._path} has no EOS token (none configured and none of "
                f"{', '.join(WELL_KNOWN['eos_token'])} in its vocabulary); set eos_token in its "
                "tokenizer_config.json or drop --append-eod."
            )
        return self._eos

    @property
    def bos(self) -> int | None:
        return self._bos

    @property
    def pad(self) -> int | None:
        return self._pad


class NullTokenizer(MegatronTokenizer):
    """Text is space-separated integer ids; ``eod = vocab_size_arg``, so ``vocab_size = --vocab-size + 1``."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or vocab_size < 1:
            raise ValueError(
                f"--tokenizer-type NullTokenizer needs --vocab-size >= 1; got {vocab_size}."
            )
        self._v = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError as e:
            raise ValueError(f"NullTokenizer input must be space-separated integers: {e}") from e
        for i in ids:
            if not 0 <= i <= self._v:
                raise ValueError(
                    f"NullTokenizer id {i} is outside [0, {self._v}] (--vocab-size {self._v})."
                )
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab_size(self) -> int:
        return self._v + 1

    @property
    def eod(self) -> int:
        return self._v


def build_tokenizer(
    config: DataConfig | None = None,
    *,
    tokenizer_type: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
) -> MegatronTokenizer:
    """Build the tokenizer named by ``--tokenizer-type`` from a ``DataConfig``; keywords override its fields.

    Pad the vocabulary with :func:`vocab_size_with_padding`, e.g.
    ``vocab_size_with_padding(tok.vocab_size, model_cfg.make_vocab_size_divisible_by, tp)``.

    Raises:
        ValueError: unknown type, or a flag the type needs is missing.
        FileNotFoundError: a named file is missing.
    """

    def pick(name: str, value: Any) -> Any:
        return value if value is not None else getattr(config, name, None)

    kind = pick("tokenizer_type", tokenizer_type)
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(
            _require_file(pick("vocab_file", vocab_file), "--vocab-file", kind),
            _require_file(pick("merge_file", merge_file), "--merge-file", kind),
        )
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        from megatron.tokenizer.sentencepiece_tokenizer import (
            GPTSentencePieceTokenizer,
            SentencePieceTokenizer,
        )

        model = _require_file(pick("tokenizer_model", tokenizer_model), "--tokenizer-model", kind)
        cls = (
            SentencePieceTokenizer
            if kind == "SentencePieceTokenizer"
            else GPTSentencePieceTokenizer
        )
        return cls(model)
    if kind == "HFTokenizer":
        model = pick("tokenizer_model", tokenizer_model)
        if not model:
            raise TokenizerFileError(
                "--tokenizer-type HFTokenizer needs --tokenizer-model (a local directory or tokenizer.json)."
            )
        return HFTokenizer(model)
    if kind == "NullTokenizer":
        return NullTokenizer(pick("vocab_size", vocab_size))
    if kind is None:
        raise ValueError(
            f"--tokenizer-type is required; choose one of {', '.join(TOKENIZER_TYPES)}."
        )
    raise ValueError(
        f"--tokenizer-type {kind} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}."
    )


FINGERPRINT_TEXTS = (
    "The quick brown fox jumps over the lazy dog. 0123456789 +-*/=<>()[]{}",
    "  Leading spaces,\ttabs\nand newlines;   runs   of   spaces.",
    "Ünïcödé: façade, straße, Ελληνικά, русский, 日本語, 한국어, العربية, 🙂🚀",
    "def f(x):\n    return x ** 2  # code, CamelCase and snake_case",
)
"""Fixed texts whose ids identify how a tokenizer encodes (see :func:`encoding_fingerprint`)."""


def encoding_fingerprint(tokenizer: MegatronTokenizer) -> str | None:
    """A short hash of the ids ``tokenizer`` gives :data:`FINGERPRINT_TEXTS` (plus its vocabulary size and EOD).

    Two tokenizers with the same fingerprint encode those texts identically; a checkpoint records its training
    tokenizer's fingerprint so a run that resumes it with other tokenizer files (same type and vocabulary size,
    but other ids) is caught. None for :class:`NullTokenizer` (its "text" is ids already).
    """
    if isinstance(tokenizer, NullTokenizer):
        return None
    ids = [tokenizer.tokenize(t) for t in FINGERPRINT_TEXTS]
    payload = json.dumps([tokenizer.vocab_size, tokenizer.eod, ids], separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]
