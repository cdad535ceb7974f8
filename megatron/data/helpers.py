"""GPT index builders: the C++ extension ``megatron.data._helpers`` when built, else NumPy references.

Two functions with Megatron-DeepSpeed's semantics (``shared/reference/megatron-compat.md`` section 6.3):

* :func:`build_sample_idx` — where each ``seq_length + 1``-token sample starts in the shuffled document stream.
* :func:`build_blending_indices` — Megatron's greedy assignment of blended samples to datasets.

Both have a NumPy implementation here (``*_numpy``) that returns IDENTICAL arrays to the C++ one
(``csrc/data/helpers.cpp``; ``tests/data/test_helpers_cpp.py`` compares them). The extension is built ahead of time
by ``setup.py`` (``pip install --no-build-isolation -e .``); without it the NumPy versions are used and one warning is
logged. ``use_cpp=False`` forces the NumPy path (benchmarks, tests); ``use_cpp=True`` demands the extension.
"""

from __future__ import annotations

import logging
import math

import numpy as np

logger = logging.getLogger(__name__)

try:
    from megatron.data import _helpers as _cpp

    HAVE_CPP_HELPERS = True
except ImportError:  # the optional extension was not built
    _cpp = None
    HAVE_CPP_HELPERS = False

_warned_missing = False


def _use_cpp(use_cpp: bool | None) -> bool:
    global _warned_missing
    if use_cpp is None:
        if not HAVE_CPP_HELPERS and not _warned_missing:
            _warned_missing = True
            logger.warning(
                "C++ data helpers (megatron.data._helpers) are not built; using the NumPy fallback "
                "(identical indices, slower blending). Build them with "
                "`pip install --no-build-isolation -e .` (needs a C++17 compiler and pybind11)."
            )
        return HAVE_CPP_HELPERS
    if use_cpp and not HAVE_CPP_HELPERS:
        raise RuntimeError(
            "use_cpp=True but megatron.data._helpers is not built; run "
            "`pip install --no-build-isolation -e .` or pass use_cpp=None to allow the NumPy fallback."
        )
    return use_cpp


def _check_1d(arr: np.ndarray, name: str, dtype: type[np.generic], writeable: bool = False) -> None:
    if not isinstance(arr, np.ndarray) or arr.dtype != np.dtype(dtype):
        got = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
        raise ValueError(
            f"{name} must have dtype {np.dtype(dtype).name}, got {got}; "
            f"convert it with .astype(np.{np.dtype(dtype).name})"
        )
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got {arr.ndim} dimensions")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous; pass np.ascontiguousarray({name})")
    if writeable and not arr.flags.writeable:
        raise ValueError(f"{name} must be writeable (it is filled in place)")


def build_sample_idx_numpy(
    sizes: np.ndarray,
    doc_idx: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
) -> np.ndarray:
    """Vectorised NumPy twin of the C++ ``build_sample_idx`` (same checks, same int64 result).

    Sample ``i`` starts at global token ``i * seq_length`` of the stream ``doc_idx[0], doc_idx[1], ...``; the row is
    the ``(k, offset)`` of the non-empty document holding that token (``searchsorted`` on the documents' token
    prefix sums), except row 0, which Megatron's walk fixes at ``(0, 0)`` even if document 0 is empty.

    Args:
        sizes: int32 tokens per sequence of the indexed dataset.
        doc_idx: int32 sequence ids in stream order (epochs of documents, shuffled).
        seq_length: tokens per sample minus one.
        num_epochs: epochs in ``doc_idx``.
        tokens_per_epoch: tokens in one epoch of documents.

    Returns:
        int64 array ``[num_samples + 1, 2]``, ``num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length``.

    Raises:
        ValueError: wrong dtype/shape/contiguity, out-of-range ids, or too few tokens for the samples.
    """
    _check_1d(sizes, "sizes", np.int32)
    _check_1d(doc_idx, "doc_idx", np.int32)
    seq_length, num_epochs, tokens_per_epoch = (
        int(seq_length),
        int(num_epochs),
        int(tokens_per_epoch),
    )
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    if num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1, got {num_epochs}")
    if tokens_per_epoch < 2:
        raise ValueError(
            f"tokens_per_epoch must be >= 2 (a sample needs 2 tokens), got {tokens_per_epoch}"
        )
    if len(doc_idx) and (doc_idx.min() < 0 or doc_idx.max() >= len(sizes)):
        bad = int(np.flatnonzero((doc_idx < 0) | (doc_idx >= len(sizes)))[0])
        raise ValueError(
            f"doc_idx[{bad}] = {int(doc_idx[bad])} is outside [0, len(sizes) = {len(sizes)})"
        )
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    lengths = sizes[doc_idx].astype(np.int64)
    starts = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    needed = num_samples * seq_length + 1
    if starts[-1] < needed:
        raise ValueError(
            f"doc_idx holds {int(starts[-1])} tokens, but {num_samples} samples of seq_length "
            f"{seq_length} need {needed} (num_epochs * tokens_per_epoch overstates the documents' tokens)"
        )
    out = np.empty((num_samples + 1, 2), dtype=np.int64)
    # Chunked so that 1e9-token indices never hold more than a few MB of temporaries.
    chunk = 1 << 22
    for lo in range(0, num_samples + 1, chunk):
        hi = min(lo + chunk, num_samples + 1)
        positions = np.arange(lo, hi, dtype=np.int64) * seq_length
        k = np.searchsorted(starts, positions, side="right") - 1
        out[lo:hi, 0] = k
        out[lo:hi, 1] = positions - starts[k]
    out[0] = (0, 0)
    return out


