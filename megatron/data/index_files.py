"""Megatron's precomputed GPT index files, forced by ``--train-{doc,sample,shuffle}-idx-path``.

Megatron-DeepSpeed lets a run read the training split's ``doc_idx`` / ``sample_idx`` / ``shuffle_idx`` from given
``.npy`` files instead of the files named by the md5 of its description (a run that must replay another run's
exact order, or indices built offline for a corpus too large to index at start-up). Its lookup, kept here: a path
is joined to ``{dirname(data_prefix)}/index-cache/`` and then to ``--data-cache-path`` (so an absolute path is used
as is and a bare file name is looked up in the cache directories); we also accept a path relative to the working
directory. Unlike Megatron, a missing file is an error (Megatron would silently build a fresh set and write it to
the forced names), and the arrays are checked against the dataset before the first sample is read::

    doc_idx     1-D integers, every id a sequence of the dataset (< len(sizes))
    sample_idx  [n + 1, 2] integers: row k = (position in doc_idx, token offset in that document); consecutive
                rows are exactly --seq-length tokens apart in the document stream doc_idx describes
    shuffle_idx 1-D integers, n of them, each in [0, n)
    n           >= the samples the run draws from the training split

so a file built for another dataset, split, ``--seq-length`` or sample count fails at start-up with one error
naming the file, the flag, what is wrong and what to do, instead of an IndexError or silently wrong samples later.
The arrays are memory-mapped read-only; every rank reads the same files.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

INDEX_FLAGS = {
    "doc_idx": "--train-doc-idx-path",
    "sample_idx": "--train-sample-idx-path",
    "shuffle_idx": "--train-shuffle-idx-path",
}


class IndexFileError(ValueError):
    """A forced index file does not fit the dataset (names the flag, the file, what is wrong and the fix)."""


def resolve_index_file(path: str, directories: Sequence[str], name: str) -> str:
    """The file ``path`` names: as given, else joined to each cache directory in Megatron's order.

    Raises:
        FileNotFoundError: naming the flag and every place looked in.
    """
    candidates = [path] + [os.path.join(d, path) for d in directories if not os.path.isabs(path)]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        f"{INDEX_FLAGS[name]} {path}: no such file (looked in {', '.join(dict.fromkeys(candidates))}). Give "
        f"the {name}.npy that Megatron or Trident wrote into its index-cache directory ('<md5>_{name}.npy'), "
        "or drop the flag to build the indices."
    )


def load_index_file(path: str, name: str) -> np.ndarray:
    """``np.load(path, mmap_mode="r")`` of a forced index file, with an error naming the flag when unreadable."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise IndexFileError(
            f"{INDEX_FLAGS[name]} {path}: not a readable .npy array ({err}). Point the flag at the {name}.npy "
            "from an index-cache directory, or drop it to build the indices."
        ) from None
    if not isinstance(array, np.ndarray):
        raise IndexFileError(f"{INDEX_FLAGS[name]} {path}: holds an .npz archive, not one array.")
    return array


def _integer_array(array: np.ndarray, ndim: int, what: str) -> str | None:
    if array.dtype.kind not in "iu":
        return f"has dtype {array.dtype}, expected integers"
    if array.ndim != ndim or (ndim == 2 and array.shape[1] != 2):
        return f"has shape {array.shape}, expected {what}"
    return None


