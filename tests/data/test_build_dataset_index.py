"""tools/build_dataset_index.py: a configuration whose training set gets no documents is an error naming --split
and the document counts (not "train: no data" and exit 0), found before any index file is written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_builder import MMapIndexedDatasetBuilder
from tools.build_dataset_index import main

RUN = ["--seq-length", "8", "--train-iters", "2", "--global-batch-size", "2", "--eval-iters", "1"]


def _dataset(prefix: Path, docs: int) -> str:
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for d in range(docs):
        builder.add_item(np.arange(d, d + 20, dtype=np.uint16))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.mark.parametrize(
    ("docs", "split", "counts"),
    [
        (0, None, "has 0 document(s) -> train 0, valid 0, test 0"),
        (4, "0,50,50", "has 4 document(s) -> train 0, valid 2, test 2"),
    ],
    ids=["empty-dataset", "split-without-train"],
)
def test_training_set_without_documents(
    tmp_path: Path, capsys, docs: int, split: str | None, counts: str
) -> None:
    prefix = _dataset(tmp_path / "d_text_document", docs)
    cache = tmp_path / "cache"
    split_flags = ["--split", split] if split else []
    rc = main(["--data-path", prefix, *split_flags, *RUN, "--data-cache-path", str(cache)])
    out, err = capsys.readouterr()
    assert rc == 1 and err.count("error:") == 1 and "Traceback" not in err, err
    shown = split or "969, 30, 1"  # Megatron's default --split
    assert (
        f"error: --split {shown!r} gives the training set no documents: {prefix} {counts}." in err
    )
    assert "no data" not in out and not cache.exists()  # refused before anything was built


def test_blend_and_separate_paths(tmp_path: Path, capsys) -> None:
    a = _dataset(tmp_path / "a_text_document", 2)
    empty = _dataset(tmp_path / "e_text_document", 0)
    blend = ["--data-path", "0.5", a, "0.5", empty]
    assert main([*blend, "--split", "0,1,0", *RUN]) == 1
    err = capsys.readouterr().err
    assert f"{a} has 2 document(s) -> train 0, valid 2, test 0; {empty} has 0 document(s)" in err
    assert (
        main([*blend, "--split", "1,0,0", *RUN]) == 0
    )  # one member with training documents is enough
    assert "train: blend of 1 datasets" in capsys.readouterr().out
    assert main(["--valid-data-path", a, *RUN]) == 1
    assert "--valid-data-path/--test-data-path are given without --train-data-path" in (
        capsys.readouterr().err
    )
