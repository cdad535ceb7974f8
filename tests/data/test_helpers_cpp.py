"""The C++ index helpers against the NumPy fallback (identical arrays) and a literal Megatron loop."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from megatron.data import helpers

needs_cpp = pytest.mark.skipif(
    not helpers.HAVE_CPP_HELPERS,
    reason="megatron.data._helpers not built (pip install --no-build-isolation -e .)",
)


def loop_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Megatron's build_sample_idx walk, literally."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    index, offset = 0, 0
    for s in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[doc_idx[index]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                index += 1
                offset = 0
        out[s] = (index, offset)
    return out


def loop_blending(weights, size):
    """Megatron's greedy blending, literally (numpy float64 scalars)."""
    taken = np.zeros(len(weights), dtype=np.int64)
    index = np.zeros(size, dtype=np.uint8)
    sample = np.zeros(size, dtype=np.int64)
    for i in range(size):
        s = max(float(i), 1.0)
        errors = [weights[d] * s - float(taken[d]) for d in range(len(weights))]
        best = int(np.argmax(errors))  # first maximum, as the strict '>' in the loop
        index[i] = best
        sample[i] = taken[best]
        taken[best] += 1
    return index, sample


def random_case(rng):
    n = int(rng.integers(1, 40))
    sizes = rng.integers(0, 30, n).astype(np.int32)
    sizes[int(rng.integers(0, n))] = max(2, int(sizes.max()))
    epochs = int(rng.integers(1, 4))
    doc_idx = np.tile(np.arange(n, dtype=np.int32), epochs)
    rng.shuffle(doc_idx)
    return sizes, doc_idx, int(rng.integers(1, 40)), epochs, int(sizes.sum())


@pytest.mark.parametrize("use_cpp", [pytest.param(True, marks=needs_cpp), False])
def test_sample_idx_matches_the_megatron_loop(use_cpp) -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes, doc_idx, seq, epochs, tpe = random_case(rng)
        got = helpers.build_sample_idx(sizes, doc_idx, seq, epochs, tpe, use_cpp=use_cpp)
        assert got.dtype == np.int64
        assert np.array_equal(got, loop_sample_idx(sizes, doc_idx, seq, epochs, tpe))


@needs_cpp
def test_cpp_and_numpy_agree_including_empty_leading_documents() -> None:
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 300, 5000).astype(np.int32)
    sizes[:50] = 0  # row 0 stays (0, 0) even when document 0 is empty
    doc_idx = np.tile(np.arange(5000, dtype=np.int32), 3)
    rng.shuffle(doc_idx[50:])
    tpe = int(sizes.sum())
    for seq in (1, 2, 127, 2048, 4096):
        a = helpers.build_sample_idx(sizes, doc_idx, seq, 3, tpe, use_cpp=True)
        b = helpers.build_sample_idx(sizes, doc_idx, seq, 3, tpe, use_cpp=False)
        assert np.array_equal(a, b) and tuple(a[0]) == (0, 0)


@pytest.mark.parametrize("use_cpp", [pytest.param(True, marks=needs_cpp), False])
def test_blending_matches_the_megatron_loop(use_cpp) -> None:
    rng = np.random.default_rng(2)
    cases = [np.array([0.5, 0.5]), np.array([1 / 3, 1 / 3, 1 / 3]), np.array([1.0])]
    cases += [w / w.sum() for w in (rng.random(int(rng.integers(2, 8))) for _ in range(20))]
    for w in cases:
        size = int(rng.integers(0, 2000))
        index = np.zeros(size, dtype=np.uint8)
        sample = np.zeros(size, dtype=np.int64)
        helpers.build_blending_indices(index, sample, w, len(w), size, use_cpp=use_cpp)
        ref_index, ref_sample = loop_blending(w, size)
        assert np.array_equal(index, ref_index) and np.array_equal(sample, ref_sample)