def _check_sample_idx(
    doc_idx: np.ndarray, sample_idx: np.ndarray, sizes: np.ndarray, seq_length: int
) -> str | None:
    """Why ``sample_idx`` does not describe ``--seq-length`` samples over ``doc_idx``, or None."""
    positions = np.asarray(sample_idx[:, 0], dtype=np.int64)
    offsets = np.asarray(sample_idx[:, 1], dtype=np.int64)
    if len(positions) == 0:
        return "is empty (it needs at least one row)"
    if positions.min() < 0 or positions.max() >= len(doc_idx) or offsets.min() < 0:
        return f"points outside the {len(doc_idx)} entries of doc_idx"
    lengths = sizes[np.asarray(doc_idx, dtype=np.int64)].astype(np.int64)
    if np.any(offsets >= np.maximum(lengths[positions], 1)):
        row = int(np.flatnonzero(offsets >= np.maximum(lengths[positions], 1))[0])
        return f"row {row} has a token offset past the end of its document"
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    steps = np.diff(starts[positions] + offsets)
    if len(steps) and np.any(steps != seq_length):
        row = int(np.flatnonzero(steps != seq_length)[0])
        return (
            f"sample {row} spans {int(steps[row])} tokens of the doc_idx stream, not --seq-length "
            f"{seq_length} (the file was built for another --seq-length, dataset or doc_idx)"
        )
    return None


def check_index_file_kind(array: np.ndarray, name: str, source: str) -> None:
    """One forced file on its own: integers of the right rank (ValueError naming ``source`` otherwise)."""
    expected = {"doc_idx": "(num_documents * num_epochs,)", "sample_idx": "(num_samples + 1, 2)"}
    reason = _integer_array(
        array, 2 if name == "sample_idx" else 1, expected.get(name, "(num_samples,)")
    )
    if reason is not None:
        raise IndexFileError(
            f"{source}: {name} {reason}. Rebuild it for this dataset and flags, or drop the flag to build the "
            "indices."
        )


def check_gpt_index_arrays(
    arrays: Mapping[str, np.ndarray],
    sources: Mapping[str, str],
    *,
    sizes: np.ndarray,
    seq_length: int,
    num_samples: int,
) -> None:
    """Check a (partly) forced ``doc_idx``/``sample_idx``/``shuffle_idx`` set against the dataset.

    Args:
        arrays: the three arrays.
        sources: where each came from, for the message (``"--train-doc-idx-path /x.npy"`` or ``"the index cache"``).
        sizes: tokens per sequence of the indexed dataset.
        seq_length: ``--seq-length``.
        num_samples: samples the run draws from this dataset.

    Raises:
        ValueError: one message naming the file(s), what is wrong and the fix.
    """
    doc_idx, sample_idx, shuffle_idx = (arrays[n] for n in INDEX_FLAGS)
    fix = "Rebuild it for this dataset and flags, or drop the flag to build the indices."
    reason = _integer_array(doc_idx, 1, "(num_documents * num_epochs,)")
    if reason is None and len(doc_idx) and (doc_idx.min() < 0 or doc_idx.max() >= len(sizes)):
        reason = f"holds document ids outside [0, {len(sizes)}) of this dataset"
    if reason is not None:
        raise IndexFileError(f"{sources['doc_idx']}: doc_idx {reason}. {fix}")
    reason = _integer_array(sample_idx, 2, "(num_samples + 1, 2)")
    if reason is None:
        reason = _check_sample_idx(doc_idx, sample_idx, sizes, seq_length)
    if reason is not None:
        raise IndexFileError(
            f"{sources['sample_idx']}: sample_idx {reason} (doc_idx from {sources['doc_idx']}). {fix}"
        )
    total = len(sample_idx) - 1
    reason = _integer_array(shuffle_idx, 1, f"({total},)")
    if reason is None and len(shuffle_idx) != total:
        reason = f"has {len(shuffle_idx)} entries but sample_idx ({sources['sample_idx']}) describes {total} samples"
    if reason is None and total and (shuffle_idx.min() < 0 or shuffle_idx.max() >= total):
        reason = f"holds sample ids outside [0, {total})"
    if reason is not None:
        raise IndexFileError(f"{sources['shuffle_idx']}: shuffle_idx {reason}. {fix}")
    if total < num_samples:
        raise IndexFileError(
            f"{sources['sample_idx']}: the index files describe {total} training samples but the run draws "
            f"{num_samples} (--train-iters/--train-samples x --global-batch-size); build them for at least that "
            "many samples, or train for fewer."
        )
