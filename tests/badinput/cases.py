"""The bad-input catalogue's schema: one ``Case`` per command a user may get wrong, and what we promise for it.

Each ``cases_*.py`` module in this package holds ``CASES: list[Case]`` for one area (data, flags, checkpoints,
conversion, generation, server); ``test_catalogue.py`` runs every case as a real subprocess
(``[sys.executable, *argv]`` in the repository root) and checks:

- the exit code is ``exit_code``;
- ``message`` (a fragment) appears in stdout + stderr, and no ``Traceback`` does;
- every path in ``unchanged`` (a file, or a directory compared file by file) has the same bytes afterwards.

Placeholders in ``argv``, ``unchanged`` and ``message`` are filled by ``str.format``:
``{tmp}`` the case's own scratch directory, ``{ws}`` the shared read-only workspace, ``{repo}`` the repository root,
``{url}`` the base URL of the shared generation server and ``{port}`` its port (needs ``"server"``).
A literal brace in an argument is written twice (``{{`` / ``}}``).
The workspace holds only what the catalogue's cases ask for through ``needs``:

- ``"data"``: ``{ws}/tiny/`` a copy of ``tests/fixtures/tiny`` (``tiny_text_document.bin/.idx``, GPT-2 style
  ``vocab.json`` + ``merges.txt``; train with ``--data-path {ws}/tiny/tiny_text_document``).
- ``"ckpt"``: ``{ws}/ckpt`` a 2-iteration ZeRO-0 checkpoint of ``TINY_FLAGS`` (``latest`` = ``global_step2``).
- ``"hf"``: ``{ws}/hf`` the Hugging Face export of ``{ws}/ckpt``.
- ``"server"``: a text generation server over ``{ws}/ckpt`` at ``{url}``.

A case that needs a modified input (a corrupted copy of the checkpoint, a swapped ``.idx``) builds it in ``{tmp}``
with ``setup(tmp, ws)``; the shared workspace is never modified.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# A tiny GPT trained on mock data in two iterations (about 5 s in one process); the "ckpt" workspace entry.
TINY_FLAGS: tuple[str, ...] = (
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "1", "--global-batch-size", "2",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--seed", "1234", "--mock-data", "--vocab-size", "299",
    "--tokenizer-type", "NullTokenizer",
    "--eval-iters", "0", "--log-interval", "1", "--log-level", "WARNING",
)  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One bad input: the command, and the exit code, message and untouched files we promise for it."""

    id: str
    """Unique, short, kebab-case: the pytest id."""
    argv: tuple[str, ...]
    """Arguments after the interpreter: a script (``pretrain_gpt.py``) or ``-m tools.x`` and its flags."""
    exit_code: int
    """The exit code the command must return (non-zero)."""
    message: str
    """A fragment that must appear in stdout + stderr (names what is wrong, where, or the fix)."""
    unchanged: tuple[str, ...] = ()
    """Paths whose bytes must be the same after the command (files, or directories compared recursively)."""
    needs: tuple[str, ...] = ()
    """Workspace parts the case reads: any of ``data``, ``ckpt``, ``hf``, ``server``."""
    setup: Callable[[Path, Path], None] | None = None
    """Builds the case's inputs in its scratch directory: ``setup(tmp, ws)``."""
    timeout: float = 120.0
    """Seconds before the command counts as hung (a failure)."""
    stdin: str | None = None
    """Text fed to the command's standard input (None: an empty stdin); placeholders are not filled."""