@pytest.mark.parametrize("use_cpp", [pytest.param(True, marks=needs_cpp), False])
def test_bad_inputs_raise_clear_errors(use_cpp) -> None:
    sizes = np.array([5, 6, 7], dtype=np.int32)
    docs = np.array([0, 1, 2], dtype=np.int32)

    def sample_idx(*args):
        return helpers.build_sample_idx(*args, use_cpp=use_cpp)

    with pytest.raises(ValueError, match="sizes must have dtype int32, got int64"):
        sample_idx(sizes.astype(np.int64), docs, 4, 1, 18)
    with pytest.raises(ValueError, match="doc_idx must have dtype int32"):
        sample_idx(sizes, docs.astype(np.uint32), 4, 1, 18)
    with pytest.raises(ValueError, match="must be C-contiguous"):
        sample_idx(np.repeat(sizes, 2)[::2], docs, 4, 1, 18)
    with pytest.raises(ValueError, match="must be 1-D"):
        sample_idx(sizes.reshape(3, 1), docs, 4, 1, 18)
    with pytest.raises(ValueError, match=r"doc_idx\[1\] = 3 is outside \[0, len\(sizes\) = 3\)"):
        sample_idx(sizes, np.array([0, 3, 1], dtype=np.int32), 4, 1, 18)
    with pytest.raises(ValueError, match="seq_length must be >= 1"):
        sample_idx(sizes, docs, 0, 1, 18)
    with pytest.raises(ValueError, match="tokens_per_epoch must be >= 2"):
        sample_idx(sizes, docs, 4, 1, 1)
    with pytest.raises(ValueError, match="doc_idx holds 18 tokens"):
        sample_idx(sizes, docs, 4, 2, 18)

    def blend(index, sample, weights, n, size):
        helpers.build_blending_indices(index, sample, weights, n, size, use_cpp=use_cpp)

    u8, i64, w = np.zeros(4, np.uint8), np.zeros(4, np.int64), np.array([0.5, 0.5])
    with pytest.raises(ValueError, match="dataset_index must have dtype uint8"):
        blend(np.zeros(4, np.int32), i64, w, 2, 4)
    with pytest.raises(ValueError, match="weights must have dtype float64"):
        blend(u8, i64, w.astype(np.float32), 2, 4)
    with pytest.raises(ValueError, match="weights has 2 entries but num_datasets is 3"):
        blend(u8, i64, w, 3, 4)
    with pytest.raises(ValueError, match=r"num_datasets must be in \[1, 255\]"):
        blend(u8, i64, np.ones(256) / 256, 256, 4)
    with pytest.raises(ValueError, match="at least size = 5"):
        blend(u8, i64, w, 2, 5)
    frozen = np.zeros(4, np.int64)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="must be writeable"):
        blend(u8, frozen, w, 2, 4)


def test_missing_extension_warns_once_and_falls_back(monkeypatch, caplog) -> None:
    monkeypatch.setattr(helpers, "HAVE_CPP_HELPERS", False)
    monkeypatch.setattr(helpers, "_cpp", None)
    monkeypatch.setattr(helpers, "_warned_missing", False)
    sizes = np.array([5, 6, 7], dtype=np.int32)
    docs = np.array([2, 0, 1], dtype=np.int32)
    with caplog.at_level(logging.WARNING, logger="megatron.data.helpers"):
        a = helpers.build_sample_idx(sizes, docs, 4, 1, 18)
        b = helpers.build_sample_idx(sizes, docs, 4, 1, 18)
        index, sample = np.zeros(3, np.uint8), np.zeros(3, np.int64)
        helpers.build_blending_indices(index, sample, np.array([0.5, 0.5]), 2, 3)
    assert np.array_equal(a, loop_sample_idx(sizes, docs, 4, 1, 18)) and np.array_equal(a, b)
    warnings = [r for r in caplog.records if "not built" in r.getMessage()]
    assert len(warnings) == 1 and "pip install" in warnings[0].getMessage()
    with pytest.raises(RuntimeError, match="use_cpp=True but megatron.data._helpers is not built"):
        helpers.build_sample_idx(sizes, docs, 4, 1, 18, use_cpp=True)


@needs_cpp
def test_extension_is_the_one_built_by_setup_py() -> None:
    import megatron.data._helpers as ext

    assert helpers._cpp is ext
    assert {"build_sample_idx", "build_blending_indices"} <= set(dir(ext))


@pytest.mark.slow
@needs_cpp
def test_large_index_agrees() -> None:
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 2000, 200_000).astype(np.int32)
    doc_idx = np.tile(np.arange(len(sizes), dtype=np.int32), 2)
    rng.shuffle(doc_idx)
    tpe = int(sizes.sum())
    for seq in (7, 2048):
        a = helpers.build_sample_idx(sizes, doc_idx, seq, 2, tpe, use_cpp=True)
        b = helpers.build_sample_idx(sizes, doc_idx, seq, 2, tpe, use_cpp=False)
        assert np.array_equal(a, b)
    w = rng.random(9)
    w /= w.sum()
    out = [(np.zeros(300_000, np.uint8), np.zeros(300_000, np.int64)) for _ in range(2)]
    for (index, sample), use in zip(out, (True, False)):
        helpers.build_blending_indices(index, sample, w, 9, 300_000, use_cpp=use)
    assert np.array_equal(out[0][0], out[1][0]) and np.array_equal(out[0][1], out[1][1])
