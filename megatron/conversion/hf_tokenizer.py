"""Tokenizer files for an exported Hugging Face directory, from the tokenizer a checkpoint was trained with.

Training records its tokenizer flags in ``trident_meta.json`` (``"tokenizer"``: ``--tokenizer-type``,
``--vocab-file``, ``--merge-file``, ``--tokenizer-model`` as absolute paths). The export writes files that
``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads offline and that encode like the training tokenizer:

================================  ======================================================================
GPT2BPETokenizer                  ``vocab.json`` + ``merges.txt`` (``GPT2Tokenizer``)
GPTSentencePieceTokenizer         ``tokenizer.json`` converted from ``tokenizer.model`` (+ the ``.model``): the
                                  legacy SentencePiece rule (``▁`` before the text, every space -> ``▁``; no
                                  pre-tokenizer, no BOS/EOS added), which encodes leading spaces like sentencepiece
HFTokenizer                       its ``tokenizer.json`` (+ ``tokenizer_config.json``/``special_tokens_map.json``)
SentencePieceTokenizer            not exported: its appended ``<CLS>``/``<EOD>``... ids have no HF equivalent
NullTokenizer                     nothing to export
================================  ======================================================================

After writing, the files are loaded back with transformers and must give the training tokenizer's ids on
:data:`CHECK_TEXTS`; otherwise the export is refused (``ValueError``). Special-token strings inside text (``<s>``,
``</s>``, ``<|endoftext|>``) are split out by transformers but not by Megatron's tokenizers, so they are not checked.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from megatron.tokenizer import encoding_fingerprint
from megatron.tokenizer.info import recorded_file, tokenizer_from_info, tokenizer_info

SAMPLE_TEXT = (
    "In the beginning was the Word.\n\tTrident trains 3D-parallel models: 1,234 steps at 5.6e-4, "
    "naïve café déjà vu — 東京 🙂  two  spaces, CamelCase_and_snake_case."
)
"""Text both tokenizers must encode identically (no special-token strings: the GPT-2 BPE of Megatron treats
``<|endoftext|>`` inside text as plain characters, transformers as the special token)."""

CHECK_TEXTS = (SAMPLE_TEXT, " leading space", "  two leading spaces", "tab\tnew\nline ", "x", "")
"""Every one must encode identically (leading spaces are where SentencePiece conversions usually differ)."""

_SP_CONVERT = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False}
_GPT2_EOD = "<|endoftext|>"
_EXPORTABLE = ("GPT2BPETokenizer", "GPTSentencePieceTokenizer", "HFTokenizer")
_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def hf_dir_tokenizer(hf_dir: str | Path) -> dict[str, str] | None:
    """The tokenizer of an HF model directory as a ``tokenizer_info`` entry, None when it has none.

    ``tokenizer.json`` (what ``AutoTokenizer`` prefers too) -> ``HFTokenizer``; otherwise ``vocab.json`` +
    ``merges.txt`` (a GPT-2 BPE, e.g. our own GPT2BPETokenizer export) -> ``GPT2BPETokenizer`` with those files.
    """
    d = Path(hf_dir)
    if (d / "tokenizer.json").is_file():
        return tokenizer_info(tokenizer_type="HFTokenizer", tokenizer_model=str(d))
    if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        return tokenizer_info(
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=str(d / "vocab.json"),
            merge_file=str(d / "merges.txt"),
        )
    return None


def special_token_ids(info: dict[str, str] | None) -> tuple[int | None, int | None]:
    """``(bos, eos)`` ids of the tokenizer of ``info`` (eos = Megatron's EOD), ``(None, None)`` without one."""
    if not info or info.get("tokenizer_type") not in _EXPORTABLE:
        return None, None
    tok = tokenizer_from_info(info)
    return tok.bos, tok.eod


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_sentencepiece(model_file: Path, out: Path) -> None:
    """``tokenizer.json`` (+ config) for a SentencePiece model: transformers' Llama conversion of the pieces and
    merges, with the legacy normalizer (``▁`` prepended, spaces -> ``▁``) and no pre-tokenizer."""
    import sentencepiece
    from tokenizers import normalizers
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(model_file, Path(tmp) / "tokenizer.model")
        _write_json(Path(tmp) / "tokenizer_config.json", _SP_CONVERT)
        backend = AutoTokenizer.from_pretrained(tmp, local_files_only=True).backend_tokenizer
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.pre_tokenizer = None
    backend.save(str(out / "tokenizer.json"))
    shutil.copyfile(model_file, out / "tokenizer.model")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    specials = {
        key: sp.id_to_piece(i)
        for key, i in (
            ("bos_token", sp.bos_id()),
            ("eos_token", sp.eos_id()),
            ("unk_token", sp.unk_id()),
        )
        if i >= 0
    }
    _write_json(
        out / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", **specials}
    )


def _write_files(info: dict[str, str], out: Path) -> str:
    kind = info.get("tokenizer_type")
    if kind == "GPT2BPETokenizer":
        shutil.copyfile(recorded_file(info, "vocab_file"), out / "vocab.json")
        shutil.copyfile(recorded_file(info, "merge_file"), out / "merges.txt")
        specials = dict.fromkeys(("bos_token", "eos_token", "unk_token"), _GPT2_EOD)
        _write_json(out / "tokenizer_config.json", {"tokenizer_class": "GPT2Tokenizer", **specials})
        return "vocab.json, merges.txt"
    if kind == "GPTSentencePieceTokenizer":
        _write_sentencepiece(recorded_file(info, "tokenizer_model"), out)
        return "tokenizer.json, tokenizer.model"
    if kind == "HFTokenizer":
        src = recorded_file(info, "tokenizer_model")
        directory = src if src.is_dir() else src.parent
        json_file = src / "tokenizer.json" if src.is_dir() else src
        if not json_file.is_file():
            raise FileNotFoundError(f"--tokenizer-model {src} holds no tokenizer.json to export.")
        shutil.copyfile(json_file, out / "tokenizer.json")
        for name in _HF_FILES[1:]:
            if (directory / name).is_file():
                shutil.copyfile(directory / name, out / name)
        if not (out / "tokenizer_config.json").is_file():
            _write_json(
                out / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"}
            )
        return "tokenizer.json"
    raise ValueError(f"tokenizer type {kind!r} cannot be exported.")


def export_tokenizer(
    info: dict[str, str] | None,
    out_dir: str | Path,
    model_vocab: int | None = None,
    trained_fingerprint: str | None = None,
) -> str:
    """Write the tokenizer files of ``info`` into ``out_dir`` and check that transformers encodes like training.

    Args:
        info: the ``"tokenizer"`` entry of the meta (``megatron.tokenizer.info.tokenizer_info``), or None.
        out_dir: the HF directory being written.
        model_vocab: the model's true vocabulary; the tokenizer must have exactly this many tokens.
        trained_fingerprint: the training tokenizer's ``encoding_fingerprint`` recorded in the checkpoint; the
            tokenizer of ``info`` must still have it (files edited or replaced since training are refused).

    Returns:
        One line saying what was written (or why nothing was).

    Raises:
        FileNotFoundError: a recorded tokenizer file is gone (the message names the flag to pass).
        ValueError: the tokenizer's vocabulary differs from the model's, it no longer encodes like the training
            tokenizer (``trained_fingerprint``), or the written tokenizer encodes :data:`CHECK_TEXTS` differently
            from it.
    """
    if not info or not info.get("tokenizer_type"):
        return "tokenizer: none recorded in the checkpoint (pass --tokenizer-type and its files to add one)"
    out = Path(out_dir)
    kind = info["tokenizer_type"]
    if kind not in _EXPORTABLE:
        return f"tokenizer: {kind} has no Hugging Face equivalent; no tokenizer files written"
    ours = tokenizer_from_info(info)
    if model_vocab is not None and ours.vocab_size != model_vocab:
        raise ValueError(
            f"the {kind} tokenizer has {ours.vocab_size} tokens but the model was trained with "
            f"{model_vocab}; pass the training tokenizer's flags, or --no-tokenizer."
        )
    if trained_fingerprint and encoding_fingerprint(ours) != trained_fingerprint:
        files = ", ".join(
            f"{k} {info[k]}" for k in ("vocab_file", "merge_file", "tokenizer_model") if k in info
        )
        raise ValueError(
            f"the {kind} tokenizer ({files}) encodes text into other ids than the tokenizer the model was "
            "trained with (its files changed since training, or these are another tokenizer's); pass the "
            "training tokenizer's files (--tokenizer-type/--vocab-file/--merge-file/--tokenizer-model), or "
            "--no-tokenizer."
        )
    written = _write_files(info, out)
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    for text in CHECK_TEXTS:
        expected = ours.tokenize(text)
        got = theirs.encode(text, add_special_tokens=False)
        if got != expected:
            raise ValueError(
                f"the exported {kind} files encode {text[:40]!r} as {got[:8]}... but the training tokenizer "
                f"gives {expected[:8]}... ({len(got)} vs {len(expected)} ids): this tokenizer has no exact "
                "transformers equivalent (e.g. a SentencePiece model with a normalization rule or a unigram "
                "model); pass --no-tokenizer to export the weights alone."
            )
    return f"tokenizer: {kind} -> {written} (encodes like the training tokenizer)"
