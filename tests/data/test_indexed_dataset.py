"""MMapIndexedDataset: exact bytes against a hand-computed fixture, an independent writer, and every bad file."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_builder import MMapIndexedDatasetBuilder, make_builder
from megatron.data.indexed_dataset import (
    MDSEodWarning,
    MMapIndexedDataset,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
    make_dataset,
)


def _hand_written_idx() -> bytes:
    # Two documents: doc 0 = sentences [5, 6, 7] and [8]; doc 1 = [9, 10]. uint16 tokens (code 8).
    # N = 3 sequences, D = 3 doc_idx entries; pointers are byte offsets 0, 6, 8.
    return (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", 8)
        + struct.pack("<Q", 3)
        + struct.pack("<Q", 3)
        + struct.pack("<3i", 3, 1, 2)
        + struct.pack("<3q", 0, 6, 8)
        + struct.pack("<3q", 0, 2, 3)
    )


def test_builder_writes_the_exact_bytes(tmp_path: Path) -> None:
    prefix = str(tmp_path / "ds")
    builder = make_builder(data_file_path(prefix), impl="mmap", vocab_size=50257)
    builder.add_item(np.array([5, 6, 7]))
    builder.add_item([8])
    builder.end_document()
    builder.add_doc(np.array([9, 10]), [2])
    builder.finalize(index_file_path(prefix))
    idx = Path(index_file_path(prefix)).read_bytes()
    assert idx == _hand_written_idx()
    assert len(idx) == 34 + 12 * 3 + 8 * 3
    assert Path(data_file_path(prefix)).read_bytes() == struct.pack("<6H", 5, 6, 7, 8, 9, 10)
    # No temporary file is left behind.
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]


def test_reads_an_independently_written_file(tmp_path: Path) -> None:
    # A writer from the format table alone (not our builder): int32 tokens, 4 one-sequence documents.
    docs = [[1, 2, 3, 4], [70000], [], [-5, 6]]
    sizes = [len(d) for d in docs]
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]) * 4
    with open(tmp_path / "x.bin", "wb") as f:
        for d in docs:
            f.write(struct.pack(f"<{len(d)}i", *d))
    with open(tmp_path / "x.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, 4, 5))
        f.write(struct.pack("<4i", *sizes) + struct.pack("<4q", *pointers))
        f.write(struct.pack("<5q", 0, 1, 2, 3, 4))
    ds = make_dataset(str(tmp_path / "x"), impl="infer", skip_warmup=False)
    assert len(ds) == 4 and ds.dtype == np.int32
    assert (
        ds.sizes.dtype == np.int32
        and ds.pointers.dtype == np.int64
        and ds.doc_idx.dtype == np.int64
    )
    assert ds.sizes.tolist() == sizes and ds.pointers.tolist() == pointers.tolist()
    assert ds.doc_idx.tolist() == [0, 1, 2, 3, 4]
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d
    assert ds[-1].tolist() == [-5, 6]
    assert [a.tolist() for a in ds[1:4]] == docs[1:4]
    assert ds[3:1] == []
    assert ds.get(0, offset=1, length=2).tolist() == [2, 3]
    assert ds.get(0, offset=2).tolist() == [3, 4]
    # Zero-copy: views into the memory map, read-only.
    assert not ds[0].flags.writeable and not ds[0].flags.owndata
    assert MMapIndexedDataset.exists(str(tmp_path / "x"))
    assert not MMapIndexedDataset.exists(str(tmp_path / "y"))
    again = pickle.loads(pickle.dumps(ds))
    assert again[0].tolist() == [1, 2, 3, 4]
    with pytest.raises(IndexError, match="out of range"):
        ds[4]
    with pytest.raises(IndexError, match="outside sequence 0 of 4 tokens"):
        ds.get(0, offset=3, length=2)
    with pytest.raises(ValueError, match="step 1"):
        ds[0:4:2]


def test_builder_round_trip_merge_and_dtypes(tmp_path: Path) -> None:
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(None) == np.int32
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 100_000, size=int(n)) for n in rng.integers(0, 50, size=40)]
    parts = []
    for p in range(2):
        prefix = str(tmp_path / f"part{p}")
        b = make_builder(data_file_path(prefix), vocab_size=100_000)
        chunk = docs[p * 20 : (p + 1) * 20]
        b.add_documents(np.concatenate(chunk).astype(np.int32), np.array([len(d) for d in chunk]))
        b.finalize(index_file_path(prefix))
        parts.append(prefix)
    out = str(tmp_path / "merged")
    b = MMapIndexedDatasetBuilder(data_file_path(out), dtype=np.int32)
    for p in parts:
        b.merge_file_(p)
    b.finalize(index_file_path(out))
    ds = MMapIndexedDataset(out)
    assert len(ds) == 40 and ds.doc_idx.tolist() == list(range(41))
    for i, d in enumerate(docs):
        assert np.array_equal(ds[i], d)
    bad = MMapIndexedDatasetBuilder(str(tmp_path / "u16.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="its dtype is int32, this builder writes uint16"):
        bad.merge_file_(parts[0])
    with pytest.raises(ValueError, match=r"token id range \[0, 70000\] does not fit .* uint16"):
        bad.add_item([0, 70000])
    bad.abort()
    with pytest.raises(ValueError, match="only 'mmap'"):
        make_builder(str(tmp_path / "l.bin"), impl="lazy")
    assert not list(tmp_path.glob("*.tmp"))


def _small(tmp_path: Path, docs: list[list[int]]) -> str:
    prefix = str(tmp_path / "s")
    b = MMapIndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
    for d in docs:
        b.add_item(d)
        b.end_document()
    b.finalize(index_file_path(prefix))
    return prefix


def test_bad_files_fail_with_clear_messages(tmp_path: Path) -> None:
    prefix = _small(tmp_path, [[1, 2], [3]])
    idx = Path(index_file_path(prefix))
    good = idx.read_bytes()
    with pytest.raises(FileNotFoundError, match="nope.idx not found"):
        MMapIndexedDataset(str(tmp_path / "nope"))
    idx.write_bytes(b"TNTIDX\x00\x00" + good[8:])
    with pytest.raises(ValueError, match="magic .* legacy lazy/cached"):
        MMapIndexedDataset(prefix)
    idx.write_bytes(good[:9] + struct.pack("<Q", 2) + good[17:])
    with pytest.raises(ValueError, match="index version 2 is not supported"):
        MMapIndexedDataset(prefix)
    idx.write_bytes(good[:17] + b"\x09" + good[18:])
    with pytest.raises(ValueError, match="unknown dtype code 9"):
        MMapIndexedDataset(prefix)
    idx.write_bytes(good[:20])
    with pytest.raises(ValueError, match="truncated: 20 bytes, shorter than the 34-byte header"):
        MMapIndexedDataset(prefix)
    idx.write_bytes(good[:-8])
    with pytest.raises(ValueError, match=r"s.idx is truncated: 74 bytes.*requires .* = 82 bytes"):
        MMapIndexedDataset(prefix)
    idx.write_bytes(good)
    bin_path = Path(data_file_path(prefix))
    bin_path.write_bytes(bin_path.read_bytes()[:4])
    with pytest.raises(ValueError, match=r"s.bin is 4 bytes, but .*s.idx says 6 bytes"):
        MMapIndexedDataset(prefix)
    os.remove(bin_path)
    with pytest.raises(FileNotFoundError, match="data file .*s.bin not found"):
        MMapIndexedDataset(prefix)


def test_mds_eod_bug_is_a_warning(tmp_path: Path) -> None:
    # Megatron-DeepSpeed --append-eod: EOD (99) in .bin, sizes without it.
    prefix = _small(tmp_path, [[1, 2], [3]])
    Path(data_file_path(prefix)).write_bytes(struct.pack("<5H", 1, 2, 99, 3, 99))
    with pytest.warns(MDSEodWarning, match="one extra token per document \\(2 documents\\)"):
        ds = MMapIndexedDataset(prefix)
    assert ds[0].tolist() == [1, 2] and ds[1].tolist() == [99]
