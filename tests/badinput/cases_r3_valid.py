"""Reliability round 3 (issue 35), the validation items: numeric flags out of range (5, 17), a run longer than a
64-bit count (16), a sample index larger than the machine's memory (15), an over-long JSONL line (12).

The flag cases fail in ``validate()`` before any process group exists; the index case starts one rank and fails
when the training split's index would be built (its dataset is a copy in the case's scratch directory, so no
index cache is written beside the shared one).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.badinput.cases import TINY_FLAGS, Case

TRAIN = ("pretrain_gpt.py", *TINY_FLAGS, "--train-iters", "2")
_FLAGS = list(TINY_FLAGS)
for _flag in (
    "--mock-data",
    "--vocab-size",
    "--tokenizer-type",
):  # the dataset's own GPT-2 tokenizer instead
    _at = _FLAGS.index(_flag)
    del _FLAGS[_at : _at + (1 if _flag == "--mock-data" else 2)]
ON_DATA = (
    "pretrain_gpt.py", *_FLAGS, "--train-iters", "2", "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", "{tmp}/tiny/vocab.json", "--merge-file", "{tmp}/tiny/merges.txt",
)  # fmt: skip


def _copy_tiny(tmp: Path, ws: Path) -> None:
    shutil.copytree(ws / "tiny", tmp / "tiny")


def _long_line(tmp: Path, ws: Path) -> None:
    """Line 2 of 3 is 2 MB of ids (over --max-line-bytes 1000000)."""
    lines = [{"text": "1 2 3"}, {"text": " ".join(["7"] * 1_000_000)}, {"text": "4 5"}]
    (tmp / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


CASES: list[Case] = [
    Case(
        "r3-kv-channels-zero",
        (*TRAIN, "--kv-channels", "0"),
        2,
        "--kv-channels (0) must be a positive integer; leave the flag out for the default",
    ),
    Case(
        "r3-adam-beta1-above-one",
        (*TRAIN, "--adam-beta1", "1.5"),
        2,
        "--adam-beta1 (1.5) must be in [0, 1)",
    ),
    Case(
        "r3-train-iters-int64-max",
        (*TRAIN, "--train-iters", str(2**63 - 1)),
        2,
        "exceeds 9223372036854775807 (2**63 - 1), the most a dataset index can count",
    ),
    Case(
        "r3-global-batch-size-beyond-memory",
        (
            *ON_DATA,
            "--global-batch-size",
            "1000000000",
            "--data-path",
            "{tmp}/tiny/tiny_text_document",
        ),
        2,
        "of memory; ask for fewer samples (--global-batch-size",
        needs=("data",),
        setup=_copy_tiny,
    ),
    Case(
        "r3-preprocess-line-too-long",
        (
            "tools/preprocess_data.py",
            "--input",
            "{tmp}/in.jsonl",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "1000",
            "--output-prefix",
            "{tmp}/out",
            "--max-line-bytes",
            "1000000",
        ),  # fmt: skip
        1,
        "in.jsonl:2: the line is 2000011 bytes, more than --max-line-bytes (1000000)",
        unchanged=("{tmp}",),
        setup=_long_line,
    ),
]
