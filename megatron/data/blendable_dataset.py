"""Megatron's ``BlendableDataset``: several datasets mixed by weight, in a deterministic greedy order.

Weights are normalised; sample ``i`` of the blend comes from the dataset whose share is furthest behind its
target (``weights[d] * max(i, 1) - taken[d]`` largest, first on ties), so every prefix of the blend matches the
weights to within about one sample per dataset. Items are the chosen dataset's item plus ``"dataset_idx"``.
The indices are cached (atomically, see :mod:`megatron.data.index_cache`) only when ``data_cache_path`` is given,
as in Megatron-DeepSpeed: with the C++ helper they take milliseconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megatron.data import helpers
from megatron.data.index_cache import load_or_build
from megatron.log import log_rank_0

logger = logging.getLogger(__name__)

BLEND_INDEX_NAMES = ("index", "sample_index")
MAX_BLENDED_DATASETS = 255


def normalize_weights(weights: Sequence[float], what: str = "blend weights") -> np.ndarray:
    """float64 weights divided by their sum.

    Raises:
        ValueError: a weight is negative or not finite, or they sum to 0.
    """
    w = np.array([float(x) for x in weights], dtype=np.float64)
    if len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(
            f"{what} must be finite, non-negative and sum to more than 0; got {list(weights)}."
        )
    return w / w.sum()


def blend_description(descs: Sequence[str], weights: np.ndarray, size: int) -> str:
    """Megatron's blend description (md5 names the cache files)."""
    text = "Blendable dataset\n\nDatasets:\n"
    for desc in descs:
        text += desc + "\n\n"
    text += f"Weights: {weights}\n"
    text += f"Size: {size}\n"
    return text


def compute_blending_indices(
    weights: np.ndarray, size: int, *, use_cpp: bool | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index uint8[size], dataset_sample_index int64[size])`` by Megatron's greedy rule."""
    dataset_index = np.zeros(size, dtype=np.uint8)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(
        dataset_index,
        dataset_sample_index,
        np.ascontiguousarray(weights, dtype=np.float64),
        len(weights),
        size,
        use_cpp=use_cpp,
    )
    return dataset_index, dataset_sample_index


class BlendableDataset(torch.utils.data.Dataset):
    """Mix ``datasets`` by ``weights`` into ``size`` samples (Megatron's constructor and semantics).

    Args:
        datasets: map-style datasets; each needs ``desc`` (a string) for caching.
        weights: one non-negative weight per dataset (normalised here).
        size: number of blended samples.
        data_cache_path: directory for the cached indices (None: build in memory, as Megatron does).

    Raises:
        ValueError: counts differ, bad weights, more than 255 datasets, or a dataset too small for its share.
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[float],
        size: int,
        data_cache_path: str | None = None,
        *,
        use_cpp: bool | None = None,
    ) -> None:
        if len(datasets) != len(weights):
            raise ValueError(
                f"BlendableDataset got {len(datasets)} datasets but {len(weights)} weights; give one weight "
                "per dataset."
            )
        if not 1 <= len(datasets) <= MAX_BLENDED_DATASETS:
            raise ValueError(
                f"BlendableDataset blends 1 to {MAX_BLENDED_DATASETS} datasets; got {len(datasets)}."
            )
        if size < 1:
            raise ValueError(f"BlendableDataset size must be >= 1, got {size}.")
        self.datasets = list(datasets)
        self.size = int(size)
        self.weights = normalize_weights(weights)
        self.desc = blend_description(
            [getattr(d, "desc", repr(d)) for d in self.datasets], self.weights, self.size
        )

        def build() -> dict[str, np.ndarray]:
            start = time.time()
            index, sample_index = compute_blending_indices(self.weights, self.size, use_cpp=use_cpp)
            log_rank_0(
                logger,
                "built blending indices of %d samples in %.2f s",
                self.size,
                time.time() - start,
            )
            return {"index": index, "sample_index": sample_index}

        if data_cache_path:
            arrays, _ = load_or_build(
                [data_cache_path], self.desc, BLEND_INDEX_NAMES, build, self._check
            )
        else:
            arrays = build()
        self.dataset_index = arrays["index"]
        self.dataset_sample_index = arrays["sample_index"]
        self._check_bounds()

    def _check(self, arrays: dict[str, np.ndarray]) -> str | None:
        index, sample_index = arrays["index"], arrays["sample_index"]
        if index.shape != (self.size,) or index.dtype != np.uint8:
            return f"index {index.dtype}{index.shape}, expected uint8({self.size},)"
        if sample_index.shape != (self.size,) or sample_index.dtype != np.int64:
            return f"sample_index {sample_index.dtype}{sample_index.shape}, expected int64({self.size},)"
        if int(index.max()) >= len(self.datasets):
            return "index names a dataset that does not exist"
        return None

    def _check_bounds(self) -> None:
        counts = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        for d, (need, ds) in enumerate(zip(counts, self.datasets)):
            if need > len(ds):
                raise ValueError(
                    f"blended dataset {d} ({getattr(ds, 'name', type(ds).__name__)}) has {len(ds)} samples but "
                    f"the blend of {self.size} samples with weight {self.weights[d]:.4f} needs {need}; build it "
                    "with more samples (Megatron gives each ceil(total * weight * 1.005))."
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, Any]:
        idx = int(idx)
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        d = int(self.dataset_index[idx])
        return {"dataset_idx": d, **self.datasets[d][int(self.dataset_sample_index[idx])]}
