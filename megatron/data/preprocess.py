"""JSONL -> Megatron mmap datasets (the library behind ``tools/preprocess_data.py`` and ``tools/merge_datasets.py``).

Pipeline, streaming and order-preserving::

    input files (.jsonl / .jsonl.gz, globs)            main process: only cuts plain files into byte ranges
      -> chunks (<= 128 lines / 256 KB, whole lines)   (a .gz is decompressed in the main process: no seeking)
      -> workers: read the range, json.loads,          Encoder.encode: one tokenizer batch call per key and chunk
         validate, batch-encode
         -> per key: flat token array (dtype), sequence sizes, sequences per document
      -> main: MMapIndexedDatasetBuilder.add_documents (numpy tofile), in input order

Reading the inputs (globs, gzip, chunks, one line parsed) is :mod:`megatron.data.jsonl_input`.

At most ``2 * workers`` chunks are in flight (so memory stays flat however big the input),
and results are consumed in submission order, so the output is byte-identical for any worker count. The workers are
forked once the main process has built and checked its tokenizer (they inherit it: no start-up cost per worker, no
helper process; one worker is a forked process too, so a tokenizer that aborts out of memory kills the worker,
which is reported, not the run with its temporary files); every one is reaped before ``preprocess`` returns or raises, also on Ctrl-C (``fork_workers``:
no shared queue, so stopping a worker mid-write cannot hang the run, and a worker killed by the OS is one error).

Per document and key, as Megatron-LM: a string value is one sequence, a list of strings is one sequence per
non-empty string; sequences with no tokens are dropped; with ``append_eod`` the EOD is appended to the document's
last sequence and counted in its size (the fixed Megatron-LM layout). The ids the tokenizer's own configuration puts
around a text (``prefix_ids``: Llama 3's BOS; ``suffix_ids``: ``add_eos_token``) go before the document's first and
after its last sequence, counted the same way (no second EOD when the suffix already ends with it). A document with no tokens has no sequences
(its ``doc_idx`` entry repeats). Bad lines (invalid JSON/UTF-8, not an object, a missing key, a value that is not a
string or list of strings, text the tokenizer rejects, a line longer than ``max_line_bytes``: tokenizing takes about
40 times a line's size in memory) stop the run with ``file:line: reason``, or are skipped and
counted with ``skip_bad_lines``. An input with no documents, or a key with no tokens at all, is an error and
writes nothing (an empty dataset would only fail later, in training).
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron.data.fork_workers import WorkerDied, ordered_map
from megatron.data.indexed_builder import MMapIndexedDatasetBuilder, make_builder
from megatron.data.indexed_dataset import (
    MMapIndexedDataset,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
)
from megatron.data.jsonl_input import (
    CHUNK_LINES,
    ByteRange,
    Chunk,
    PreprocessError,
    parse_line,
    plan_chunks,
)
from megatron.tokenizer import build_tokenizer

logger = logging.getLogger(__name__)

MAX_LINE_BYTES = 16 * 2**20
"""Default ``--max-line-bytes``: a longer JSONL line is a bad line (tokenizing one takes about 40 times its size in
memory: a 50 MB line peaked at 1.9 GB with GPT-2 BPE)."""


@dataclass
class KeyResult:
    """One key's encoded chunk: flat tokens, sequence sizes, and sequences per accepted document."""

    tokens: np.ndarray
    sizes: np.ndarray
    seqs_per_doc: np.ndarray


@dataclass
class ChunkResult:
    path: str
    docs: int
    num_bytes: int
    keys: dict[str, KeyResult]
    bad: list[tuple[int, str]]
    """(line index within the chunk, reason) of every bad line."""
    num_lines: int


@dataclass
class Summary:
    """What a preprocessing run did."""

    docs: int = 0
    bad_lines: int = 0
    num_bytes: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    outputs: list[str] = field(default_factory=list)
    encoder: str = ""
    """Which encoder tokenized (e.g. tiktoken, or the tokenizers reference and why)."""


def line_too_long(line: bytes, max_line_bytes: int) -> str:
    """Why ``line`` is refused unread ("" when, without its newline, it is within ``max_line_bytes``)."""
    if len(line) <= max_line_bytes:
        return ""
    size = len(line) - line.endswith(b"\n")
    if size <= max_line_bytes:
        return ""
    return (
        f"the line is {size} bytes, more than --max-line-bytes ({max_line_bytes}); tokenizing takes "
        "about 40 times a line's size in memory: split the document into several lines, or raise "
        "--max-line-bytes where the memory allows it"
    )


