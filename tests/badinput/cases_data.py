"""Bad inputs of the data pipeline: preprocessing, merging, ``.bin``/``.idx`` files, ``--data-path``/``--split``.

Every case fails before any rank is spawned. Damaged datasets are copies of the tiny fixture made in the case's
scratch directory by its ``setup``; the ``unchanged`` paths are the inputs a tool must not write over.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tests.badinput.cases import TINY_FLAGS, Case

HEADER = 34  # the .idx header: magic, version, dtype code, N, D
PREPROCESS = (
    "tools/preprocess_data.py",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "1000",
)
# The tiny model on a dataset instead of mock data; every case fails in the data checks, before the vocabulary's.
TRAIN = ("pretrain_gpt.py", *[f for f in TINY_FLAGS if f != "--mock-data"], "--train-iters", "2")
TINY = "{ws}/tiny/tiny_text_document"


def _jsonl(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def _text_input(tmp: Path, ws: Path) -> None:
    _jsonl(tmp / "in.jsonl", [json.dumps({"text": "1 2 3"}), json.dumps({"text": "4 5"})])


def _bad_json(tmp: Path, ws: Path) -> None:
    _jsonl(tmp / "in.jsonl", [json.dumps({"text": "1 2 3"}), '{"text": "4 5'])


def _empty_input(tmp: Path, ws: Path) -> None:
    (tmp / "in.jsonl").write_text("\n\n")


def _output_through_symlink(tmp: Path, ws: Path) -> None:
    """A JSONL input whose name is the .bin the output prefix would write, reached through a symlinked dir."""
    real = tmp / "real"
    real.mkdir()
    _jsonl(real / "p_text_document.bin", [json.dumps({"text": "1 2 3"})])
    (tmp / "link").symlink_to(real, target_is_directory=True)


def _copy_tiny(tmp: Path, ws: Path, name: str = "t") -> Path:
    for ext in (".bin", ".idx"):
        shutil.copyfile(ws / "tiny" / f"tiny_text_document{ext}", tmp / f"{name}{ext}")
    return tmp / name


def _edit_idx(
    edit: Callable[[np.ndarray, np.ndarray, np.ndarray], None],
) -> Callable[[Path, Path], None]:
    """A setup copying the tiny dataset to ``{tmp}/t`` and editing its sizes, pointers, doc_idx in place."""

    def setup(tmp: Path, ws: Path) -> None:
        idx = _copy_tiny(tmp, ws).with_suffix(".idx")
        raw = bytearray(idx.read_bytes())
        n, d = (int.from_bytes(raw[o : o + 8], "little") for o in (18, 26))
        sizes = np.frombuffer(raw, "<i4", n, HEADER)
        pointers = np.frombuffer(raw, "<i8", n, HEADER + 4 * n)
        doc_idx = np.frombuffer(raw, "<i8", d, HEADER + 12 * n)
        edit(sizes, pointers, doc_idx)  # views into ``raw``
        idx.write_bytes(raw)

    return setup


def _swap_sizes(sizes: np.ndarray, pointers: np.ndarray, doc_idx: np.ndarray) -> None:
    j = int(np.flatnonzero(sizes != sizes[0])[0])  # same sum: the .bin length still matches
    sizes[[0, j]] = sizes[[j, 0]]


def _bump_pointer(sizes: np.ndarray, pointers: np.ndarray, doc_idx: np.ndarray) -> None:
    pointers[3] += 2


def _unsort_doc_idx(sizes: np.ndarray, pointers: np.ndarray, doc_idx: np.ndarray) -> None:
    doc_idx[[2, 3]] = doc_idx[[3, 2]]


def _truncate_bin(tmp: Path, ws: Path) -> None:
    path = _copy_tiny(tmp, ws).with_suffix(".bin")
    path.write_bytes(path.read_bytes()[:-100])


def _swap_idx_files(tmp: Path, ws: Path) -> None:
    """Two datasets whose .idx files were exchanged (a mismatched copy)."""
    a = _copy_tiny(tmp, ws, "a")
    b = tmp / "b"
    raw = a.with_suffix(".bin").read_bytes()
    b.with_suffix(".bin").write_bytes(raw[: len(raw) // 2])
    shutil.copyfile(a.with_suffix(".idx"), b.with_suffix(".idx"))


def _merge_inputs(tmp: Path, ws: Path) -> None:
    """{tmp}/real/a and {tmp}/real/b (the tiny dataset twice) and {tmp}/link -> real."""
    real = tmp / "real"
    real.mkdir()
    _copy_tiny(real, ws, "a")
    _copy_tiny(real, ws, "b")
    (tmp / "link").symlink_to(real, target_is_directory=True)


def _merge_mixed_dtypes(tmp: Path, ws: Path) -> None:
    from megatron.data.indexed_builder import make_builder

    _copy_tiny(tmp, ws, "a")  # uint16 (GPT-2 vocabulary)
    builder = make_builder(str(tmp / "wide.bin"), vocab_size=100_000)  # int32
    builder.add_item(np.array([1, 2, 3]))
    builder.end_document()
    builder.finalize(str(tmp / "wide.idx"))


def _merge_corrupt_input(tmp: Path, ws: Path) -> None:
    _edit_idx(_swap_sizes)(tmp, ws)
    _copy_tiny(tmp, ws, "ok")


CASES: list[Case] = [
    # ------------------------------------------------------------------------------------------ --sft
    Case(
        "sft-missing-loss-mask",
        (*TRAIN, "--data-path", TINY, "--sft", "--attention-dropout", "0"),
        2,
        "tiny_text_document_loss_mask.idx; --sft reads the loss mask beside the conversations",
        needs=("data",),
    ),
    # ------------------------------------------------------------------------------------------ preprocess
    Case(
        "preprocess-missing-input",
        (*PREPROCESS, "--input", "{tmp}/nope.jsonl", "--output-prefix", "{tmp}/out"),
        1,
        "matches no file",
    ),
    Case(
        "preprocess-bad-json-key",
        (
            *PREPROCESS,
            "--input",
            "{tmp}/in.jsonl",
            "--json-keys",
            "body",
            "--output-prefix",
            "{tmp}/out",
        ),
        1,
        "in.jsonl:1: missing key 'body'",
        unchanged=("{tmp}",),
        setup=_text_input,
    ),
    Case(
        "preprocess-malformed-json-line",
        (*PREPROCESS, "--input", "{tmp}/in.jsonl", "--output-prefix", "{tmp}/out"),
        1,
        "in.jsonl:2: invalid JSON",
        unchanged=("{tmp}",),
        setup=_bad_json,
    ),
    Case(
        "preprocess-input-without-documents",
        (*PREPROCESS, "--input", "{tmp}/in.jsonl", "--output-prefix", "{tmp}/out"),
        1,
        "holds no documents",
        unchanged=("{tmp}",),
        setup=_empty_input,
    ),
    Case(
        "preprocess-output-prefix-is-a-directory",
        (*PREPROCESS, "--input", "{tmp}/in.jsonl", "--output-prefix", "{tmp}/"),
        1,
        "ends with a path separator",
        unchanged=("{tmp}",),
        setup=_text_input,
    ),
    Case(
        "preprocess-output-directory-missing",
        (*PREPROCESS, "--input", "{tmp}/in.jsonl", "--output-prefix", "{tmp}/nodir/out"),
        1,
        "nodir does not exist",
        unchanged=("{tmp}",),
        setup=_text_input,
    ),
    Case(
        "preprocess-output-is-input-through-symlink",
        (
            *PREPROCESS,
            "--input",
            "{tmp}/link/p_text_document.bin",
            "--output-prefix",
            "{tmp}/real/p",
        ),
        1,
        "is also an input",
        unchanged=("{tmp}/real",),
        setup=_output_through_symlink,
    ),
    Case(
        "preprocess-partitions-not-one",
        (
            *PREPROCESS,
            "--input",
            "{tmp}/in.jsonl",
            "--output-prefix",
            "{tmp}/out",
            "--partitions",
            "4",
        ),
        2,
        "--partitions 4 is not supported",
        unchanged=("{tmp}",),
        setup=_text_input,
    ),
    # --------------------------------------------------------------------------------------------- merge
    Case(
        "merge-output-is-input-through-symlink",
        ("-m", "tools.merge_datasets", "--input", "{tmp}/link", "--output-prefix", "{tmp}/real/a"),
        1,
        "is also an input",
        unchanged=("{tmp}/real",),
        setup=_merge_inputs,
    ),
    Case(
        "merge-output-through-symlink-is-input",
        (
            "-m",
            "tools.merge_datasets",
            "--inputs",
            "{tmp}/real/a",
            "{tmp}/real/b",
            "--output-prefix",
            "{tmp}/link/b",
        ),  # fmt: skip
        1,
        "is also an input",
        unchanged=("{tmp}/real",),
        setup=_merge_inputs,
    ),
    Case(
        "merge-missing-input",
        ("-m", "tools.merge_datasets", "--inputs", "{tmp}/nope", "--output-prefix", "{tmp}/out"),
        1,
        "nope.idx not found",
    ),
    Case(
        "merge-empty-directory",
        ("-m", "tools.merge_datasets", "--input", "{tmp}", "--output-prefix", "{tmp}/out"),
        1,
        "nothing to merge",
    ),
    Case(
        "merge-mixed-dtypes",
        (
            "-m",
            "tools.merge_datasets",
            "--inputs",
            "{tmp}/a",
            "{tmp}/wide",
            "--output-prefix",
            "{tmp}/out",
        ),
        1,
        "share one tokenizer/dtype",
        unchanged=("{tmp}",),
        setup=_merge_mixed_dtypes,
    ),
    Case(
        "merge-corrupted-input-idx",
        (
            "-m",
            "tools.merge_datasets",
            "--inputs",
            "{tmp}/ok",
            "{tmp}/t",
            "--output-prefix",
            "{tmp}/out",
        ),
        1,
        "t.idx is corrupted",
        unchanged=("{tmp}",),
        setup=_merge_corrupt_input,
    ),
    # ------------------------------------------------------------------------------- .bin / .idx on open
    Case(
        "idx-sizes-swapped",
        (*TRAIN, "--data-path", "{tmp}/t"),
        2,
        "t.idx is corrupted: the pointer of sequence",
        unchanged=("{tmp}",),
        needs=("data",),
        setup=_edit_idx(_swap_sizes),
    ),
    Case(
        "idx-pointer-corrupted",
        ("-m", "tools.build_dataset_index", *TRAIN[1:], "--data-path", "{tmp}/t"),
        1,
        "t.idx is corrupted: the pointer of sequence 3",
        unchanged=("{tmp}",),
        needs=("data",),
        setup=_edit_idx(_bump_pointer),
    ),
    Case(
        "idx-doc-idx-not-monotonic",
        (*TRAIN, "--data-path", "{tmp}/t"),
        2,
        "doc_idx decreases at entry",
        unchanged=("{tmp}",),
        needs=("data",),
        setup=_edit_idx(_unsort_doc_idx),
    ),
    Case(
        "bin-truncated",
        (*TRAIN, "--data-path", "{tmp}/t"),
        2,
        "the pair is inconsistent",
        unchanged=("{tmp}",),
        needs=("data",),
        setup=_truncate_bin,
    ),
    Case(
        "idx-of-another-dataset",
        (*TRAIN, "--data-path", "{tmp}/b"),
        2,
        "b.bin is",
        unchanged=("{tmp}",),
        needs=("data",),
        setup=_swap_idx_files,
    ),
    # ------------------------------------------------------------------------------ --data-path / --split
    Case(
        "data-path-missing-prefix",
        (*TRAIN, "--data-path", "{tmp}/nope"),
        2,
        "nope.bin",
    ),
    Case(
        "data-path-prefix-with-extension",
        (*TRAIN, "--data-path", TINY + ".bin"),
        2,
        "without .bin/.idx",
        needs=("data",),
    ),
    Case(
        "data-path-blend-weight-not-a-number",
        (*TRAIN, "--data-path", "heavy", TINY, "0.5", TINY),
        2,
        "'heavy' is not a weight",
        needs=("data",),
    ),
    Case(
        "data-path-blend-odd-count",
        (*TRAIN, "--data-path", "0.5", TINY, "0.5"),
        2,
        "pairs 'W1 PREFIX1 W2 PREFIX2",
        needs=("data",),
    ),
    Case(
        "data-path-blend-negative-weight",
        (*TRAIN, "--data-path", "-1", TINY, "2", TINY),
        2,
        "must be finite, non-negative",
        needs=("data",),
    ),
    Case(
        "split-not-numbers",
        (*TRAIN, "--data-path", TINY, "--split", "90,abc"),
        2,
        "--split '90,abc' is not a list of numbers",
        needs=("data",),
    ),
    Case(
        "split-too-many-parts",
        (*TRAIN, "--data-path", TINY, "--split", "90,5,3,2"),
        2,
        "has 4 parts",
        needs=("data",),
    ),
    Case(
        "split-all-zero",
        (*TRAIN, "--data-path", TINY, "--split", "0,0,0"),
        2,
        "positive sum",
        needs=("data",),
    ),
]
