"""Train tokenizers offline and write the files our tokenizers load.

* :func:`train_bpe`: byte-level BPE with Hugging Face ``tokenizers`` (GPT-2's scheme). Writes ``vocab.json`` +
  ``merges.txt`` (``GPT2BPETokenizer``), and ``tokenizer.json`` + ``tokenizer_config.json`` (``HFTokenizer``).
  ``<|endoftext|>`` is id 0 and serves as EOD (and, as in GPT-2, as BOS).
* :func:`train_sentencepiece`: a SentencePiece BPE or unigram ``tokenizer.model`` (``SentencePieceTokenizer``,
  ``GPTSentencePieceTokenizer``) with LLaMA-like settings: byte fallback, split digits, identity normalisation,
  whitespace kept, ids unk=0 bos=1 eos=2.

Both are deterministic: the same texts and settings give byte-identical files.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Iterator

from megatron.tokenizer.tokenizer import GPT2_EOD_TOKEN

# SentencePiece silently drops training sentences longer than max_sentence_length; we cut lines to fit.
_SP_MAX_SENTENCE = 16384


def _check(vocab_size: int, output_dir: str, minimum: int) -> None:
    if vocab_size < minimum:
        raise ValueError(
            f"--vocab-size ({vocab_size}) is too small; it must be at least {minimum}."
        )
    if not os.path.isdir(output_dir):
        raise FileNotFoundError(f"--output-dir {output_dir} does not exist; create it first.")


def _write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def train_bpe(
    texts: Iterable[str], *, vocab_size: int, output_dir: str, min_frequency: int = 2
) -> dict[str, str]:
    """Train a byte-level BPE on ``texts``; returns ``{"vocab_file", "merge_file", "tokenizer_json"}`` paths.

    Raises:
        ValueError: ``vocab_size`` below 257 (256 bytes + ``<|endoftext|>``).
        FileNotFoundError: ``output_dir`` is missing.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    _check(vocab_size, output_dir, 257)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[GPT2_EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    vocab_file, merge_file = tok.model.save(output_dir)
    paths = {
        "vocab_file": os.path.join(output_dir, "vocab.json"),
        "merge_file": os.path.join(output_dir, "merges.txt"),
        "tokenizer_json": os.path.join(output_dir, "tokenizer.json"),
    }
    os.replace(vocab_file, paths["vocab_file"])
    os.replace(merge_file, paths["merge_file"])
    _write_text(paths["tokenizer_json"], tok.to_str(pretty=True))
    config = {"bos_token": GPT2_EOD_TOKEN, "eos_token": GPT2_EOD_TOKEN, "unk_token": GPT2_EOD_TOKEN}
    _write_text(
        os.path.join(output_dir, "tokenizer_config.json"), json.dumps(config, indent=2) + "\n"
    )
    return paths


def _sentences(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        for line in text.splitlines():
            while len(line) > _SP_MAX_SENTENCE:
                yield line[:_SP_MAX_SENTENCE]
                line = line[_SP_MAX_SENTENCE:]
            if line.strip():
                yield line


def train_sentencepiece(
    texts: Iterable[str],
    *,
    vocab_size: int,
    output_dir: str,
    model_type: str = "bpe",
    character_coverage: float = 0.9995,
) -> dict[str, str]:
    """Train a SentencePiece model on ``texts`` (split into lines); returns ``{"tokenizer_model": path}``.

    Raises:
        ValueError: ``vocab_size`` below 260 (256 byte pieces + unk/bos/eos + 1), or SentencePiece rejects the
            settings for this corpus (its message is included).
        FileNotFoundError: ``output_dir`` is missing.
    """
    import sentencepiece as spm

    _check(vocab_size, output_dir, 260)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sentences(texts),
            model_writer=model,
            model_type=model_type,
            vocab_size=vocab_size,
            character_coverage=character_coverage,
            byte_fallback=True,
            split_digits=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            max_sentence_length=_SP_MAX_SENTENCE * 4,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            num_threads=1,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise ValueError(f"SentencePiece training failed: {e}") from e
    path = os.path.join(output_dir, "tokenizer.model")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(model.getvalue())
    os.replace(tmp, path)
    return {"tokenizer_model": path}
