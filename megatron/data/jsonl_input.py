"""Reading JSONL inputs for preprocessing: globs, gzip, chunks of whole lines (byte ranges a worker reads itself, or
lines read here), one JSON line parsed into the texts of the asked keys, and bad lines named ``file:line``.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

CHUNK_LINES = 128
CHUNK_BYTES = 256 * 1024


class PreprocessError(ValueError):
    """Bad input for preprocessing; the message names the file, line and fix."""


@dataclass(frozen=True)
class Chunk:
    """Raw lines of one input file: ``lines[i]`` is line ``first_line + i`` (1-based) of ``path``."""

    path: str
    first_line: int
    lines: list[bytes]


@dataclass(frozen=True)
class ByteRange:
    """Whole lines ``[start, end)`` (byte offsets) of an uncompressed input file, read by the worker itself."""

    path: str
    start: int
    end: int

    def read(self) -> Chunk:
        """The lines of the range (``first_line`` 0: the main process numbers lines as results arrive)."""
        with open(self.path, "rb") as f:
            f.seek(self.start)
            data = f.read(self.end - self.start)
        parts = data.split(b"\n")  # as iterating a binary file splits: on b"\n" only, newline kept
        lines = [part + b"\n" for part in parts[:-1]]
        if parts[-1]:
            lines.append(parts[-1])  # a last line without a newline
        return Chunk(self.path, 0, lines)


def resolve_inputs(pattern: str) -> list[str]:
    """The files of ``--input``: the file itself, else the sorted matches of the glob.

    Raises:
        FileNotFoundError: nothing matches.
    """
    if os.path.isfile(pattern) or (os.path.exists(pattern) and not os.path.isdir(pattern)):
        return [pattern]
    matches = sorted(p for p in glob.glob(pattern, recursive=True) if not os.path.isdir(p))
    if not matches:
        raise FileNotFoundError(
            f"--input {pattern} matches no file; give a .jsonl/.jsonl.gz path or a glob."
        )
    return matches


def _open(path: str) -> BinaryIO:
    if path.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb", buffering=1024 * 1024)  # noqa: SIM115 (closed by the caller)


def read_chunks(
    paths: Sequence[str], max_lines: int = CHUNK_LINES, max_bytes: int = CHUNK_BYTES
) -> Iterator[Chunk]:
    """Stream the lines of ``paths`` in chunks (a chunk never spans two files)."""
    for path in paths:
        with _open(path) as f:
            lines: list[bytes] = []
            size, first = 0, 1
            try:
                for lineno, line in enumerate(f, start=1):
                    lines.append(line)
                    size += len(line)
                    if len(lines) >= max_lines or size >= max_bytes:
                        yield Chunk(path, first, lines)
                        lines, size, first = [], 0, lineno + 1
            except (OSError, EOFError) as e:  # a corrupt or truncated .gz
                raise PreprocessError(
                    f"{path}: cannot read past line {first + len(lines) - 1}: {e}"
                ) from e
            if lines:
                yield Chunk(path, first, lines)


def _range_end(f: BinaryIO, start: int, max_lines: int, max_bytes: int) -> int:
    """End offset of the chunk of whole lines that starts at ``start``: at most ``max_lines`` lines and at most
    ``max_bytes`` bytes, except a single line longer than that (then that line alone)."""
    f.seek(start)
    block = f.read(max_bytes)
    if not block:
        return start
    pos = -1
    for _ in range(max_lines):
        pos = block.find(b"\n", pos + 1)
        if pos < 0:
            break
    else:
        return start + pos + 1  # max_lines whole lines within max_bytes
    if len(block) < max_bytes:
        return start + len(block)  # the rest of the file (its last line may lack a newline)
    last = block.rfind(b"\n")
    if last >= 0:
        return start + last + 1  # the whole lines that fit
    while True:  # one line longer than max_bytes: read on to its end
        more = f.read(max_bytes)
        if not more:
            return f.tell()
        at = more.find(b"\n")
        if at >= 0:
            return f.tell() - len(more) + at + 1


def plan_chunks(
    paths: Sequence[str], max_lines: int = CHUNK_LINES, max_bytes: int = CHUNK_BYTES
) -> Iterator[Chunk | ByteRange]:
    """The chunks of ``paths`` in input order: byte ranges of regular files (the workers read them), lines of
    ``.gz`` files and pipes (read here). A chunk never spans two files."""
    for path in paths:
        if path.endswith(".gz") or not os.path.isfile(path):  # compressed, or a pipe: no seeking
            yield from read_chunks([path], max_lines, max_bytes)
            continue
        with open(path, "rb") as f:
            start = 0
            while True:
                end = _range_end(f, start, max_lines, max_bytes)
                if end == start:
                    break
                yield ByteRange(path, start, end)
                start = end


def parse_object(line: bytes) -> tuple[dict[str, Any] | None, str]:
    """The JSON object on ``line``, or None and the reason the line is bad."""
    try:
        obj = json.loads(line)
    except UnicodeDecodeError as e:
        return None, f"not valid UTF-8 ({e.reason} at byte {e.start})"
    except ValueError as e:
        return None, f"invalid JSON: {getattr(e, 'msg', e)} (column {getattr(e, 'colno', '?')})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got a {type(obj).__name__}"
    return obj, ""


def describe_keys(obj: dict[str, Any]) -> str:
    """The first keys of a line's object, for an error message."""
    return ", ".join(repr(k) for k in list(obj)[:10]) or "none"


def parse_line(line: bytes, keys: Sequence[str]) -> tuple[list[list[str]] | None, str]:
    """The values of ``keys`` as lists of strings, or None and the reason the line is bad."""
    obj, reason = parse_object(line)
    if obj is None:
        return None, reason
    values = []
    for key in keys:
        if key not in obj:
            return (
                None,
                f"missing key {key!r} (the line has keys: {describe_keys(obj)}); check --json-keys",
            )
        value = obj[key]
        if isinstance(value, str):
            values.append([value])
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            values.append(value)
        else:
            return (
                None,
                f"key {key!r} is a {type(value).__name__}, expected a string or a list of strings",
            )
    return values, ""


def iter_texts(paths: Sequence[str], keys: Sequence[str]) -> Iterator[str]:
    """Every string of ``keys`` in the JSONL ``paths``, streamed (for tokenizer training).

    Raises:
        PreprocessError: a bad line, named ``file:line``.
    """
    for chunk in read_chunks(paths):
        for i, line in enumerate(chunk.lines):
            if not line.strip():
                continue
            values, reason = parse_line(line, keys)
            if values is None:
                raise PreprocessError(f"{chunk.path}:{chunk.first_line + i}: {reason}.")
            for texts in values:
                yield from texts
