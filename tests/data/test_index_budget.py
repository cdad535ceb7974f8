"""A sample index larger than the machine's memory is refused with the numbers before anything is allocated
(issue 35, item 15: ``--global-batch-size 1000000000`` was a NumPy ``ArrayMemoryError`` traceback), and the
requests the index builder refuses are a ``DatasetRequestError`` the trainer turns into one line and exit 2
(item 16)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron.data.gpt_dataset import GPTIndexSpec, build_index_mappings
from megatron.data.index_budget import (
    DatasetRequestError,
    check_index_fits,
    index_bytes,
    memory_bytes,
)


def test_index_bytes_counts_the_three_arrays() -> None:
    # doc_idx int32 (3 docs x 2 epochs), sample_idx int64 pairs (11 rows), shuffle_idx uint32 (10)
    assert index_bytes(3, 2, 10) == 3 * 2 * 4 + 11 * 16 + 10 * 4
    assert (
        index_bytes(1, 1, 2**32) == 4 + (2**32 + 1) * 16 + 2**32 * 8
    )  # int64 shuffle past 2**32 - 2
    memory = memory_bytes()
    assert memory is None or memory > 2**20


def test_check_names_the_sizes_and_the_flags() -> None:
    check_index_fits(
        "dataset 'train' of d", num_docs=23, num_epochs=1, total_samples=1000, memory=2**30
    )
    with pytest.raises(
        DatasetRequestError, match=r"2000000250 samples .* needs 37\.3 GiB, more than this "
    ):
        check_index_fits(
            "dataset 'train' of d",
            num_docs=23,
            num_epochs=597015,
            total_samples=2_000_000_250,
            memory=23 * 2**30,
        )


def test_build_refuses_before_allocating(tmp_path) -> None:
    """16 documents of 2**31 - 1 tokens, 2e9 samples of 16: one epoch, a ~40 GiB index (more than any CI box;
    the arrays would be allocated, and fail, without the check)."""
    sizes = np.full(16, 2**31 - 1, dtype=np.int64)
    spec = GPTIndexSpec("train", str(tmp_path / "d"), "1,0,0", 2_000_000_000, 16, 1234)
    with pytest.raises(DatasetRequestError, match=r"needs \d+\.\d GiB, more than this machine's"):
        build_index_mappings(spec, np.arange(16, dtype=np.int32), sizes, data_cache_path=None)


def test_absurd_epochs_is_a_dataset_request_error(tmp_path) -> None:
    spec = GPTIndexSpec("train", str(tmp_path / "d"), "1,0,0", 2**60, 16, 1234)
    with pytest.raises(DatasetRequestError, match="that is not a sensible request"):
        build_index_mappings(
            spec, np.arange(4, dtype=np.int32), np.full(4, 100), data_cache_path=None
        )
