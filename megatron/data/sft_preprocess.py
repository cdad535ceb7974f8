"""Chat / prompt-response JSONL -> an SFT dataset: tokens ``P`` and loss mask ``P + "_loss_mask"`` (the library behind
``tools/preprocess_data.py --sft``).

The format (issue #33's shared design): ``P`` is a regular Megatron indexed dataset, one document (of one sequence)
per example, written as preprocessing writes documents (uint16 ids, int32 above 65,535 ids of vocabulary; no EOD
unless the template renders one); ``P_loss_mask`` is a uint8 indexed dataset with the same documents and lengths,
1 where the token is a training target. Examples and masks: :mod:`megatron.data.sft_examples`.

The pipeline is preprocessing's (:mod:`megatron.data.preprocess`): chunks of whole lines streamed to forked workers
(``--workers``), results in input order (the output is byte-identical for any worker count), outputs written under
temporary names and renamed only when the run succeeds, a bad line stopping the run with ``file:line: reason`` or
skipped and counted with ``skip_bad_lines``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron.data.fork_workers import WorkerDied, ordered_map
from megatron.data.indexed_builder import MMapIndexedDatasetBuilder, make_builder
from megatron.data.indexed_dataset import (
    best_fitting_dtype,
    data_file_path,
    index_file_path,
    loss_mask_prefix,
)
from megatron.data.jsonl_input import CHUNK_LINES, ByteRange, Chunk, PreprocessError, plan_chunks
from megatron.data.preprocess import (
    MAX_LINE_BYTES,
    ChunkLines,
    Execution,
    Progress,
    Summary,
    check_output_prefix,
    check_outputs_not_inputs,
    line_too_long,
    output_prefix_for,
)
from megatron.data.sft_examples import (
    BadExample,
    SftExampleEncoder,
    SftOptions,
    build_sft_tokenizer,
    load_template,
)


@dataclass
class SftSummary(Summary):
    """What an SFT preprocessing run did (``docs`` = chats + pairs; ``tokens["text"]`` all tokens)."""

    chats: int = 0
    pairs: int = 0
    target_tokens: int = 0
    """Tokens whose mask is 1."""
    template: str = ""
    """Where the chat template came from, or how pairs were written without one."""


@dataclass
class SftChunk:
    """One encoded chunk: every accepted example's ids and mask, concatenated, and their lengths."""

    path: str
    tokens: np.ndarray
    mask: np.ndarray
    sizes: np.ndarray
    chats: int
    bad: list[tuple[int, str]] = field(default_factory=list)
    num_lines: int = 0
    num_bytes: int = 0


class SftChunkEncoder:
    """Encodes chunks of lines (in each worker); holds the tokenizer and the template built in the main process."""

    def __init__(
        self, tokenizer_kwargs: dict[str, Any], options: SftOptions, max_line_bytes: int
    ) -> None:
        template = load_template(
            tokenizer_kwargs.get("tokenizer_type"),
            tokenizer_kwargs.get("tokenizer_model"),
            options.chat_template,
        )
        tokenizer = build_sft_tokenizer(tokenizer_kwargs, template)
        self.examples = SftExampleEncoder(tokenizer, template, options)
        self.max_line_bytes = max_line_bytes
        self.dtype = np.dtype(best_fitting_dtype(tokenizer.vocab_size))

    @property
    def template_description(self) -> str:
        template = self.examples.template
        if template is not None:
            return f"chat template from {template.origin}"
        return "no chat template: prompt/response pairs as prompt + response + EOS"

    def encode(self, chunk: Chunk | ByteRange) -> SftChunk:
        """Parse, render, tokenize and mask one chunk; bad lines are listed by their index in the chunk."""
        if isinstance(chunk, ByteRange):
            chunk = chunk.read()
        ids: list[list[int]] = []
        masks: list[np.ndarray] = []
        bad: list[tuple[int, str]] = []
        chats = 0
        for i, line in enumerate(chunk.lines):
            if reason := line_too_long(line, self.max_line_bytes):
                bad.append((i, reason))
                continue
            if not line.strip():
                continue
            try:
                example = self.examples.example(line)
            except BadExample as e:
                bad.append((i, str(e)))
                continue
            ids.append(example.ids)
            masks.append(example.mask)
            chats += example.chat
        sizes = np.array([len(x) for x in ids], dtype=np.int32)
        tokens = np.fromiter(
            (t for x in ids for t in x), dtype=self.dtype, count=int(sizes.sum(dtype=np.int64))
        )
        mask = np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8)
        return SftChunk(
            chunk.path,
            tokens,
            mask,
            sizes,
            chats,
            bad,
            len(chunk.lines),
            sum(map(len, chunk.lines)),
        )


class _Writers:
    """The two builders (tokens, mask), written under temporary names until :meth:`finalize`."""

    def __init__(self, outputs: Sequence[str], vocab_size: int) -> None:
        self.outputs = outputs
        self.tokens = make_builder(data_file_path(outputs[0]), vocab_size=vocab_size)
        try:
            self.mask = MMapIndexedDatasetBuilder(data_file_path(outputs[1]), dtype=np.uint8)
        except BaseException:
            self.tokens.abort()
            raise

    def finalize(self) -> None:
        """The mask first: a reader that finds ``P`` finds ``P_loss_mask``."""
        self.mask.finalize(index_file_path(self.outputs[1]))
        self.tokens.finalize(index_file_path(self.outputs[0]))

    def abort(self) -> None:
        self.tokens.abort()
        self.mask.abort()


