"""Bad inputs of Megatron-DeepSpeed's data flags: forced index files (``--train-*-idx-path``) that do not fit."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.badinput.cases import TINY_FLAGS, Case

TRAIN = (
    "pretrain_gpt.py",
    *[f for f in TINY_FLAGS if f != "--mock-data"],
    "--vocab-size",
    "1000",
    "--train-iters",
    "2",
    "--data-path",
    "{ws}/tiny/tiny_text_document",
    "--data-cache-path",
    "{tmp}/cache",
)


def _float_shuffle(tmp: Path, ws: Path) -> None:
    np.save(tmp / "shuffle_idx.npy", np.arange(3.0))


def _short_shuffle(tmp: Path, ws: Path) -> None:
    np.save(tmp / "shuffle_idx.npy", np.arange(5, dtype=np.int64))


CASES: list[Case] = [
    Case(
        "mds-idx-path-missing",
        (*TRAIN, "--train-doc-idx-path", "{tmp}/nope_doc_idx.npy"),
        2,
        "--train-doc-idx-path {tmp}/nope_doc_idx.npy: no such file",
        needs=("data",),
    ),
    Case(
        "mds-idx-path-wrong-dtype",
        (*TRAIN, "--train-shuffle-idx-path", "{tmp}/shuffle_idx.npy"),
        2,
        "shuffle_idx has dtype float64, expected integers",
        unchanged=("{tmp}/shuffle_idx.npy",),
        needs=("data",),
        setup=_float_shuffle,
    ),
    Case(  # one file forced, the others from the index cache: checked by the ranks when they build the data
        "mds-idx-path-short-shuffle-in-ranks",
        (*TRAIN, "--train-shuffle-idx-path", "{tmp}/shuffle_idx.npy"),
        2,
        "shuffle_idx has 5 entries but sample_idx",
        unchanged=("{tmp}/shuffle_idx.npy",),
        needs=("data",),
        setup=_short_shuffle,
    ),
    Case(
        "mds-idx-path-with-mock-data",
        ("pretrain_gpt.py", *TINY_FLAGS, "--train-iters", "2", "--train-doc-idx-path", "x.npy"),
        2,
        "--train-doc-idx-path: only for a .bin/.idx training dataset",
    ),
]
