"""The writer of Megatron's memory-mapped indexed dataset (``--data-impl mmap``): ``.bin`` then ``.idx``, byte for
byte (the format and the reader: :mod:`megatron.data.indexed_dataset`).

The builder writes to a temporary file beside the target and renames on :meth:`MMapIndexedDatasetBuilder.finalize`,
so an interrupted run never leaves a partial file under the final name.
"""

from __future__ import annotations

import array
import os
import shutil
from collections.abc import Iterable
from typing import Any

import numpy as np

from megatron.data.indexed_dataset import (
    IndexReader,
    atomic_target,
    best_fitting_dtype,
    data_file_path,
    dtype_code,
    index_file_path,
    remove_quietly,
    write_index,
)


class MMapIndexedDatasetBuilder:
    """Writes a ``.bin`` incrementally and its ``.idx`` on :meth:`finalize` (Megatron's builder API).

    Data goes to a temporary file beside ``out_file``; ``finalize`` writes the ``.idx`` and renames both into place
    (``.bin`` first, then ``.idx``, so a reader never sees an index without its data). Call :meth:`abort` (or use
    the builder as a context manager) to delete the temporary file when giving up.

    Args:
        out_file: the ``.bin`` path.
        dtype: token dtype (Megatron's default when constructed directly: int64; see :func:`make_builder`).
    """

    def __init__(self, out_file: str, dtype: Any = np.int64) -> None:
        dtype_code(dtype)  # validate early
        self._dtype = np.dtype(dtype)
        self._out_file = out_file
        self._tmp = atomic_target(out_file)
        self._data = open(self._tmp, "wb")  # noqa: SIM115 (closed in finalize/abort)
        self._sizes = array.array("q")
        self._doc_idx = array.array("q", [0])
        self._closed = False

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def _write(self, values: Any) -> int:
        arr = np.asarray(values.numpy() if hasattr(values, "numpy") else values)
        out = np.ascontiguousarray(arr.reshape(-1), dtype=self._dtype)
        if arr.size and arr.dtype.kind in "iu" and self._dtype.kind in "iu":
            info = np.iinfo(self._dtype)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise ValueError(
                    f"token id range [{lo}, {hi}] does not fit the dataset dtype {self._dtype.name}; "
                    "build with a wider dtype (make_builder(..., vocab_size=...) picks one)."
                )
        out.tofile(self._data)
        return out.size

    def add_item(self, tensor: Any) -> None:
        """Append one sequence (a 1-D tensor, array or list of token ids)."""
        self._sizes.append(self._write(tensor))

    def end_document(self) -> None:
        """Close the current document: the next sequences belong to a new one."""
        self._doc_idx.append(len(self._sizes))

    def add_doc(self, tokens: Any, lengths: Iterable[int]) -> None:
        """Append one document: ``tokens`` concatenated, ``lengths`` its sequence (sentence) sizes."""
        lens = [int(x) for x in lengths]
        written = self._write(tokens)
        if written != sum(lens):
            raise ValueError(f"add_doc: {written} tokens but the lengths sum to {sum(lens)}.")
        self._sizes.extend(lens)
        self._doc_idx.append(len(self._sizes))

    def add_documents(
        self, tokens: np.ndarray, lengths: np.ndarray, num_sequences: np.ndarray | None = None
    ) -> None:
        """Append many documents at once (the preprocessing fast path).

        Args:
            tokens: all sequences' tokens concatenated (ideally already of the builder's dtype: no conversion).
            lengths: tokens per sequence; ``lengths.sum() == len(tokens)``.
            num_sequences: sequences per document (``sum == len(lengths)``; 0 = an empty document). Default: one
                sequence per document.
        """
        lens = np.asarray(lengths, dtype=np.int64)
        if num_sequences is None:
            per_doc = np.ones(len(lens), dtype=np.int64)
        else:
            per_doc = np.asarray(num_sequences, dtype=np.int64)
            if int(per_doc.sum()) != len(lens) or (len(per_doc) and per_doc.min() < 0):
                raise ValueError(
                    f"add_documents: num_sequences sums to {int(per_doc.sum())}, but there are {len(lens)} lengths."
                )
        written = self._write(tokens)
        if written != int(lens.sum()):
            raise ValueError(
                f"add_documents: {written} tokens but the lengths sum to {int(lens.sum())}."
            )
        start = len(self._sizes)
        self._sizes.frombytes(lens.tobytes())
        self._doc_idx.frombytes((start + np.cumsum(per_doc)).astype(np.int64).tobytes())

    def merge_file_(self, another_file: str) -> None:
        """Append the dataset at prefix ``another_file`` (same dtype required), documents and all."""
        index = IndexReader(index_file_path(another_file))
        if np.dtype(index.dtype) != self._dtype:
            raise ValueError(
                f"cannot merge {another_file}: its dtype is {np.dtype(index.dtype).name}, this builder writes "
                f"{self._dtype.name}; all merged datasets must share one tokenizer/dtype."
            )
        offset = len(self._sizes)
        self._sizes.frombytes(index.sizes.astype(np.int64).tobytes())
        self._doc_idx.frombytes((index.doc_idx[1:] + offset).astype(np.int64).tobytes())
        expected = int(index.sizes.sum(dtype=np.int64)) * self._dtype.itemsize
        bin_path = data_file_path(another_file)
        actual = os.path.getsize(bin_path)
        if actual != expected:
            raise ValueError(
                f"cannot merge {bin_path}: it is {actual} bytes, its index says {expected}."
            )
        with open(bin_path, "rb") as f:
            shutil.copyfileobj(f, self._data, length=16 * 1024 * 1024)

    def finalize(self, index_file: str) -> None:
        """Write ``index_file`` and move the ``.bin`` into place; the builder cannot be used afterwards."""
        if self._closed:
            raise RuntimeError("finalize() called twice on the same MMapIndexedDatasetBuilder.")
        self._data.close()
        self._closed = True
        try:
            os.replace(self._tmp, self._out_file)
        except BaseException:
            remove_quietly(self._tmp)
            raise
        write_index(
            index_file,
            self._dtype,
            np.frombuffer(self._sizes, dtype=np.int64),
            np.frombuffer(self._doc_idx, dtype=np.int64),
        )

    def abort(self) -> None:
        """Discard everything written so far (removes the temporary file); idempotent."""
        if not self._closed:
            self._data.close()
            self._closed = True
            remove_quietly(self._tmp)

    def __enter__(self) -> MMapIndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()


def make_builder(
    out_file: str, impl: str = "mmap", vocab_size: int | None = None
) -> MMapIndexedDatasetBuilder:
    """Megatron's builder factory: an mmap builder with :func:`best_fitting_dtype` of ``vocab_size``.

    Raises:
        ValueError: ``impl`` is not ``mmap`` (the legacy lazy/cached formats are not supported).
    """
    if impl != "mmap":
        raise ValueError(
            f"--dataset-impl {impl} is not supported; only 'mmap' is (the legacy lazy/cached formats were dropped)."
        )
    return MMapIndexedDatasetBuilder(out_file, dtype=best_fitting_dtype(vocab_size))