def build_blending_indices_numpy(
    dataset_index: np.ndarray,
    dataset_sample_index: np.ndarray,
    weights: np.ndarray,
    num_datasets: int,
    size: int,
) -> None:
    """Pure-Python twin of the C++ greedy blending (same float operations, same ties, fills in place).

    Sample ``i`` goes to the dataset ``d`` with the largest ``weights[d] * max(i, 1) - taken[d]`` (the first such
    ``d`` on ties); ``dataset_index[i] = d``, ``dataset_sample_index[i] = taken[d]``, then ``taken[d] += 1``.

    Raises:
        ValueError: wrong dtypes/shapes, ``num_datasets`` outside [1, 255], or arrays shorter than ``size``.
    """
    _check_1d(dataset_index, "dataset_index", np.uint8, writeable=True)
    _check_1d(dataset_sample_index, "dataset_sample_index", np.int64, writeable=True)
    _check_1d(weights, "weights", np.float64)
    num_datasets, size = int(num_datasets), int(size)
    if not 1 <= num_datasets <= 255:
        raise ValueError(
            f"num_datasets must be in [1, 255] (dataset_index is uint8), got {num_datasets}"
        )
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if len(weights) != num_datasets:
        raise ValueError(f"weights has {len(weights)} entries but num_datasets is {num_datasets}")
    if len(dataset_index) < size or len(dataset_sample_index) < size:
        raise ValueError(
            f"dataset_index and dataset_sample_index must hold at least size = {size} entries"
        )
    w = [float(x) for x in weights]
    taken = [0] * num_datasets
    chosen = [0] * size
    positions = [0] * size
    others = range(1, num_datasets)
    for i in range(size):
        scale = float(max(i, 1))
        best = 0
        best_error = w[0] * scale - taken[0]
        for d in others:
            error = w[d] * scale - taken[d]
            if error > best_error:
                best_error = error
                best = d
        chosen[i] = best
        positions[i] = taken[best]
        taken[best] += 1
    dataset_index[:size] = chosen
    dataset_sample_index[:size] = positions


def build_sample_idx(
    sizes: np.ndarray,
    doc_idx: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    *,
    use_cpp: bool | None = None,
) -> np.ndarray:
    """int64 ``[num_samples + 1, 2]`` sample starts; C++ when built (``use_cpp=None``), see module docstring."""
    if _use_cpp(use_cpp):
        return _cpp.build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    return build_sample_idx_numpy(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)


def build_blending_indices(
    dataset_index: np.ndarray,
    dataset_sample_index: np.ndarray,
    weights: np.ndarray,
    num_datasets: int,
    size: int,
    *,
    use_cpp: bool | None = None,
) -> None:
    """Greedy blending indices, filled in place; C++ when built (``use_cpp=None``), see module docstring."""
    if _use_cpp(use_cpp):
        _cpp.build_blending_indices(
            dataset_index, dataset_sample_index, weights, num_datasets, size
        )
        return
    build_blending_indices_numpy(dataset_index, dataset_sample_index, weights, num_datasets, size)


def num_blend_samples(weight: float, num_samples: int) -> int:
    """Megatron's per-dataset share of a blend: ``ceil(num_samples * weight * 1.005)`` (0.5 % headroom)."""
    return int(math.ceil(num_samples * weight * 1.005))
