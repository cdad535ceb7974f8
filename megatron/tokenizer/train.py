"""Train tokenizers offline and write the files our tokenizers load.

* :func:`train_bpe`: byte-level BPE with Hugging Face ``tokenizers`` (GPT-2's scheme). Writes ``vocab.json`` +
  ``merges.txt`` (``GPT2BPETokenizer``), and ``tokenizer.json`` + ``tokenizer_config.json`` (``HFTokenizer``).
  ``<|endoftext|>`` is id 0 and serves as EOD (and, as in GPT-2, as BOS).
* :func:`train_sentencepiece`: a SentencePiece BPE or unigram ``tokenizer.model`` (``SentencePieceTokenizer``,
  ``GPTSentencePieceTokenizer``) with LLaMA-like settings: byte fallback, split digits, identity normalisation,
  whitespace kept, ids unk=0 bos=1 eos=2.

Both are deterministic: the same texts and settings give byte-identical files. :func:`train_to_dir` (behind
``tools/train_tokenizer.py``) wraps them for the CLI: it refuses to replace an existing tokenizer unless asked
(checkpoints record tokenizer paths), refuses an input without text, and writes all files or none.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator

from megatron.tokenizer.tokenizer import GPT2_EOD_TOKEN

# SentencePiece silently drops training sentences longer than max_sentence_length; we cut lines to fit.
_SP_MAX_SENTENCE = 16384

TOKENIZER_FILES = (
    "vocab.json",
    "merges.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
)
"""Every file :func:`train_bpe` and :func:`train_sentencepiece` write."""

MIN_VOCAB = {"bpe": 257, "sentencepiece": 260}


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


class _CountTexts:
    """Passes texts through, counting those that are not blank."""

    def __init__(self, texts: Iterable[str]) -> None:
        self._texts = texts
        self.nonblank = 0

    def __iter__(self) -> Iterator[str]:
        for text in self._texts:
            if text.strip():
                self.nonblank += 1
            yield text


def _make_dirs(path: str) -> list[str]:
    """``os.makedirs(path)``; returns the directories it created, deepest first (to undo on failure)."""
    created = []
    head = os.path.abspath(path)
    while not os.path.exists(head):
        created.append(head)
        head = os.path.dirname(head)
    os.makedirs(path, exist_ok=True)
    return created


def _check_output_dir(output_dir: str, overwrite: bool) -> None:
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(
            f"--output-dir {output_dir} is a file, not a directory; give a directory (it is created if missing)."
        )
    existing = [n for n in TOKENIZER_FILES if os.path.exists(os.path.join(output_dir, n))]
    if existing and not overwrite:
        raise ValueError(
            f"--output-dir {output_dir} already holds a tokenizer ({', '.join(existing)}); checkpoints trained with "
            "it record these paths, so replacing them would change their tokenizer. Choose a new directory, or "
            "pass --overwrite to replace them."
        )


def train_to_dir(
    texts: Iterable[str],
    *,
    kind: str,
    vocab_size: int,
    output_dir: str,
    overwrite: bool = False,
    source: str = "the input",
    min_frequency: int = 2,
    model_type: str = "bpe",
) -> dict[str, str]:
    """Train a ``kind`` (``bpe`` or ``sentencepiece``) tokenizer on ``texts`` into ``output_dir``, all or nothing.

    ``output_dir`` (and missing parents) is created. The files are written to a staging directory inside it and
    moved into place only when training succeeds; on any failure the staging directory, and the directories this
    call created, are removed.

    Args:
        source: how messages name where ``texts`` came from (e.g. ``--input data/*.jsonl``).

    Returns:
        The paths of :func:`train_bpe` / :func:`train_sentencepiece`, under ``output_dir``.

    Raises:
        ValueError: unknown ``kind``, ``vocab_size`` too small, ``output_dir`` is a file, ``output_dir`` already
            holds tokenizer files and ``overwrite`` is off, ``texts`` has no non-blank text, or training fails.
    """
    if kind not in MIN_VOCAB:
        raise ValueError(f"--type {kind} is not supported; choose one of {', '.join(MIN_VOCAB)}.")
    if vocab_size < MIN_VOCAB[kind]:
        raise ValueError(
            f"--vocab-size ({vocab_size}) is too small; it must be at least {MIN_VOCAB[kind]}."
        )
    _check_output_dir(output_dir, overwrite)
    created = _make_dirs(output_dir)
    counted = _CountTexts(texts)
    no_text = ValueError(
        f"{source} has no text to train on (no non-blank string); a tokenizer trained on nothing would hold "
        "only the byte alphabet. Check the input files and --json-keys."
    )
    stage = ""
    try:
        stage = tempfile.mkdtemp(prefix=".train_tokenizer.", dir=output_dir)
        try:
            if kind == "bpe":
                staged = train_bpe(
                    counted, vocab_size=vocab_size, output_dir=stage, min_frequency=min_frequency
                )
            else:
                staged = train_sentencepiece(
                    counted, vocab_size=vocab_size, output_dir=stage, model_type=model_type
                )
        except ValueError:
            if counted.nonblank == 0:
                raise no_text from None
            raise
        if counted.nonblank == 0:
            raise no_text
        for name in sorted(os.listdir(stage)):
            os.replace(os.path.join(stage, name), os.path.join(output_dir, name))
        os.rmdir(stage)
    except BaseException:
        if stage:
            shutil.rmtree(stage, ignore_errors=True)
        for d in created:  # deepest first; stop at the first that is not empty
            try:
                os.rmdir(d)
            except OSError:
                break
        raise
    return {name: os.path.join(output_dir, os.path.basename(p)) for name, p in staged.items()}
