"""Megatron-DeepSpeed's data flags: ``--train-{doc,sample,shuffle}-idx-path``, ``--train-data-exact-num-epochs``,
``--return-data-index`` (issue #11 item 6), through the parser and ``build_train_valid_test_datasets``."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from megatron.config import parse_args
from megatron.data.builders import build_train_valid_test_datasets
from megatron.data.indexed_builder import make_builder

SEQ = 16
COUNTS = (60, 8, 4)


def _corpus(tmp_path: Path, name: str = "corpus_text_document", seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    prefix = str(tmp_path / name)
    builder = make_builder(prefix + ".bin", impl="mmap", vocab_size=500)
    for n in rng.integers(1, 60, 80):
        builder.add_item(rng.integers(0, 500, n))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def _train(argv: list[str], seq: int = SEQ, counts=COUNTS):
    cfg = parse_args(argv).data
    return build_train_valid_test_datasets(
        cfg, seq_length=seq, seed=7, train_valid_test_num_samples=counts
    )[0]


def _samples(ds) -> np.ndarray:
    return np.stack([ds[i]["text"] for i in range(len(ds))])


def _export(ds, out: Path) -> dict[str, str]:
    """Our builder's cached index arrays, copied under new names (as a user keeps Megatron's files)."""
    out.mkdir(exist_ok=True)
    files = {}
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        files[name] = str(out / f"run1_{name}.npy")
        np.save(files[name], np.asarray(getattr(ds, name)))
    return files


def _flags(files: dict[str, str]) -> list[str]:
    return [a for name, p in files.items() for a in (f"--train-{name.replace('_', '-')}-path", p)]


def test_forced_index_files_give_the_built_samples(tmp_path) -> None:
    prefix = _corpus(tmp_path)
    base = ["--data-path", prefix, "--split", "90,7,3"]
    built = _train(base)
    files = _export(built, tmp_path / "exported")
    shutil.rmtree(tmp_path / "index-cache")  # nothing to fall back on: the files alone must do
    forced = _train(base + _flags(files))
    assert forced.cache_dir is None
    assert not [
        p for p in (tmp_path / "index-cache").glob("*.dsc") if "name train" in p.read_text()
    ]
    np.testing.assert_array_equal(_samples(forced), _samples(built))
    # DataLoader workers started with "spawn" re-map the forced files.
    clone = pickle.loads(pickle.dumps(forced))
    np.testing.assert_array_equal(_samples(clone), _samples(built))
    assert Path(clone.shuffle_idx.filename).name == "run1_shuffle_idx.npy"

    # One file forced, the rest from the cache: a reversed shuffle_idx reverses the order.
    np.save(files["shuffle_idx"], np.asarray(built.shuffle_idx)[::-1].copy())
    partial = _train(base + ["--train-shuffle-idx-path", files["shuffle_idx"]])
    np.testing.assert_array_equal(_samples(partial), _samples(built)[::-1])
    # Megatron's lookup: a bare file name is found in the index-cache directory beside the data.
    cache = tmp_path / "index-cache"
    shutil.copy(files["doc_idx"], cache / "mine_doc_idx.npy")
    bare = _train(base + ["--train-doc-idx-path", "mine_doc_idx.npy"])
    np.testing.assert_array_equal(_samples(bare), _samples(built))


def test_bad_index_files_fail_with_one_clear_error(tmp_path) -> None:
    prefix = _corpus(tmp_path)
    base = ["--data-path", prefix, "--split", "90,7,3"]
    files = _export(_train(base, seq=8), tmp_path / "seq8")  # built for another --seq-length
    with pytest.raises(
        ValueError,
        match=r"run1_sample_idx.npy: sample_idx sample 0 spans 8 tokens.*--seq-length 16",
    ):
        _train(base + _flags(files))
    good = _export(_train(base), tmp_path / "good")
    cases = {
        "shuffle_idx": (np.arange(5, dtype=np.int64), r"shuffle_idx has 5 entries but sample_idx"),
        "doc_idx": (
            np.array([0, 1, 10_000], dtype=np.int32),
            r"doc_idx holds document ids outside \[0, 80\)",
        ),
        "sample_idx": (np.zeros((4, 2), dtype=np.float32), r"sample_idx has dtype float32"),
    }
    for name, (array, match) in cases.items():
        bad = dict(good)
        bad[name] = str(tmp_path / f"bad_{name}.npy")
        np.save(bad[name], array)
        flag = f"--train-{name.replace('_', '-')}-path"
        with pytest.raises(ValueError, match=rf"{flag} .*bad_{name}.npy: {match}"):
            _train(base + _flags(bad))
    with pytest.raises(ValueError, match=r"describe \d+ training samples but the run draws 100000"):
        _train(base + _flags(good), counts=(100_000, 8, 4))
    with pytest.raises(FileNotFoundError, match=r"--train-doc-idx-path nope.npy: no such file"):
        _train(base + ["--train-doc-idx-path", "nope.npy"])
    with pytest.raises(ValueError, match=r"--train-doc-idx-path: only for a .bin/.idx training"):
        _train(["--mock-data", "--vocab-size", "64", "--train-doc-idx-path", good["doc_idx"]])
    other = _corpus(tmp_path, "other_text_document", seed=1)
    with pytest.raises(ValueError, match=r"indices of ONE training dataset.*blends 2"):
        _train(["--data-path", "1", prefix, "1", other, "--train-doc-idx-path", good["doc_idx"]])


def test_exact_num_epochs_and_return_data_index(tmp_path) -> None:
    prefix = _corpus(tmp_path)
    base = ["--train-data-path", prefix]
    default = _train(base)
    tokens = int(default.indexed_dataset.sizes.sum())
    assert "Number of epochs 1\n" in default.desc  # 60 samples of 16 fit in one epoch
    same = _train(base + ["--train-data-exact-num-epochs", "1"])
    np.testing.assert_array_equal(_samples(same), _samples(default))
    three = _train(base + ["--train-data-exact-num-epochs", "3", "--return-data-index"])
    assert "Number of epochs 3\n" in three.desc and len(three) == (3 * tokens - 1) // SEQ
    assert (
        np.bincount(np.asarray(three.doc_idx)).tolist() == [3] * 80
    )  # every document exactly 3 times
    item = three[5]
    assert item["index"].dtype == np.int64 and item["index"].tolist() == [5]
    assert "index" not in default[5]
    needed = 3 * tokens // SEQ  # more than two epochs hold
    with pytest.raises(
        ValueError, match=r"--train-data-exact-num-epochs 2: .* use at least 3 epochs"
    ):
        _train(base + ["--train-data-exact-num-epochs", "2"], counts=(needed, 8, 4))
