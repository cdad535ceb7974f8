"""Tokenizer files for tests: a swapped GPT-2 vocabulary, and local stand-ins for today's open-model tokenizers.

:func:`family_tokenizer` writes a ``tokenizer.json`` shaped like Llama 3's or Qwen2.5's, built offline: a byte-level
BPE trained on the stdlib's pydoc topics (the demo corpus's no-download source) with the family's pre-tokenizer
regex (and Qwen's NFC normalizer), laid out at the family's exact size and with its added tokens:

    kind     regular ids          added tokens (ids)                                    bos / eos        adds BOS
    llama3   0..127,999           256 specials, <|begin_of_text|> .. (128,000..128,255)  begin / end_of_text  yes
    qwen2    0..151,642           22, <|endoftext|> <|im_start|> ..  (151,643..151,664)  none / endoftext     no

The 256 bytes take ids 0..255; the trained merges are spread in rank order over the rest of the regular range (so
ordinary text gets ids above 65,535), and the ids between them are filler tokens (a letter then digits, e.g.
``x1234``) that no pre-token can equal, standing in for the merges a real 128k vocabulary learned from far more
text. Both families' ``tokenizer_config.json`` and ``special_tokens_map.json`` are written as the real ones spell
them (Llama 3: ``add_bos_token`` true and a template post-processor adding ``<|begin_of_text|>``; Qwen: no BOS).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Llama 3's pre-tokenizer split (digits in groups of 1-3)."""

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2's pre-tokenizer split (single digits)."""

_LLAMA3_NAMED = {
    0: "<|begin_of_text|>",
    1: "<|end_of_text|>",
    4: "<|finetune_right_pad_id|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    8: "<|eom_id|>",
    9: "<|eot_id|>",
    10: "<|python_tag|>",
}
QWEN2_ADDED = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
"""Qwen2.5's added tokens in id order from 151,643 (``<tool_call>`` and ``</tool_call>`` are not special)."""

FAMILIES = ("llama3", "qwen2")
FAMILY_SIZES = {"llama3": (128_000, 128_256), "qwen2": (151_643, 151_665)}
"""kind -> (regular vocabulary size, total with the added tokens)."""


def llama3_specials() -> list[str]:
    """Llama 3.1's 256 special tokens in id order (128,000 + i), reserved ones numbered as Meta numbers them."""
    out, reserved = [], 0
    for i in range(256):
        if i in _LLAMA3_NAMED:
            out.append(_LLAMA3_NAMED[i])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return out


def _pydoc_topics() -> list[str]:
    """The demo corpus's no-download source (``megatron.data.demo_corpus.pydoc_topics``; testing may not import
    data): the stdlib's pydoc topics by name."""
    from pydoc_data.topics import topics

    return [t.strip() for _, t in sorted(topics.items()) if len(t.strip()) >= 20]


def _train(texts: Iterable[str], pattern: str, nfc: bool, merges: int) -> dict[str, Any]:
    """A byte-level BPE with the family's split and normaliser, trained on ``texts``: its JSON."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=256 + merges,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return json.loads(tok.to_str())


def _layout(trained: dict[str, Any], regular: int) -> tuple[dict[str, int], list[list[str]]]:
    """The vocabulary at the family's regular size: bytes at 0..255, merges spread in rank order, fillers."""
    from tokenizers import pre_tokenizers

    model = trained["model"]
    merges = [m.split(" ") if isinstance(m, str) else list(m) for m in model["merges"]]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {char: i for i, char in enumerate(alphabet)}
    span = regular - 256
    for k, (a, b) in enumerate(merges):
        vocab[a + b] = 256 + (k * span) // len(merges)
    taken = set(vocab.values())
    free = (i for i in range(256, regular) if i not in taken)
    for i in (
        free
    ):  # a letter then digits: every split regex puts letters and digits in separate pre-tokens
        vocab[f"x{i}"] = i
    return vocab, merges


def _added(kind: str, regular: int) -> list[dict[str, Any]]:
    names = llama3_specials() if kind == "llama3" else list(QWEN2_ADDED)
    return [
        {
            "id": regular + i,
            "content": name,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": not name.endswith("tool_call>"),
        }
        for i, name in enumerate(names)
    ]


def _post_processor(kind: str) -> dict[str, Any]:
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": kind == "llama3",
        "trim_offsets": False,
        "use_regex": True,
    }
    if kind != "llama3":
        return byte_level
    bos = "<|begin_of_text|>"
    template = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [128_000], "tokens": [bos]}},
    }
    return {"type": "Sequence", "processors": [byte_level, template]}


def _configs(kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer_config.json, special_tokens_map.json) as the family's base models ship them."""
    if kind == "llama3":
        bos, eos, pad = "<|begin_of_text|>", "<|end_of_text|>", None
    else:
        bos, eos, pad = None, "<|endoftext|>", "<|endoftext|>"
    config = {
        "add_bos_token": kind == "llama3",
        "add_eos_token": False,
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast" if kind == "llama3" else "Qwen2Tokenizer",
    }
    if kind == "qwen2":
        config["errors"] = "replace"
        config["add_prefix_space"] = False
    special = {k: v for k, v in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad)) if v}
    return config, special


def family_tokenizer(
    kind: Literal["llama3", "qwen2"],
    folder: str | Path,
    *,
    texts: Iterable[str] | None = None,
    merges: int = 4000,
) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` of a ``kind`` tokenizer
    (see the module docstring) into ``folder``; returns the folder. Deterministic for the same texts.

    Args:
        kind: ``llama3`` (128,256 ids) or ``qwen2`` (151,665 ids).
        texts: training texts; default the pydoc topics.
        merges: how many merges to train (at most; a small corpus may give fewer).
    """
    if kind not in FAMILIES:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(FAMILIES)}.")
    regular, _total = FAMILY_SIZES[kind]
    pattern = LLAMA3_PATTERN if kind == "llama3" else QWEN2_PATTERN
    trained = _train(
        texts if texts is not None else _pydoc_topics(), pattern, kind == "qwen2", merges
    )
    vocab, merge_list = _layout(trained, regular)
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added(kind, regular),
        "normalizer": {"type": "NFC"} if kind == "qwen2" else None,
        "pre_tokenizer": trained["pre_tokenizer"],
        "post_processor": _post_processor(kind),
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None if kind == "llama3" else "",
            "end_of_word_suffix": None if kind == "llama3" else "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": kind == "llama3",
            "vocab": vocab,
            "merges": merge_list,
        },
    }
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    config, special = _configs(kind)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2), encoding="utf-8")
    return out


def swapped_vocab(vocab_file: str | Path, out_file: str | Path, a: str = "a", b: str = "o") -> str:
    """Write a copy of a GPT-2 ``vocab.json`` with the ids of tokens ``a`` and ``b`` swapped; returns its path.

    The result is a tokenizer of the same type and size that encodes text into other ids.
    """
    vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    Path(out_file).write_text(json.dumps(vocab), encoding="utf-8")
    return str(out_file)