def _add_chunks(
    chunks: Iterator[SftChunk],
    writers: _Writers,
    summary: SftSummary,
    *,
    skip_bad_lines: bool,
    progress: Progress,
) -> None:
    """Append every encoded chunk, in input order, counting into ``summary``.

    Raises:
        PreprocessError: a bad line, naming its file and line (unless ``skip_bad_lines``).
    """
    lines = ChunkLines()
    for chunk in chunks:
        lines.take(chunk.path, chunk.num_lines, chunk.bad, skip_bad_lines=skip_bad_lines)
        writers.tokens.add_documents(chunk.tokens, chunk.sizes)
        writers.mask.add_documents(chunk.mask, chunk.sizes)
        summary.bad_lines += len(chunk.bad)
        summary.docs += len(chunk.sizes)
        summary.chats += chunk.chats
        summary.pairs += len(chunk.sizes) - chunk.chats
        summary.num_bytes += chunk.num_bytes
        summary.tokens["text"] += len(chunk.tokens)
        summary.target_tokens += int(np.count_nonzero(chunk.mask))
        progress.update(summary)


def _check_not_empty(summary: SftSummary, inputs: Sequence[str], skip_bad_lines: bool) -> None:
    if summary.docs:
        return
    shown = ", ".join(inputs[:3]) + (f" and {len(inputs) - 3} more" if len(inputs) > 3 else "")
    why = (
        f"its {summary.bad_lines:,} non-blank line(s) were all bad, skipped by --skip-bad-lines"
        if skip_bad_lines and summary.bad_lines
        else "no non-blank line"
    )
    raise PreprocessError(
        f"--input {shown} holds no SFT examples ({why}); nothing written. Give JSONL files with one chat "
        '({"messages": [...]}) or prompt/response pair per line.'
    )


def preprocess_sft(
    inputs: Sequence[str],
    *,
    output_prefix: str,
    tokenizer_kwargs: dict[str, Any],
    options: SftOptions | None = None,
    skip_bad_lines: bool = False,
    execution: Execution | None = None,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> SftSummary:
    """Tokenize chat / prompt-response JSONL ``inputs`` into ``P = {output_prefix}_text_document`` and its loss
    mask ``P_loss_mask`` (see the module docstring); ``summary.outputs`` is ``[P, P_loss_mask]``.

    Raises:
        PreprocessError: a bad line (without ``skip_bad_lines``), no examples, or unusable settings.
        TokenizerFileError: tokenizer or chat template files that cannot be used.
        ValueError: unusable options (naming the flag).
        FileNotFoundError: an input, tokenizer file or the output directory is missing.
    """
    options, execution = options or SftOptions(), execution or Execution()
    check_output_prefix(output_prefix)
    if execution.workers < 1:
        raise PreprocessError(f"--workers ({execution.workers}) must be at least 1.")
    if max_line_bytes < 1:
        raise PreprocessError(f"--max-line-bytes ({max_line_bytes}) must be a positive integer.")
    options.check()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # --workers is the parallelism
    encoder = SftChunkEncoder(tokenizer_kwargs, options, max_line_bytes)
    prefix = output_prefix_for(output_prefix, "text")
    outputs = [prefix, loss_mask_prefix(prefix)]
    check_outputs_not_inputs(
        [f(p) for p in outputs for f in (data_file_path, index_file_path)],
        inputs,
        "--output-prefix",
    )
    tokenizer = encoder.examples.tokenizer
    summary = SftSummary(
        tokens={"text": 0},
        encoder="tokenizers (the reference, with offsets)"
        if encoder.examples.template is not None
        else getattr(tokenizer, "encoder", tokenizer.name),
        template=encoder.template_description,
    )
    start = time.monotonic()
    writers: _Writers | None = None
    try:
        writers = _Writers(outputs, tokenizer.vocab_size)
        lines = execution.chunk_lines or min(CHUNK_LINES, max(16, execution.log_interval))
        chunks = ordered_map(
            encoder.encode, plan_chunks(inputs, max_lines=lines), execution.workers
        )
        _add_chunks(
            chunks,
            writers,
            summary,
            skip_bad_lines=skip_bad_lines,
            progress=Progress(execution.log_interval),
        )
        _check_not_empty(summary, inputs, skip_bad_lines)
        writers.finalize()
    except BaseException as e:
        if writers is not None:
            writers.abort()
        if isinstance(e, WorkerDied):
            raise PreprocessError(f"preprocessing {e}; nothing written.") from None
        if isinstance(e, MemoryError):
            raise PreprocessError(
                f"out of memory while tokenizing ({e}); nothing written. Use fewer --workers, or a lower "
                f"--max-line-bytes (now {max_line_bytes}) to refuse long lines."
            ) from None
        raise
    summary.outputs.extend(outputs)
    summary.seconds = time.monotonic() - start
    return summary