class Encoder:
    """Turns chunks of JSONL lines into token arrays (runs in each worker, or in-process for one worker)."""

    def __init__(
        self,
        tokenizer_kwargs: dict[str, Any],
        keys: Sequence[str],
        append_eod: bool,
        max_line_bytes: int = MAX_LINE_BYTES,
    ) -> None:
        self.tokenizer = build_tokenizer(**tokenizer_kwargs)
        self.keys = tuple(keys)
        self.max_line_bytes = max_line_bytes
        self.prefix = list(self.tokenizer.prefix_ids)
        self.suffix = list(self.tokenizer.suffix_ids)
        eod = self.tokenizer.eod if append_eod else None
        self.eod = None if eod is not None and self.suffix[-1:] == [eod] else eod
        self.dtype = np.dtype(best_fitting_dtype(self.tokenizer.vocab_size))

    def _tokenize(
        self, texts: list[str], text_line: list[int], bad: dict[int, str]
    ) -> list[list[int]]:
        try:
            return self.tokenizer.tokenize_batch(texts)
        except ValueError:  # find the offending line(s); the rest keep their ids
            out = []
            for text, line in zip(texts, text_line):
                try:
                    out.append(self.tokenizer.tokenize(text))
                except ValueError as e:
                    bad.setdefault(line, f"the tokenizer rejected the text: {e}")
                    out.append([])
            return out

    def _frame(self, ids: list[list[int]], parts: np.ndarray) -> list[list[int]]:
        """Put the tokenizer's own prefix (Llama 3's BOS) before each document's first non-empty sequence and its
        suffix after the last (in place); a document without tokens stays empty."""
        if not (self.prefix or self.suffix):
            return ids
        start = 0
        for n in parts.tolist():
            filled = [j for j in range(start, start + n) if ids[j]]
            if filled:
                ids[filled[0]] = [*self.prefix, *ids[filled[0]]]
                ids[filled[-1]] = [*ids[filled[-1]], *self.suffix]
            start += n
        return ids

    def _key_result(self, ids: list[list[int]], parts: np.ndarray) -> KeyResult:
        ndocs = len(parts)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        tokens = np.fromiter(
            itertools.chain.from_iterable(ids), dtype=self.dtype, count=int(lengths.sum())
        )
        text_doc = np.repeat(np.arange(ndocs), parts)
        keep = lengths > 0
        sizes = lengths[keep]
        seqs_per_doc = np.bincount(text_doc[keep], minlength=ndocs)
        if self.eod is not None and len(sizes):
            has = seqs_per_doc > 0
            doc_tokens = np.bincount(text_doc, weights=lengths, minlength=ndocs).astype(np.int64)
            tokens = np.insert(
                tokens, np.cumsum(doc_tokens)[has], np.asarray(self.eod, dtype=self.dtype)
            )
            sizes[np.cumsum(seqs_per_doc)[has] - 1] += 1
        return KeyResult(tokens, sizes.astype(np.int32), seqs_per_doc.astype(np.int64))

    def encode(self, chunk: Chunk | ByteRange) -> ChunkResult:
        """Parse, validate and tokenize one chunk (read first when a byte range); bad lines are reported by their
        index in the chunk, not raised."""
        if isinstance(chunk, ByteRange):
            chunk = chunk.read()
        bad: dict[int, str] = {}
        docs: list[tuple[int, list[list[str]]]] = []
        for i, line in enumerate(chunk.lines):
            if reason := line_too_long(line, self.max_line_bytes):
                bad[i] = reason
                continue
            if not line.strip():
                continue
            values, reason = parse_line(line, self.keys)
            if values is None:
                bad[i] = reason
            else:
                docs.append((i, values))
        encoded = []
        for k in range(len(self.keys)):
            texts = [t for _, values in docs for t in values[k]]
            text_line = [ln for ln, values in docs for _ in values[k]]
            encoded.append(self._tokenize(texts, text_line, bad))
        if bad:  # drop documents whose line turned out bad while tokenizing another key
            keep = [j for j, (ln, _) in enumerate(docs) if ln not in bad]
            encoded = [_select(ids, docs, k, keep) for k, ids in enumerate(encoded)]
            docs = [docs[j] for j in keep]
        results = {}
        for k, key in enumerate(self.keys):
            parts = np.array([len(values[k]) for _, values in docs], dtype=np.int64)
            results[key] = self._key_result(self._frame(encoded[k], parts), parts)
        return ChunkResult(
            chunk.path,
            len(docs),
            sum(map(len, chunk.lines)),
            results,
            sorted(bad.items()),
            len(chunk.lines),
        )


