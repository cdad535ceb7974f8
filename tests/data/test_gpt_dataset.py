"""GPTDataset against a literal NumPy port of Megatron's index algorithm, on real .bin/.idx files.

The reference below is written from the algorithm in shared/reference/megatron-compat.md section 6.3 (Megatron's
loops, ``np.mgrid`` tiling, the 80 % last-epoch rule), deliberately not sharing code with megatron/data.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import pickle
import time
from pathlib import Path

import numpy as np
import pytest

from megatron.config import parse_args
from megatron.data.builders import build_train_valid_test_datasets, get_train_valid_test_num_samples
from megatron.data.gpt_dataset import GPTDataset, GPTIndexSpec, get_train_valid_test_split_
from megatron.data.indexed_builder import make_builder
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.testing import run_distributed

# ----------------------------------------------------------------------------------------------------------------
# Reference: Megatron's _build_index_mappings, step by step.


def ref_num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    epochs, total = 0, 0
    while True:
        epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            return epochs


def ref_doc_idx(documents, num_epochs, rng, separate_last_epoch):
    if not separate_last_epoch or num_epochs == 1:
        doc_idx = np.mgrid[0:num_epochs, 0 : len(documents)][1]
        doc_idx[:] = documents
        doc_idx = doc_idx.reshape(-1).astype(np.int32)
        rng.shuffle(doc_idx)
        return doc_idx
    first = ref_doc_idx(documents, num_epochs - 1, rng, False)
    last = ref_doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def ref_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = np.zeros([num_samples + 1, 2], dtype=np.int64)
    index, doc_offset = 0, 0
    out[0] = (index, doc_offset)
    for s in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[index]] - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                index += 1
                doc_offset = 0
        out[s] = (index, doc_offset)
    return out


def ref_shuffle_idx(num_samples, total_size, rng):
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(0, num_samples, 1, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, 1, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def ref_index_mappings(documents, sizes, num_samples, seq_length, seed):
    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs = ref_num_epochs(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed=seed)
    separate = False
    if num_epochs > 1:
        first_samples = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        last_samples = num_samples - first_samples
        per_epoch = (tokens_per_epoch - 1) // seq_length
        assert 0 <= last_samples <= per_epoch + 1
        separate = last_samples < int(0.80 * per_epoch)
    doc_idx = ref_doc_idx(documents, num_epochs, rng, separate)
    sample_idx = ref_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    n = first_samples if separate else total
    shuffle_idx = ref_shuffle_idx(n, total, rng)
    return doc_idx, sample_idx, shuffle_idx, num_epochs, separate


def ref_split(splits_string: str, size: int) -> list[int]:
    if "," in splits_string:
        splits = [float(s) for s in splits_string.split(",")]
    elif "/" in splits_string:
        splits = [float(s) for s in splits_string.split("/")]
    else:
        splits = [float(splits_string)]
    while len(splits) < 3:
        splits.append(0.0)
    splits = [s / sum(splits) for s in splits[:3]]
    index = [0]
    for i, s in enumerate(splits):
        index.append(index[i] + int(round(s * float(size))))
    diff = index[-1] - size
    for i in range(1, len(index)):
        index[i] -= diff
    return index


# ----------------------------------------------------------------------------------------------------------------
# Fixtures: real files written by the indexed-dataset builder.


def write_corpus(prefix: str, doc_lengths, vocab: int = 1000, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, n) for n in doc_lengths]
    builder = make_builder(prefix + ".bin", impl="mmap", vocab_size=vocab)
    for d in docs:
        builder.add_item(d)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return docs


@pytest.fixture
def corpus(tmp_path: Path):
    rng = np.random.default_rng(42)
    lengths = rng.integers(1, 80, 120)
    lengths[[5, 17, 60]] = 0  # empty documents happen (e.g. blank lines)
    prefix = str(tmp_path / "corpus_text_document")
    docs = write_corpus(prefix, lengths)
    return prefix, docs


def make_ds(
    prefix, documents, num_samples, seq_length, seed, name="train", cache=None, split="969, 30, 1"
):
    spec = GPTIndexSpec(name, prefix, split, num_samples, seq_length, seed)
    return GPTDataset(spec, documents, MMapIndexedDataset(prefix), data_cache_path=cache)


# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seed", "seq_length", "num_samples"),
    [(1234, 16, 50), (1, 7, 900), (7, 33, 1000), (99, 1, 200), (5, 128, 300), (3, 64, 0)],
)
def test_indices_match_megatron_reference(corpus, tmp_path, seed, seq_length, num_samples) -> None:
    prefix, _ = corpus
    sizes = MMapIndexedDataset(prefix).sizes
    documents = np.arange(10, 110, dtype=np.int32)
    ds = make_ds(prefix, documents, num_samples, seq_length, seed)
    doc_idx, sample_idx, shuffle_idx, _, _ = ref_index_mappings(
        documents, sizes, num_samples, seq_length, seed
    )
    assert ds.doc_idx.dtype == np.int32 and np.array_equal(ds.doc_idx, doc_idx)
    assert ds.sample_idx.dtype == np.int64 and np.array_equal(ds.sample_idx, sample_idx)
    assert ds.shuffle_idx.dtype == shuffle_idx.dtype and np.array_equal(ds.shuffle_idx, shuffle_idx)
    assert len(ds) == len(shuffle_idx) >= num_samples


def test_separate_last_epoch_on_both_sides_of_the_80_percent_threshold(corpus) -> None:
    prefix, _ = corpus
    sizes = MMapIndexedDataset(prefix).sizes
    documents = np.arange(0, 120, dtype=np.int32)
    seq_length = 10
    tpe = int(sizes[documents].sum())
    per_epoch = (tpe - 1) // seq_length
    first = (2 * tpe - 1) // seq_length  # samples of the first 2 epochs -> 3 epochs in total
    threshold = int(0.80 * per_epoch)
    seen = {}
    for last in (1, threshold - 1, threshold, threshold + 1, per_epoch):
        n = first + last
        doc_idx, sample_idx, shuffle_idx, epochs, separate = ref_index_mappings(
            documents, sizes, n, seq_length, 2024
        )
        assert epochs == 3
        assert separate == (last < threshold)
        seen[separate] = True
        ds = make_ds(prefix, documents, n, seq_length, 2024)
        assert np.array_equal(ds.doc_idx, doc_idx)
        assert np.array_equal(ds.sample_idx, sample_idx)
        assert np.array_equal(ds.shuffle_idx, shuffle_idx)
        if separate:
            # The last epoch is shuffled on its own, and so are the samples after the first two epochs.
            assert sorted(ds.doc_idx[-len(documents) :]) == list(documents)
            assert int(ds.shuffle_idx[:first].max()) == first - 1
            assert sorted(ds.shuffle_idx[first:]) == list(range(first, len(ds)))
    assert seen == {True: True, False: True}


def test_items_are_overlapping_windows_of_the_shuffled_stream(corpus) -> None:
    prefix, docs = corpus
    documents = np.arange(3, 100, dtype=np.int32)
    seq_length = 24
    ds = make_ds(prefix, documents, 400, seq_length, 11)
    stream = np.concatenate([docs[d] for d in ds.doc_idx])
    for i in [0, 1, 2, 57, len(ds) // 2, len(ds) - 1]:
        item = ds[i]
        assert set(item) == {"text"}
        text = item["text"]
        assert text.dtype == np.int64 and text.shape == (seq_length + 1,)
        j = int(ds.shuffle_idx[i])
        assert np.array_equal(text, stream[j * seq_length : j * seq_length + seq_length + 1])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_split_string_matches_megatron() -> None:
    assert get_train_valid_test_split_("969, 30, 1", 1000) == [0, 969, 999, 1000]
    assert get_train_valid_test_split_("98/2/0", 50) == [0, 49, 50, 50]
    assert get_train_valid_test_split_("1", 7) == [0, 7, 7, 7]
    rng = np.random.default_rng(3)
    for _ in range(300):
        parts = rng.integers(0, 20, rng.integers(1, 4)).tolist()
        if sum(parts) == 0:
            continue
        text = rng.choice([",", "/", ", "]).join(str(p) for p in parts)
        size = int(rng.integers(1, 5000))
        assert get_train_valid_test_split_(text, size) == ref_split(text, size), (text, size)


@pytest.mark.parametrize(
    ("split", "match"),
    [
        ("train,valid", "not a list of numbers"),
        ("", "not a list of numbers"),
        ("1,2,3,4", "at most 3"),
        ("-1,2,3", "non-negative"),
        ("0,0,0", "positive sum"),
    ],
)
def test_bad_split_strings(split: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_train_valid_test_split_(split, 100)


def test_cache_files_follow_megatron_naming_and_are_reused(corpus, tmp_path) -> None:
    prefix, _ = corpus
    documents = np.arange(0, 100, dtype=np.int32)
    ds = make_ds(prefix, documents, 300, 16, 1234, split="969, 30, 1")
    tpe = int(MMapIndexedDataset(prefix).sizes[documents].sum())
    epochs = ref_num_epochs(tpe, 16, 300)
    desc = (
        f"GPT Dataset\n\nData prefix {prefix}\nDataset name train\nNumber of samples 300\n"
        f"Number of epochs {epochs}\nSequence length 16\nRandom seed 1234\nSplit 969, 30, 1\n"
    )
    assert ds.desc == desc
    h = hashlib.md5(desc.encode("utf-8")).hexdigest()
    cache = tmp_path / "index-cache"
    names = {f"{h}.dsc", f"{h}_doc_idx.npy", f"{h}_sample_idx.npy", f"{h}_shuffle_idx.npy"}
    assert set(os.listdir(cache)) == names
    # Megatron's description, then the dataset identity and the array checksums (Megatron never reads the .dsc).
    dsc = (cache / f"{h}.dsc").read_text()
    assert dsc.startswith(desc)
    assert (
        dsc[len(desc) :].splitlines()[0]
        == "Trident dataset " + MMapIndexedDataset(prefix).content_id
    )
    # A second dataset memory-maps the cached arrays instead of rebuilding.
    before = {n: (cache / n).stat().st_mtime_ns for n in names}
    again = make_ds(prefix, documents, 300, 16, 1234, split="969, 30, 1")
    assert isinstance(again.sample_idx, np.memmap) and not again.sample_idx.flags.writeable
    assert {n: (cache / n).stat().st_mtime_ns for n in names} == before
    assert np.array_equal(again.shuffle_idx, ds.shuffle_idx)
    # Pickled (spawned loader workers) by cache path, not by value; the copy re-maps the same files.
    blob = pickle.dumps(again)
    assert len(blob) < again.sample_idx.nbytes
    clone = pickle.loads(blob)
    assert isinstance(clone.shuffle_idx, np.memmap) and np.array_equal(
        clone[5]["text"], again[5]["text"]
    )
    # With --data-cache-path and no cache beside the data, the arrays go to --data-cache-path.
    other = tmp_path / "elsewhere"
    make_ds(prefix, documents, 301, 16, 1234, cache=str(other))
    assert len([n for n in os.listdir(other) if n.endswith(".dsc")]) == 1
    assert len([n for n in os.listdir(cache) if n.endswith(".dsc")]) == 1


@pytest.mark.parametrize(
    "damage", ["truncate", "garbage", "wrong_desc", "missing_one", "wrong_shape"]
)
def test_damaged_cache_is_detected_and_rebuilt(corpus, tmp_path, caplog, damage) -> None:
    prefix, _ = corpus
    documents = np.arange(0, 100, dtype=np.int32)
    good = make_ds(prefix, documents, 200, 8, 5)
    expected = {k: np.array(getattr(good, k)) for k in ("doc_idx", "sample_idx", "shuffle_idx")}
    cache = tmp_path / "index-cache"
    h = hashlib.md5(good.desc.encode()).hexdigest()
    target = cache / f"{h}_sample_idx.npy"
    if damage == "truncate":  # what a crash in Megatron's non-atomic np.save leaves behind
        target.write_bytes(target.read_bytes()[:-40])
    elif damage == "garbage":
        target.write_bytes(b"not a numpy file at all")
    elif damage == "wrong_desc":
        (cache / f"{h}.dsc").write_text("GPT Dataset\n\nsomething else\n")
    elif damage == "missing_one":
        (cache / f"{h}_doc_idx.npy").unlink()
    else:
        np.save(target, np.zeros((3, 2), dtype=np.int64))
    with caplog.at_level(logging.WARNING, logger="megatron.data.index_cache"):
        rebuilt = make_ds(prefix, documents, 200, 8, 5)
    if damage != "missing_one":
        assert "rebuilding" in caplog.text
    for k, v in expected.items():
        assert np.array_equal(getattr(rebuilt, k), v)
    assert sorted(os.listdir(cache)) == sorted(
        [f"{h}.dsc", f"{h}_doc_idx.npy", f"{h}_sample_idx.npy", f"{h}_shuffle_idx.npy"]
    )
    # The repaired files are complete and valid on their own.
    assert np.array_equal(np.load(target), expected["sample_idx"])


def test_unwritable_cache_falls_back_to_memory(corpus, tmp_path, caplog) -> None:
    prefix, _ = corpus
    blocker = tmp_path / "index-cache"
    blocker.write_text("a file where the cache directory should be")
    with caplog.at_level(logging.WARNING, logger="megatron.data.index_cache"):
        ds = make_ds(prefix, np.arange(0, 50, dtype=np.int32), 100, 8, 1)
    assert "--data-cache-path" in caplog.text
    assert len(ds) >= 100 and ds[0]["text"].shape == (9,)


def _concurrent_build(prefix: str, workdir: str, world: int) -> dict:
    # File barrier so every process misses the cache and builds at the same moment.
    rank = int(os.environ["RANK"])
    Path(workdir, f"ready.{rank}").touch()
    while len([n for n in os.listdir(workdir) if n.startswith("ready.")]) < world:
        time.sleep(0.001)
    cache = Path(prefix).parent / "index-cache"
    missed = not cache.is_dir() or not os.listdir(cache)
    documents = np.arange(0, 400, dtype=np.int32)
    ds = make_ds(prefix, documents, 20000, 16, 77)
    return {
        k: hashlib.md5(np.ascontiguousarray(getattr(ds, k)).tobytes()).hexdigest()
        for k in ("doc_idx", "sample_idx", "shuffle_idx")
    } | {"first": ds[0]["text"].tolist(), "missed": missed}


def test_concurrent_builds_from_many_processes_are_safe(tmp_path) -> None:
    prefix = str(tmp_path / "big_text_document")
    write_corpus(prefix, np.random.default_rng(1).integers(1, 400, 400))
    work = tmp_path / "barrier"
    work.mkdir()
    results = run_distributed(
        _concurrent_build, 3, prefix, str(work), 3, init_process_group=False, timeout=120
    )
    # At least two processes found no cache and built at the same time; all ended with the same arrays.
    assert sum(r.pop("missed") for r in results) >= 2
    assert all(r == results[0] for r in results)
    cache = tmp_path / "index-cache"
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and not [f for f in files if f.endswith(".tmp") or f.startswith(".")]
    # What is on disk is complete and equals what every process used.
    h = files[0].split(".")[0].split("_")[0]
    for k in ("doc_idx", "sample_idx", "shuffle_idx"):
        arr = np.load(cache / f"{h}_{k}.npy")
        assert hashlib.md5(np.ascontiguousarray(arr).tobytes()).hexdigest() == results[0][k]
    docs = np.arange(0, 400, dtype=np.int32)
    ref = ref_index_mappings(docs, MMapIndexedDataset(prefix).sizes, 20000, 16, 77)
    assert hashlib.md5(ref[1].tobytes()).hexdigest() == results[0]["sample_idx"]


def test_bad_dataset_arguments(corpus) -> None:
    prefix, _ = corpus
    with pytest.raises(ValueError, match=r"documents must be a non-empty set of ids in \[0, 120\)"):
        make_ds(prefix, np.arange(100, 130, dtype=np.int32), 10, 8, 1)
    with pytest.raises(ValueError, match="non-empty"):
        make_ds(prefix, np.arange(0, 0, dtype=np.int32), 10, 8, 1)
    with pytest.raises(ValueError, match="a sample needs at least 2"):
        make_ds(prefix, np.array([5, 17], dtype=np.int32), 10, 8, 1)  # two empty documents
    with pytest.raises(ValueError, match="num_samples must be >= 0"):
        make_ds(prefix, np.arange(0, 10, dtype=np.int32), -1, 8, 1)
    with pytest.raises(ValueError, match="--seq-length must be >= 1"):
        make_ds(prefix, np.arange(0, 10, dtype=np.int32), 10, 0, 1)
    with pytest.raises(ValueError, match="not a sensible request"):
        make_ds(prefix, np.arange(0, 10, dtype=np.int32), 10**12, 2048, 1)


# ----------------------------------------------------------------------------------------------------------------
# Builders: what the trainer calls.


def test_num_samples_follow_megatron() -> None:
    assert get_train_valid_test_num_samples(
        train_iters=1000, train_samples=None, global_batch_size=8, eval_interval=100, eval_iters=10
    ) == (8000, (1000 // 100 + 1) * 10 * 8, 80)
    assert get_train_valid_test_num_samples(
        train_iters=None, train_samples=1000, global_batch_size=8, eval_interval=50, eval_iters=2
    ) == (1000, (125 // 50 + 1) * 2 * 8, 16)
    with pytest.raises(ValueError, match="exactly one of --train-iters and --train-samples"):
        get_train_valid_test_num_samples(
            train_iters=None, train_samples=None, global_batch_size=8, eval_interval=1, eval_iters=1
        )


def test_single_prefix_is_split_into_three_contiguous_ranges(corpus) -> None:
    prefix, _ = corpus
    cfg = parse_args(["--data-path", prefix, "--split", "80,15,5"]).data
    train, valid, test = build_train_valid_test_datasets(
        cfg, seq_length=16, seed=3, train_valid_test_num_samples=(100, 20, 5)
    )
    bounds = ref_split("80,15,5", 120)
    for ds, lo, hi, name in zip(
        (train, valid, test), bounds, bounds[1:], ("train", "valid", "test")
    ):
        assert ds.name == name and set(np.unique(ds.doc_idx)) <= set(range(lo, hi))
        assert f"Dataset name {name}\n" in ds.desc and "Split 80,15,5\n" in ds.desc
    direct = make_ds(
        prefix, np.arange(bounds[0], bounds[1], dtype=np.int32), 100, 16, 3, split="80,15,5"
    )
    assert np.array_equal(train.shuffle_idx, direct.shuffle_idx)
    # An empty split gives None, as in Megatron.
    cfg = parse_args(["--data-path", prefix, "--split", "100,0,0"]).data
    train, valid, test = build_train_valid_test_datasets(
        cfg, seq_length=16, seed=3, train_valid_test_num_samples=(10, 10, 10)
    )
    assert train is not None and valid is None and test is None


def test_blend_gives_each_dataset_its_megatron_share(tmp_path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_corpus(a, [50] * 40, seed=1)
    write_corpus(b, [30] * 60, seed=2)
    cfg = parse_args(["--data-path", "0.25", a, "0.75", b, "--split", "90,10,0"]).data
    counts = (400, 40, 0)
    train, valid, test = build_train_valid_test_datasets(
        cfg, seq_length=8, seed=9, train_valid_test_num_samples=counts
    )
    assert test is None
    for ds, n in ((train, 400), (valid, 40)):
        per = [math.ceil(n * w * 1.005) for w in (0.25, 0.75)]
        assert len(ds) == sum(per)
        assert [d.desc.split("Number of samples ")[1].split("\n")[0] for d in ds.datasets] == [
            str(p) for p in per
        ]
        item = ds[3]
        assert set(item) == {"dataset_idx", "text"} and item["text"].shape == (9,)


def test_separate_train_valid_test_paths_ignore_split(tmp_path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_corpus(a, [20] * 30, seed=1)
    write_corpus(b, [20] * 10, seed=2)
    cfg = parse_args(["--train-data-path", a, "--valid-data-path", "1", a, "3", b]).data
    train, valid, test = build_train_valid_test_datasets(
        cfg, seq_length=8, seed=9, train_valid_test_num_samples=(50, 20, 5)
    )
    assert test is None
    assert sorted(np.unique(train.doc_idx)) == list(range(30))  # the whole file
    assert len(valid) == math.ceil(20 * 0.25 * 1.005) + math.ceil(20 * 0.75 * 1.005)


def test_mock_data_is_deterministic() -> None:
    cfg = parse_args(["--mock-data", "--vocab-size", "97"]).data
    train, valid, test = build_train_valid_test_datasets(
        cfg, seq_length=12, seed=5, train_valid_test_num_samples=(30, 6, 0)
    )
    assert len(train) == 30 and len(valid) == 6 and test is None
    again, _, _ = build_train_valid_test_datasets(
        cfg, seq_length=12, seed=5, train_valid_test_num_samples=(30, 6, 0)
    )
    for i in (0, 7, 29):
        t = train[i]["text"]
        assert t.dtype == np.int64 and t.shape == (13,) and t.min() >= 0 and t.max() < 97
        assert np.array_equal(t, again[i]["text"])
    assert not np.array_equal(train[0]["text"], valid[0]["text"])
    other, _, _ = build_train_valid_test_datasets(
        cfg, seq_length=12, seed=6, train_valid_test_num_samples=(30, 6, 0)
    )
    assert any(not np.array_equal(train[i]["text"], other[i]["text"]) for i in range(30))


@pytest.mark.parametrize(
    ("argv", "exc", "match"),
    [
        (["--data-path", "0.5", "A", "0.5"], ValueError, "one PREFIX or pairs"),
        (["--data-path", "A", "0.5", "B", "0.5"], ValueError, "'A' is not a weight"),
        (["--data-path", "0", "A", "0", "B"], ValueError, "sum to more than 0"),
        (["--data-path", "0", "A", "1", "B"], ValueError, "weight 0 for 'A'; remove it"),
        (["--data-path", "-1", "A", "2", "B"], ValueError, "non-negative"),
        (["--data-path", "MISSING"], FileNotFoundError, r"--data-path: dataset prefix .*MISSING"),
        (["--data-path", "1", "EXISTS", "1", "MISSING"], FileNotFoundError, "MISSING.bin"),
        (["--train-data-path", "MISSING"], FileNotFoundError, "--train-data-path"),
        (["--data-path", "EXISTS", "--split", "a,b"], ValueError, "--split 'a,b'"),
        (
            ["--data-path", "EXISTS", "--train-data-path", "EXISTS"],
            ValueError,
            "exactly one data source",
        ),
        ([], ValueError, "exactly one data source"),
        (["--mock-data"], ValueError, "--mock-data needs a vocabulary size"),
    ],
)
def test_bad_data_flags_are_reported_by_name(tmp_path, argv, exc, match) -> None:
    exists = str(tmp_path / "exists")
    write_corpus(exists, [10] * 5)
    argv = [exists if a == "EXISTS" else str(tmp_path / a) if a == "MISSING" else a for a in argv]
    cfg = parse_args(argv).data
    with pytest.raises(exc, match=match):
        build_train_valid_test_datasets(
            cfg, seq_length=8, seed=1, train_valid_test_num_samples=(10, 2, 2)
        )


def test_build_dataset_index_tool_prebuilds_what_the_trainer_loads(
    corpus, tmp_path, capsys
) -> None:
    from tools.build_dataset_index import main

    prefix, _ = corpus
    cache = tmp_path / "prebuilt"
    flags = [
        "--data-path",
        prefix,
        "--split",
        "90,8,2",
        "--seq-length",
        "16",
        "--seed",
        "7",
        "--train-iters",
        "30",
        "--global-batch-size",
        "4",
        "--eval-interval",
        "10",
        "--eval-iters",
        "2",
        "--data-cache-path",
        str(cache),
    ]
    assert main(flags + ["--num-layers", "12"]) == 0  # model flags of the run are accepted
    out = capsys.readouterr().out
    assert "sample targets: train 120, valid 32, test 8" in out
    files = sorted(os.listdir(cache))
    assert len(files) == 12  # 3 splits x (.dsc + 3 arrays)
    stamps = {f: (cache / f).stat().st_mtime_ns for f in files}
    # The trainer's call with the same flags finds every file and rebuilds nothing.
    cfg = parse_args(flags)
    train, valid, test = build_train_valid_test_datasets(
        cfg.data, seq_length=16, seed=7, train_valid_test_num_samples=(120, 32, 8)
    )
    assert all(ds.cache_dir == str(cache) for ds in (train, valid, test))
    assert {f: (cache / f).stat().st_mtime_ns for f in os.listdir(cache)} == stamps
    # Errors: one line on stderr, exit code 1.
    assert main(["--data-path", prefix, "--train-iters", "3"]) == 1
    assert "--global-batch-size is required" in capsys.readouterr().err
    assert (
        main(
            [
                "--data-path",
                str(tmp_path / "nope"),
                "--train-iters",
                "3",
                "--global-batch-size",
                "2",
            ]
        )
        == 1
    )
    assert "not found" in capsys.readouterr().err


def test_a_broken_set_beside_the_data_does_not_hide_a_valid_one(corpus, tmp_path) -> None:
    prefix, _ = corpus
    documents = np.arange(0, 60, dtype=np.int32)
    other = tmp_path / "shared-cache"
    ds = make_ds(prefix, documents, 100, 8, 2, cache=str(other))
    assert ds.cache_dir == str(other)
    h = hashlib.md5(ds.desc.encode()).hexdigest()
    beside = tmp_path / "index-cache"
    beside.mkdir(exist_ok=True)
    (beside / f"{h}.dsc").write_text(ds.desc)  # a lone .dsc, e.g. from an interrupted copy
    again = make_ds(prefix, documents, 100, 8, 2, cache=str(other))
    assert again.cache_dir == str(other) and os.listdir(beside) == [f"{h}.dsc"]
