"""Issue #15, data part: a stale or damaged index cache is rebuilt, an inconsistent ``.idx`` is one error naming
the file, and no tool writes over an input reached through another path (a symlinked directory)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.data.gpt_dataset import GPTDataset, GPTIndexSpec, compute_gpt_indices
from megatron.data.indexed_builder import make_builder
from megatron.data.indexed_dataset import HEADER_SIZE, MMapIndexedDataset
from megatron.data.preprocess import Execution, PreprocessError, merge_datasets, preprocess

ROOT = Path(__file__).resolve().parents[2]
NULL_TOKENIZER = {"tokenizer_type": "NullTokenizer", "vocab_size": 1000}
INDEX_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")


def _jsonl(path: Path, docs: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"text": " ".join(map(str, d))}) + "\n" for d in docs))
    return path


def _preprocess(tmp: Path, docs: list[list[int]], prefix: Path) -> str:
    src = _jsonl(tmp / "in.jsonl", docs)
    preprocess(
        [str(src)],
        json_keys=["text"],
        output_prefix=str(prefix),
        tokenizer_kwargs=NULL_TOKENIZER,
        execution=Execution(log_interval=10**9),
    )
    return str(prefix) + "_text_document"


def _dataset(prefix: str, cache: str | None = None, num_samples: int = 150) -> GPTDataset:
    indexed = MMapIndexedDataset(prefix)
    documents = np.arange(len(indexed), dtype=np.int32)
    spec = GPTIndexSpec("train", prefix, "100,0,0", num_samples, 8, 1234)
    return GPTDataset(spec, documents, indexed, data_cache_path=cache)


def _rows(ds: GPTDataset) -> np.ndarray:
    return np.stack([ds[i]["text"] for i in range(len(ds))])


def _rebuild_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "megatron.data.index_cache"]


def test_stale_or_overwritten_index_cache_is_rebuilt(tmp_path: Path, caplog) -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 999, int(n)).tolist() for n in rng.integers(3, 40, 60)]
    data = tmp_path / "data"
    data.mkdir()
    prefix = _preprocess(tmp_path, docs, data / "c")
    first = _rows(_dataset(prefix))

    # Same prefix, same token total, documents reordered: the old index-cache/ must not be reused.
    _preprocess(tmp_path, docs[::-1], data / "c")
    caplog.set_level(logging.INFO)
    caplog.clear()
    again = _dataset(prefix)
    ref = compute_gpt_indices(
        np.arange(60, dtype=np.int32), again.indexed_dataset.sizes, 150, 8, 1234
    )
    for name in INDEX_NAMES:
        assert np.array_equal(getattr(again, name), ref[name]), name
    assert not np.array_equal(_rows(again), first)
    lines = _rebuild_lines(caplog)
    assert len(lines) == 1 and "rebuilding" in lines[0] and "index-cache" in lines[0], lines

    # A fresh --data-cache-path wins over a stale cache beside the data (kept aside and restored here).
    beside = data / "index-cache"
    saved = {p.name: p.read_bytes() for p in beside.iterdir()}
    _preprocess(tmp_path, docs, data / "c")  # back to the first order: beside-data cache now stale
    for name, blob in saved.items():
        (beside / name).write_bytes(blob)
    caplog.clear()
    ds = _dataset(prefix, cache=str(tmp_path / "new-cache"))
    assert np.array_equal(_rows(ds), first)
    # The stale set is repaired where it is (Megatron, which reads it without checks, would meet it too).
    assert ds.cache_dir == str(beside)
    assert len(_rebuild_lines(caplog)) == 1
    # A valid set in --data-cache-path is used, the stale one beside the data ignored (one line).
    valid = tmp_path / "valid-cache"
    valid.mkdir()
    for p in beside.iterdir():
        (valid / p.name).write_bytes(p.read_bytes())
        p.write_bytes(saved[p.name])
    caplog.clear()
    ds = _dataset(prefix, cache=str(valid))
    assert ds.cache_dir == str(valid) and np.array_equal(_rows(ds), first)
    lines = _rebuild_lines(caplog)
    assert len(lines) == 1 and "ignoring the stale" in lines[0], lines

    # Values overwritten in range in each cached array: one line, rebuilt, the right samples.
    good = _dataset(prefix)  # repairs the stale set beside the data again
    expected = first
    h = hashlib.md5(good.desc.encode()).hexdigest()
    for name in INDEX_NAMES:
        path = beside / f"{h}_{name}.npy"
        arr = np.load(path)
        if name == "sample_idx":
            arr[7, 1] += 1  # an offset one token off: still inside its document
        else:  # two values swapped: every value still in range, doc_idx still a tiling, shuffle a permutation
            j = int(np.flatnonzero(arr != arr[0])[0])
            arr[[0, j]] = arr[[j, 0]]
        np.save(path, arr)
        caplog.clear()
        ds = _dataset(prefix)
        assert np.array_equal(_rows(ds), expected), name
        lines = _rebuild_lines(caplog)
        assert len(lines) == 1 and name in lines[0] and "rebuilding" in lines[0], lines


def _small(tmp: Path, docs: list[list[int]], name: str = "s") -> str:
    prefix = str(tmp / name)
    builder = make_builder(prefix + ".bin", vocab_size=1000)
    for d in docs:
        builder.add_item(np.array(d))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_inconsistent_idx_is_one_error_naming_the_file(tmp_path: Path) -> None:
    prefix = _small(tmp_path, [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]])
    idx = Path(prefix + ".idx")
    good = idx.read_bytes()
    n = 4
    sizes = np.frombuffer(good, "<i4", n, HEADER_SIZE).copy()
    # Sizes swapped (same sum, the .bin length still matches): pointers no longer match the sizes.
    swapped = sizes.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    idx.write_bytes(
        good[:HEADER_SIZE] + swapped.astype("<i4").tobytes() + good[HEADER_SIZE + 4 * n :]
    )
    with pytest.raises(ValueError, match=r"s\.idx.*pointer") as err:
        MMapIndexedDataset(prefix)
    assert "\n" not in str(err.value)
    # A corrupted pointer.
    pointers = np.frombuffer(good, "<i8", n, HEADER_SIZE + 4 * n).copy()
    pointers[2] += 2
    body = good[: HEADER_SIZE + 4 * n] + pointers.astype("<i8").tobytes()
    idx.write_bytes(body + good[HEADER_SIZE + 12 * n :])
    with pytest.raises(ValueError, match=r"s\.idx.*pointer"):
        MMapIndexedDataset(prefix)
    # doc_idx not monotonic / out of range.
    for doc_idx in ([0, 2, 1, 3, 4], [0, 1, 2, 3, 9], [1, 1, 2, 3, 4]):
        idx.write_bytes(good[: HEADER_SIZE + 12 * n] + np.array(doc_idx, "<i8").tobytes())
        with pytest.raises(ValueError, match=r"s\.idx.*doc_idx"):
            MMapIndexedDataset(prefix)
    idx.write_bytes(good)
    assert MMapIndexedDataset(prefix)[3].tolist() == [7, 8, 9, 10]
    # The trainer: one `error:` line naming the file, exit 2, no traceback (fails in preflight, before any rank).
    idx.write_bytes(
        good[:HEADER_SIZE] + swapped.astype("<i4").tobytes() + good[HEADER_SIZE + 4 * n :]
    )
    proc = subprocess.run(
        [
            sys.executable,
            "pretrain_gpt.py",
            "--num-layers",
            "1",
            "--hidden-size",
            "8",
            "--num-attention-heads",
            "2",
            "--seq-length",
            "4",
            "--max-position-embeddings",
            "4",
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "1",
            "--train-iters",
            "1",
            "--lr",
            "1e-3",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "1000",
            "--data-path",
            prefix,
            "--split",
            "1,0,0",
        ],  # fmt: skip
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "s.idx" in errors[0] and "Traceback" not in proc.stderr


def test_outputs_never_overwrite_inputs_reached_through_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    a = _small(real, [[1, 2], [3]], "a")
    b = _small(real, [[4, 5, 6]], "b")
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    before = {p.name: p.read_bytes() for p in real.iterdir()}
    via_link = str(tmp_path / "link" / "a")
    with pytest.raises(PreprocessError, match="is also an input"):
        merge_datasets([via_link, b], a)
    with pytest.raises(PreprocessError, match="is also an input"):
        merge_datasets([a, b], via_link)
    # The CLI: one error line, exit 1, nothing changed.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.merge_datasets",
            "--input",
            str(tmp_path / "link"),
            "--output-prefix",
            a,
        ],  # fmt: skip
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        proc.returncode == 1
        and "is also an input" in proc.stderr
        and "Traceback" not in proc.stderr
    )
    # preprocess: an --input that is one of the files the output prefix would write (here through the link).
    jsonl = real / "p_text_document.bin"
    jsonl.write_text(json.dumps({"text": "1 2 3"}) + "\n")
    before[jsonl.name] = jsonl.read_bytes()
    with pytest.raises(PreprocessError, match="is also an input"):
        preprocess(
            [str(tmp_path / "link" / "p_text_document.bin")],
            json_keys=["text"],
            output_prefix=str(real / "p"),
            tokenizer_kwargs=NULL_TOKENIZER,
        )
    assert {p.name: p.read_bytes() for p in real.iterdir()} == before
    assert struct.unpack("<Q", Path(a + ".idx").read_bytes()[18:26])[0] == 2
