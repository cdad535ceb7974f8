"""BlendableDataset: Megatron's greedy order, proportions, determinism, caching and bad input, on real files."""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import numpy as np
import pytest

from megatron.data.blendable_dataset import BlendableDataset, compute_blending_indices
from megatron.data.gpt_dataset import GPTDataset, GPTIndexSpec
from megatron.data.indexed_builder import make_builder
from megatron.data.indexed_dataset import MMapIndexedDataset


def greedy_reference(weights, size):
    """Megatron's rule, literally: argmax of weight * max(i, 1) - taken (first on ties)."""
    taken = [0] * len(weights)
    out = []
    for i in range(size):
        errors = [w * max(float(i), 1.0) - t for w, t in zip(weights, taken)]
        best = errors.index(max(errors))
        out.append((best, taken[best]))
        taken[best] += 1
    return out


def write_corpus(prefix: str, n_docs: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    builder = make_builder(prefix + ".bin", vocab_size=500)
    for _ in range(n_docs):
        builder.add_item(rng.integers(0, 500, int(rng.integers(5, 60))))
        builder.end_document()
    builder.finalize(prefix + ".idx")


@pytest.fixture
def three_datasets(tmp_path: Path):
    out = []
    for k, n_docs in enumerate((40, 80, 120)):
        prefix = str(tmp_path / f"corpus{k}")
        write_corpus(prefix, n_docs, seed=k)
        indexed = MMapIndexedDataset(prefix)
        docs = np.arange(len(indexed.sizes), dtype=np.int32)
        out.append(GPTDataset(GPTIndexSpec("train", prefix, "1", 1000, 16, 1234), docs, indexed))
    return out


def test_indices_follow_the_greedy_rule_and_match_weights(three_datasets) -> None:
    raw = [2.0, 3.0, 5.0]
    size = 1500
    blend = BlendableDataset(three_datasets, raw, size)
    w = [x / sum(raw) for x in raw]
    ref = greedy_reference(w, size)
    assert blend.dataset_index.dtype == np.uint8 and blend.dataset_sample_index.dtype == np.int64
    assert [
        (int(d), int(s)) for d, s in zip(blend.dataset_index, blend.dataset_sample_index)
    ] == ref
    counts = np.bincount(blend.dataset_index, minlength=3)
    assert np.all(np.abs(counts - np.array(w) * size) <= 1.0)
    # Every prefix of the blend stays within ~1 sample of its target share.
    onehot = np.eye(3)[np.asarray(blend.dataset_index)]
    drift = np.abs(np.cumsum(onehot, 0) - np.outer(np.arange(1, size + 1), w))
    assert drift.max() < 2.0
    # Items come from the chosen dataset at the chosen position, tagged with its index.
    for i in (0, 1, 2, 10, 777, size - 1):
        d, s = ref[i]
        item = blend[i]
        assert item["dataset_idx"] == d
        assert np.array_equal(item["text"], three_datasets[d][s]["text"])
    with pytest.raises(IndexError):
        blend[size]


def test_proportions_hold_over_many_samples() -> None:
    rng = np.random.default_rng(0)
    for _ in range(10):
        w = rng.random(int(rng.integers(2, 12)))
        w /= w.sum()
        size = 200_000
        index, sample = compute_blending_indices(w, size)
        counts = np.bincount(index, minlength=len(w))
        assert np.all(np.abs(counts - w * size) <= 1.0), (w, counts)
        # dataset_sample_index is a running count per dataset: every dataset is read in order.
        for d in range(len(w)):
            assert np.array_equal(sample[index == d], np.arange(counts[d]))


def test_blending_is_deterministic_and_cached_atomically(three_datasets, tmp_path) -> None:
    cache = tmp_path / "blend-cache"
    a = BlendableDataset(three_datasets, [1, 1, 2], 900, data_cache_path=str(cache))
    b = BlendableDataset(three_datasets, [1, 1, 2], 900, data_cache_path=str(cache))
    c = BlendableDataset(three_datasets, [1, 1, 2], 900)  # no cache: built in memory
    for x in (b, c):
        assert np.array_equal(a.dataset_index, x.dataset_index)
        assert np.array_equal(a.dataset_sample_index, x.dataset_sample_index)
    assert isinstance(b.dataset_index, np.memmap)
    h = hashlib.md5(a.desc.encode("utf-8")).hexdigest()
    assert sorted(os.listdir(cache)) == sorted(
        [f"{h}.dsc", f"{h}_index.npy", f"{h}_sample_index.npy"]
    )
    assert a.desc.startswith("Blendable dataset\n\nDatasets:\nGPT Dataset\n\n")
    assert "Weights: [0.25 0.25 0.5 ]\nSize: 900\n" in a.desc
    # A truncated cache file is detected and rebuilt with the same content. (Written to a new inode: truncating
    # the file in place would pull the pages from under a's memory map, which is why the cache never does that.)
    expected = np.array(a.dataset_index)
    path = cache / f"{h}_index.npy"
    damaged = path.read_bytes()[:100]
    path.unlink()
    path.write_bytes(damaged)
    d = BlendableDataset(three_datasets, [1, 1, 2], 900, data_cache_path=str(cache))
    assert np.array_equal(d.dataset_index, expected)
    assert np.array_equal(np.load(path), expected)


def test_megatron_share_leaves_headroom(three_datasets) -> None:
    # Each dataset built with ceil(n * w * 1.005) samples always covers the blend of the summed size.
    w = [0.2, 0.3, 0.5]
    n = 600
    per = [math.ceil(n * x * 1.005) for x in w]
    index, _ = compute_blending_indices(np.array(w), sum(per))
    assert np.all(np.bincount(index, minlength=3) <= np.array(per) + 1)


def test_bad_blends_are_reported(three_datasets) -> None:
    with pytest.raises(ValueError, match="got 3 datasets but 2 weights"):
        BlendableDataset(three_datasets, [1, 2], 10)
    with pytest.raises(ValueError, match="sum to more than 0"):
        BlendableDataset(three_datasets, [0, 0, 0], 10)
    with pytest.raises(ValueError, match="non-negative"):
        BlendableDataset(three_datasets, [1, -1, 1], 10)
    with pytest.raises(ValueError, match="size must be >= 1"):
        BlendableDataset(three_datasets, [1, 1, 1], 0)
    with pytest.raises(ValueError, match="blends 1 to 255 datasets"):
        BlendableDataset(three_datasets * 86, [1.0] * 258, 10)
    small = three_datasets[0]
    with pytest.raises(ValueError, match=r"blended dataset 0 .* has \d+ samples but the blend"):
        BlendableDataset([small, three_datasets[1]], [0.99, 0.01], 5 * len(small))