def _select(
    ids: list[list[int]], docs: list[tuple[int, list[list[str]]]], k: int, keep: list[int]
) -> list[list[int]]:
    offsets = np.cumsum([0] + [len(values[k]) for _, values in docs])
    return [x for j in keep for x in ids[offsets[j] : offsets[j + 1]]]


def _results(
    chunks: Iterator[Chunk | ByteRange], encoder: Encoder, workers: int
) -> Iterator[ChunkResult]:
    """Encoded chunks in input order, at most 2 * workers in flight.

    One worker is a forked process too: a tokenizer that aborts the process (a C++ ``std::bad_alloc`` out of
    memory) then kills the worker, not this process, which reports it and removes its temporary files.
    """
    # fork: the workers inherit the built and checked tokenizer (spawning re-imports and rebuilds it, ~0.5 s each,
    # and starts a resource-tracker process that outlives the run). No thread runs in this process: the
    # tokenizers' own parallelism is off (TOKENIZERS_PARALLELISM=false) and torch is not imported here.
    yield from ordered_map(encoder.encode, chunks, workers)


class Progress:
    def __init__(self, interval: int) -> None:
        self.interval = max(1, interval)
        self.start = time.monotonic()
        self.next = self.interval

    def update(self, s: Summary) -> None:
        if s.docs >= self.next:
            self.next = (s.docs // self.interval + 1) * self.interval
            logger.info(
                "processed %d documents (%s)", s.docs, rates(s, time.monotonic() - self.start)
            )


def rates(s: Summary, seconds: float) -> str:
    """``docs/s, MB/s, tokens/s`` of a summary over ``seconds``."""
    secs = max(seconds, 1e-9)
    toks = sum(s.tokens.values())
    return f"{s.docs / secs:.1f} docs/s, {s.num_bytes / secs / 1e6:.2f} MB/s, {toks / secs:.0f} tokens/s"


def check_output_prefix(output_prefix: str) -> None:
    """Refuse a prefix that is a directory path (``data/`` would write ``data/_text_document.bin``).

    Raises:
        PreprocessError: ``output_prefix`` is empty or ends with a path separator.
    """
    seps = tuple(s for s in (os.sep, os.altsep) if s)
    if not output_prefix or output_prefix.endswith(seps):
        example = os.path.join(output_prefix or ".", "my-corpus")
        raise PreprocessError(
            f"--output-prefix {output_prefix!r} ends with a path separator: it names a directory, not a file-name "
            f"prefix (the files would be named '{output_prefix}_...'); give a directory and a file-name prefix, "
            f"e.g. {example}."
        )


def check_outputs_not_inputs(outputs: Sequence[str], inputs: Sequence[str], flag: str) -> None:
    """Refuse to write a file that is one of the inputs, by whatever path either is named.

    Paths are compared after ``os.path.realpath`` (symlinked directories, ``..``), and existing files also by
    device and inode (hard links, bind mounts), so ``link/a`` and ``real/a`` are one file.

    Raises:
        PreprocessError: naming the flag, the output file and the input it would overwrite.
    """
    real = {os.path.realpath(p): p for p in inputs}
    stats = {}
    for p in inputs:
        try:
            st = os.stat(p)
        except OSError:
            continue
        stats[(st.st_dev, st.st_ino)] = p
    for out in outputs:
        hit = real.get(os.path.realpath(out))
        if hit is None:
            try:
                st = os.stat(out)
                hit = stats.get((st.st_dev, st.st_ino))
            except OSError:
                pass
        if hit is not None:
            alias = "" if hit == out else f" ({hit}: the same file by another path)"
            raise PreprocessError(
                f"{flag} would write {out}, which is also an input{alias}; nothing written. Choose another "
                "output prefix."
            )


def _describe_inputs(inputs: Sequence[str]) -> str:
    shown = ", ".join(inputs[:3])
    return shown + (f" and {len(inputs) - 3} more" if len(inputs) > 3 else "")


def _check_not_empty(summary: Summary, inputs: Sequence[str], skip_bad_lines: bool) -> None:
    """Refuse to write datasets with no documents, or a key with no tokens (training on them would fail)."""
    where = f"--input {_describe_inputs(inputs)}"
    if summary.docs == 0:
        why = (
            f"its {summary.bad_lines:,} non-blank line(s) were all bad, skipped by --skip-bad-lines"
            if skip_bad_lines and summary.bad_lines
            else "no non-blank line"
        )
        raise PreprocessError(
            f"{where} holds no documents ({why}); nothing written. Give JSONL files with one JSON "
            "object per line."
        )
    empty = [key for key, n in summary.tokens.items() if n == 0]
    if empty:
        raise PreprocessError(
            f"{where}: {summary.docs:,} document(s) but no tokens under --json-keys "
            f"{' '.join(empty)} (every value is empty); nothing written. Check the input and --json-keys."
        )


def output_prefix_for(output_prefix: str, key: str, level: str = "document") -> str:
    """Megatron's output name: ``{output_prefix}_{key}_{level}``."""
    return f"{output_prefix}_{key}_{level}"


@dataclass(frozen=True)
class Execution:
    """How :func:`preprocess` runs: its speed and progress output only, never the bytes it writes."""

    workers: int = 1
    """Tokenizer processes (``--workers``)."""
    log_interval: int = 1000
    """A progress line every this many documents (``--log-interval``)."""
    chunk_lines: int | None = None
    """Lines sent to a worker at a time; default ``min(128, max(16, log_interval))``."""


def _check_settings(output_prefix: str, json_keys: Sequence[str], workers: int) -> None:
    check_output_prefix(output_prefix)
    if workers < 1:
        raise PreprocessError(f"--workers ({workers}) must be at least 1.")
    if not json_keys or len(set(json_keys)) != len(json_keys):
        raise PreprocessError(
            f"--json-keys {' '.join(json_keys)} must be non-empty and without repeats."
        )


@dataclass
class ChunkLines:
    """1-based line numbers of the chunks of the inputs, taken in input order (a new file starts at line 1)."""

    path: str = ""
    next_line: int = 1

    def take(
        self, path: str, num_lines: int, bad: Sequence[tuple[int, str]], *, skip_bad_lines: bool
    ) -> int:
        """The first line number of the next chunk (``num_lines`` lines of ``path``).

        Raises:
            PreprocessError: the chunk's first bad line (``bad``: index in the chunk, reason), naming file and
                line, unless ``skip_bad_lines`` (the skipped lines are logged at debug level).
        """
        if path != self.path:
            self.path, self.next_line = path, 1
        first = self.next_line
        if bad and not skip_bad_lines:
            index, reason = bad[0]
            raise PreprocessError(
                f"{path}:{first + index}: {reason}. Fix the line, or pass --skip-bad-lines to skip bad lines."
            )
        for index, reason in bad:
            logger.debug("skipping %s:%d: %s", path, first + index, reason)
        self.next_line += num_lines
        return first


def _add_results(
    results: Iterator[ChunkResult],
    builders: dict[str, MMapIndexedDatasetBuilder],
    summary: Summary,
    *,
    skip_bad_lines: bool,
    progress: Progress,
) -> None:
    """Append every encoded chunk to the builders, in input order, counting into ``summary``.

    Raises:
        PreprocessError: a bad line, naming its file and line (unless ``skip_bad_lines``).
    """
    lines = ChunkLines()
    for result in results:
        lines.take(result.path, result.num_lines, result.bad, skip_bad_lines=skip_bad_lines)
        summary.bad_lines += len(result.bad)
        summary.docs += result.docs
        summary.num_bytes += result.num_bytes
        for key, kr in result.keys.items():
            builders[key].add_documents(kr.tokens, kr.sizes, kr.seqs_per_doc)
            summary.tokens[key] += len(kr.tokens)
        progress.update(summary)


def preprocess(
    inputs: Sequence[str],
    *,
    json_keys: Sequence[str],
    output_prefix: str,
    tokenizer_kwargs: dict[str, Any],
    append_eod: bool = False,
    skip_bad_lines: bool = False,
    execution: Execution = Execution(),
    max_line_bytes: int = MAX_LINE_BYTES,
) -> Summary:
    """Tokenize JSONL ``inputs`` into one mmap dataset per key (``{output_prefix}_{key}_document.bin/.idx``).

    ``execution`` (workers, progress interval, lines per chunk) changes speed and progress granularity, never the
    output. Outputs appear only when the run succeeds (temporary names, then rename); on any error or interrupt
    the temporary files are removed.

    Raises:
        PreprocessError: a bad line (without ``skip_bad_lines``), no documents, a key without tokens, or unusable
            settings (e.g. an ``output_prefix`` ending with a path separator).
        FileNotFoundError: an input, tokenizer file or the output directory is missing.
    """
    _check_settings(output_prefix, json_keys, execution.workers)
    if max_line_bytes < 1:
        raise PreprocessError(f"--max-line-bytes ({max_line_bytes}) must be a positive integer.")
    os.environ.setdefault(
        "TOKENIZERS_PARALLELISM", "false"
    )  # one thread per process: --workers is the parallelism
    # checks the tokenizer (and eod) up front
    encoder = Encoder(tokenizer_kwargs, json_keys, append_eod, max_line_bytes)

    prefixes = {key: output_prefix_for(output_prefix, key) for key in json_keys}
    check_outputs_not_inputs(
        [f(p) for p in prefixes.values() for f in (data_file_path, index_file_path)],
        inputs,
        "--output-prefix",
    )
    builders: dict[str, MMapIndexedDatasetBuilder] = {}
    summary = Summary(
        tokens=dict.fromkeys(json_keys, 0),
        encoder=getattr(encoder.tokenizer, "encoder", encoder.tokenizer.name),
    )
    start = time.monotonic()
    progress = Progress(execution.log_interval)
    try:
        for key, prefix in prefixes.items():
            builders[key] = make_builder(
                data_file_path(prefix), vocab_size=encoder.tokenizer.vocab_size
            )
        lines = execution.chunk_lines or min(CHUNK_LINES, max(16, execution.log_interval))
        _add_results(
            _results(plan_chunks(inputs, max_lines=lines), encoder, execution.workers),
            builders,
            summary,
            skip_bad_lines=skip_bad_lines,
            progress=progress,
        )
        _check_not_empty(summary, inputs, skip_bad_lines)
        for key, prefix in prefixes.items():
            builders[key].finalize(index_file_path(prefix))
            summary.outputs.append(prefix)
    except BaseException as e:
        for builder in builders.values():
            builder.abort()
        if isinstance(e, WorkerDied):
            raise PreprocessError(f"preprocessing {e}; nothing written.") from None
        if isinstance(e, MemoryError):
            raise PreprocessError(
                f"out of memory while tokenizing ({e}); nothing written. Use fewer --workers, or a lower "
                f"--max-line-bytes (now {max_line_bytes}) to refuse long lines."
            ) from None
        raise
    summary.seconds = time.monotonic() - start
    return summary


def find_prefixes(directory: str) -> list[str]:
    """Sorted dataset prefixes in ``directory`` (every ``X.idx`` with an ``X.bin``)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--input {directory} is not a directory.")
    return sorted(
        p[: -len(".idx")]
        for p in glob.glob(os.path.join(directory, "*.idx"))
        if os.path.isfile(p[:-4] + ".bin")
    )


def merge_datasets(inputs: Sequence[str], output_prefix: str) -> MMapIndexedDataset:
    """Concatenate the datasets at prefixes ``inputs`` (in order) into ``output_prefix``; returns the result.

    Raises:
        PreprocessError: no inputs, the output is one of the inputs, or the dtypes differ.
        FileNotFoundError: an input is missing.
    """
    if not inputs:
        raise PreprocessError(
            "nothing to merge: no dataset prefixes given (or none found in --input)."
        )
    check_output_prefix(output_prefix)
    check_outputs_not_inputs(
        [data_file_path(output_prefix), index_file_path(output_prefix)],
        [f(p) for p in inputs for f in (data_file_path, index_file_path)],
        "--output-prefix",
    )
    first = MMapIndexedDataset(inputs[0])
    builder = MMapIndexedDatasetBuilder(data_file_path(output_prefix), dtype=first.dtype)
    with builder:
        for prefix in inputs:
            if not MMapIndexedDataset.exists(prefix):
                raise FileNotFoundError(
                    f"{prefix}.idx/.bin not found; pass dataset prefixes (without .bin/.idx)."
                )
            try:
                builder.merge_file_(prefix)
            except ValueError as e:
                raise PreprocessError(str(e)) from e
        builder.finalize(index_file_path(output_prefix))
    return MMapIndexedDataset(output_prefix)
