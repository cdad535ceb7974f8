"""Megatron's ``GPTDataset``: fixed-length LM samples over a shuffled, multi-epoch document stream.

Index semantics are Megatron-DeepSpeed's exactly (``shared/reference/megatron-compat.md`` section 6.3), so the
same data, seed and flags give the same samples in the same order, and Megatron's cache files are reused as is::

    tokens_per_epoch = sum(sizes[documents])
    num_epochs       = smallest E >= 1 with (E * tokens_per_epoch - 1) // seq_length >= num_samples
    rng = np.random.RandomState(seed), used in this order:
      1. doc_idx     = documents tiled E times (int32), rng.shuffle. If E > 1 and the last epoch would supply
                       fewer than int(0.8 * samples_per_epoch) of the needed samples ("separate last epoch"),
                       epochs 1..E-1 are tiled and shuffled first, then the last epoch on its own, concatenated.
      2. sample_idx  = helpers.build_sample_idx(...): int64 [n + 1, 2] (doc_idx position, token offset),
                       n = (E * tokens_per_epoch - 1) // seq_length; no randomness.
      3. shuffle_idx = permutation of [0, n) (uint32; int64 when n >= 2**32 - 1). With a separate last epoch the
                       samples of the first E-1 epochs are permuted, then the rest separately, concatenated.
    item i: j = shuffle_idx[i]; tokens from sample_idx[j] to sample_idx[j + 1] inclusive -> seq_length + 1 tokens
            (consecutive samples overlap by one token), returned as {"text": int64[seq_length + 1]}.

GPT treats every ``.idx`` sequence as a document (the ``.idx`` ``doc_idx`` is not used). The index arrays are cached
by :mod:`megatron.data.index_cache` (atomic, multi-writer safe) under the md5 of the Megatron description string,
keyed also by the dataset's content (``MMapIndexedDataset.content_id``: a hash of the ``.idx`` and the ``.bin``
size), so re-preprocessing into the same prefix never reuses the old arrays.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron.data import helpers
from megatron.data.index_budget import DatasetRequestError, check_index_fits
from megatron.data.index_cache import cache_file_paths, load_or_build
from megatron.data.index_files import (
    INDEX_FLAGS,
    check_gpt_index_arrays,
    load_index_file,
    resolve_index_file,
)
from megatron.log import log_rank_0

logger = logging.getLogger(__name__)

GPT_INDEX_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")
_MAX_DOC_IDX_ENTRIES = (
    1 << 31
)  # an epoch-tiled doc_idx beyond this is a configuration mistake, not data


def get_train_valid_test_split_(splits_string: str, size: int) -> list[int]:
    """Megatron's ``--split``: boundaries ``[0, a, b, size]`` of train/valid/test over ``size`` sequences.

    The string holds up to three non-negative numbers separated by ``,`` or ``/`` (``"969, 30, 1"``,
    ``"98/2/0"``, ``"1"``); missing parts are 0; they are normalised; boundary k is the running sum of
    ``round(fraction * size)``, then every boundary is shifted so the last one equals ``size``.

    Raises:
        ValueError: not numbers, more than 3 parts, a negative part, or all zero.
    """
    text = str(splits_string)
    sep = "," if "," in text else "/" if "/" in text else None
    parts = text.split(sep) if sep else [text]
    try:
        splits = [float(s) for s in parts]
    except ValueError:
        raise ValueError(
            f"--split {splits_string!r} is not a list of numbers; use up to three weights separated by ',' or "
            "'/', e.g. --split 969,30,1 or --split 98/2/0."
        ) from None
    if len(splits) > 3:
        raise ValueError(
            f"--split {splits_string!r} has {len(splits)} parts; give at most 3 (train, valid, test)."
        )
    if any(s < 0 or not np.isfinite(s) for s in splits) or sum(splits) <= 0:
        raise ValueError(
            f"--split {splits_string!r} needs finite non-negative weights with a positive sum, e.g. 969,30,1."
        )
    splits += [0.0] * (3 - len(splits))
    total = sum(splits)
    fractions = [s / total for s in splits]
    index = [0]
    for fraction in fractions:
        index.append(index[-1] + int(round(fraction * float(size))))
    diff = index[-1] - size
    return [index[0]] + [i - diff for i in index[1:]]


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest ``E >= 1`` with ``(E * tokens_per_epoch - 1) // seq_length >= num_samples`` (Megatron's loop)."""
    needed_tokens = num_samples * seq_length + 1
    return max(1, -(-needed_tokens // tokens_per_epoch))


def build_doc_idx(
    documents: np.ndarray, num_epochs: int, np_rng: np.random.RandomState, separate_last_epoch: bool
) -> np.ndarray:
    """int32 document order over ``num_epochs`` epochs, shuffled with ``np_rng`` (see module docstring)."""
    if not separate_last_epoch or num_epochs == 1:
        doc_idx = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        np_rng.shuffle(doc_idx)
        return doc_idx
    first = build_doc_idx(documents, num_epochs - 1, np_rng, False)
    last = build_doc_idx(documents, 1, np_rng, False)
    return np.concatenate((first, last))


def build_shuffle_idx(
    num_samples: int, total_size: int, np_rng: np.random.RandomState
) -> np.ndarray:
    """Permutation of ``[0, num_samples)`` then, separately, of ``[num_samples, total_size)``."""
    dtype = np.int64 if total_size >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_samples, dtype=dtype)
    np_rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    np_rng.shuffle(last)
    return np.concatenate((first, last))


@dataclass(frozen=True)
class GPTIndexSpec:
    """What one split's sample index is built for: the fields of Megatron's description string (whose md5 names
    the cache files), plus the exact epoch count when one is forced."""

    name: str
    """Split name (``train``/``valid``/``test``)."""
    data_prefix: str
    """The ``--data-path`` prefix, as given."""
    splits_string: str
    """The ``--split`` string."""
    num_samples: int
    """Samples the run will draw; the index holds whole epochs, so it may hold more."""
    seq_length: int
    """Tokens per training sequence; samples have ``seq_length + 1`` tokens."""
    seed: int
    """``--seed``: the document and sample shuffles."""
    exact_num_epochs: int | None = None
    """``--train-data-exact-num-epochs`` (the train split only): the index holds exactly that many epochs."""

    def __post_init__(self) -> None:
        # counts computed with numpy arrive as numpy integers; the description and the arithmetic want ints
        for field in ("num_samples", "seq_length", "seed"):
            object.__setattr__(self, field, int(getattr(self, field)))


def gpt_index_description(
    name: str,
    data_prefix: str,
    num_samples: int,
    num_epochs: int,
    seq_length: int,
    seed: int,
    splits_string: str,
) -> str:
    """Megatron's description string; its md5 names the cache files (so Megatron's caches are found)."""
    return (
        "GPT Dataset\n\n"
        f"Data prefix {data_prefix}\n"
        f"Dataset name {name}\n"
        f"Number of samples {num_samples}\n"
        f"Number of epochs {num_epochs}\n"
        f"Sequence length {seq_length}\n"
        f"Random seed {seed}\n"
        f"Split {splits_string}\n"
    )


def compute_gpt_indices(
    documents: np.ndarray,
    sizes: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
    *,
    use_cpp: bool | None = None,
    num_epochs: int | None = None,
) -> dict[str, np.ndarray]:
    """Build ``doc_idx``, ``sample_idx`` and ``shuffle_idx`` in memory (no cache), Megatron's order of RNG use.

    ``num_epochs`` (``--train-data-exact-num-epochs``) replaces the smallest sufficient count; epochs beyond the
    ones ``num_samples`` needs are shuffled as one (Megatron's separate-last-epoch rule needs a last epoch that
    is only partly used; with more epochs than needed Megatron stops on an assertion instead).
    """
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    needed_epochs = num_epochs_for(tokens_per_epoch, seq_length, num_samples)
    if num_epochs is None:
        num_epochs = needed_epochs
    np_rng = np.random.RandomState(seed=seed)
    separate_last_epoch = False
    samples_first_epochs = 0
    if 1 < num_epochs == needed_epochs:
        samples_first_epochs = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        last_epoch_samples = num_samples - samples_first_epochs
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        # Both hold by the choice of num_epochs; they guard the arithmetic above.
        if not 0 <= last_epoch_samples <= samples_per_epoch + 1:
            raise RuntimeError(
                f"internal: last epoch would supply {last_epoch_samples} samples (epoch: {samples_per_epoch})"
            )
        separate_last_epoch = last_epoch_samples < int(0.80 * samples_per_epoch)
    doc_idx = build_doc_idx(documents, num_epochs, np_rng, separate_last_epoch)
    sample_idx = helpers.build_sample_idx(
        np.ascontiguousarray(sizes, dtype=np.int32),
        doc_idx,
        seq_length,
        num_epochs,
        tokens_per_epoch,
        use_cpp=use_cpp,
    )
    total = sample_idx.shape[0] - 1
    first = samples_first_epochs if separate_last_epoch else total
    shuffle_idx = build_shuffle_idx(first, total, np_rng)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


def _index_checker(num_docs: int, num_epochs: int, num_seqs: int, total: int) -> Any:
    def check(arrays: dict[str, np.ndarray]) -> str | None:
        doc_idx, sample_idx, shuffle_idx = (arrays[n] for n in GPT_INDEX_NAMES)
        if doc_idx.shape != (num_docs * num_epochs,) or doc_idx.dtype != np.int32:
            return (
                f"doc_idx {doc_idx.dtype}{doc_idx.shape}, expected int32({num_docs * num_epochs},)"
            )
        if sample_idx.shape != (total + 1, 2) or sample_idx.dtype not in (np.int64, np.int32):
            return (
                f"sample_idx {sample_idx.dtype}{sample_idx.shape}, expected int64({total + 1}, 2)"
            )
        if shuffle_idx.shape != (total,) or shuffle_idx.dtype not in (np.uint32, np.int64):
            return f"shuffle_idx {shuffle_idx.dtype}{shuffle_idx.shape}, expected ({total},)"
        # Whole-array ranges (no temporaries); the checksums in the .dsc catch values changed within range.
        if len(doc_idx) and (int(doc_idx.min()) < 0 or int(doc_idx.max()) >= num_seqs):
            return "doc_idx holds ids outside the dataset"
        if tuple(sample_idx[0]) != (0, 0) or not 0 <= int(sample_idx[-1, 0]) < len(doc_idx):
            return "sample_idx end rows are out of range"
        if int(sample_idx[:, 0].max()) >= len(doc_idx) or int(sample_idx.min()) < 0:
            return "sample_idx holds positions outside doc_idx"
        if total and int(shuffle_idx.max()) >= total:
            return "shuffle_idx holds samples outside the dataset"
        return None

    return check


def build_index_mappings(
    spec: GPTIndexSpec,
    documents: np.ndarray,
    sizes: np.ndarray,
    *,
    data_cache_path: str | None = None,
    use_cpp: bool | None = None,
    data_identity: str | None = None,
    index_files: Mapping[str, str] | None = None,
) -> tuple[dict[str, np.ndarray], str, str | None]:
    """Cached ``doc_idx``/``sample_idx``/``shuffle_idx`` for one dataset split, its description and cache dir.

    Lookup: ``{dirname(data_prefix)}/index-cache/`` then ``data_cache_path``; a miss builds into the last of them
    (every rank may build; writes are atomic). Arrays come back memory-mapped read-only; the cache directory is
    None when none was writable (arrays then live in memory). ``data_identity`` names the dataset's contents
    (default: a hash of ``sizes``); a cached set built from other contents is rebuilt.

    ``spec.exact_num_epochs`` (``--train-data-exact-num-epochs``): the dataset holds exactly that many epochs of
    its documents (part of the description, as in Megatron). ``index_files`` (``--train-*-idx-path``): arrays read
    from the given ``.npy`` files (see :mod:`megatron.data.index_files`); the others come from the cache as
    usual; the returned cache directory is None when all three are given.

    Raises:
        DatasetRequestError: a request needing an absurd number of epochs, or an index larger than this
            machine's memory (checked before building it).
        ValueError: fewer than 2 tokens in the split, ``seq_length < 1``, ``num_samples < 0``,
            ``exact_num_epochs`` too small for ``num_samples``, or a forced
            index file that does not fit the dataset.
        FileNotFoundError: a forced index file that does not exist.
    """
    name, data_prefix = spec.name, spec.data_prefix
    seq_length, num_samples = spec.seq_length, spec.num_samples
    if seq_length < 1:
        raise ValueError(f"--seq-length must be >= 1, got {seq_length}.")
    if num_samples < 0:
        raise ValueError(
            f"dataset {name!r} of {data_prefix}: num_samples must be >= 0, got {num_samples}."
        )
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    if tokens_per_epoch < 2:
        raise ValueError(
            f"dataset {name!r} of {data_prefix} has {tokens_per_epoch} tokens in its {len(documents)} documents; "
            "a sample needs at least 2. Give this split more data (--split) or use a larger dataset."
        )
    num_epochs = num_epochs_for(tokens_per_epoch, seq_length, num_samples)
    if spec.exact_num_epochs is not None:
        _check_exact_epochs(
            spec.exact_num_epochs, num_epochs, tokens_per_epoch, seq_length, num_samples
        )
        num_epochs = spec.exact_num_epochs
    if num_epochs * len(documents) >= _MAX_DOC_IDX_ENTRIES:
        raise DatasetRequestError(
            f"dataset {name!r} of {data_prefix}: {num_samples} samples of {seq_length} tokens need {num_epochs} "
            f"epochs of its {tokens_per_epoch} tokens; that is not a sensible request. Use more data or fewer "
            "samples (--train-iters/--train-samples, --eval-iters, --split)."
        )
    desc = gpt_index_description(
        name, data_prefix, num_samples, num_epochs, seq_length, spec.seed, spec.splits_string
    )
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    directories = [os.path.join(os.path.dirname(data_prefix), "index-cache")]
    if data_cache_path is not None:
        directories.append(data_cache_path)
    forced = {
        name: resolve_index_file(path, directories, name)
        for name, path in (index_files or {}).items()
    }

    def build() -> dict[str, np.ndarray]:
        where = f"dataset {name!r} of {data_prefix}"
        check_index_fits(where, num_docs=len(documents), num_epochs=num_epochs, total_samples=total)
        start = time.time()
        arrays = compute_gpt_indices(
            documents,
            sizes,
            num_samples,
            seq_length,
            spec.seed,
            use_cpp=use_cpp,
            num_epochs=num_epochs,
        )
        log_rank_0(
            logger,
            "built %s indices of %s: %d epochs, %d samples in %.2f s",
            name,
            data_prefix,
            num_epochs,
            total,
            time.time() - start,
        )
        return arrays

    if data_identity is None:
        data_identity = (
            "sizes-sha256 " + hashlib.sha256(np.ascontiguousarray(sizes).data).hexdigest()[:32]
        )
    check = _index_checker(len(documents), num_epochs, len(sizes), total)
    arrays: dict[str, np.ndarray] = {}
    cache_dir = None
    if len(forced) < len(GPT_INDEX_NAMES):
        arrays, cache_dir = load_or_build(
            directories, desc, GPT_INDEX_NAMES, build, check, identity=data_identity
        )
    if forced:
        arrays = {**arrays, **{name: load_index_file(p, name) for name, p in forced.items()}}
        sources = {name: f"{INDEX_FLAGS[name]} {p}" for name, p in forced.items()}
        check_gpt_index_arrays(
            arrays,
            {n: sources.get(n, f"the index cache in {cache_dir}") for n in GPT_INDEX_NAMES},
            sizes=sizes,
            seq_length=seq_length,
            num_samples=num_samples,
        )
        log_rank_0(
            logger, "%s indices of %s read from %s", name, data_prefix, ", ".join(sources.values())
        )
    return arrays, desc, cache_dir


def _check_exact_epochs(
    exact: int, needed: int, tokens_per_epoch: int, seq_length: int, num_samples: int
) -> None:
    if exact < 1:
        raise ValueError(f"--train-data-exact-num-epochs must be >= 1, got {exact}.")
    if exact < needed:
        have = (exact * tokens_per_epoch - 1) // seq_length
        raise ValueError(
            f"--train-data-exact-num-epochs {exact}: {exact} epoch(s) of the training data ({tokens_per_epoch} "
            f"tokens each) make {have} samples of --seq-length {seq_length}, but the run draws {num_samples}; "
            f"use at least {needed} epochs, train for fewer iterations, or drop the flag."
        )


class GPTDataset(torch.utils.data.Dataset):
    """Megatron's GPT dataset over one split (``documents``) of an ``MMapIndexedDataset``.

    Args:
        spec: the split's name, prefix, ``--split`` string, sample count, sequence length and seed (the cache
            description); the dataset holds whole epochs, so ``len(self) >= spec.num_samples``, and items have
            ``spec.seq_length + 1`` tokens.
        documents: int32 sequence ids of this split (contiguous range in Megatron's splits).
        indexed_dataset: object with int32 ``.sizes`` and ``.get(i, offset=0, length=None)``.
        data_cache_path: ``--data-cache-path`` (default ``index-cache/`` beside the data).
        use_cpp: force (True) or forbid (False) the C++ index helpers; None picks them when built.
        index_files: ``{"doc_idx": path, ...}`` from ``--train-*-idx-path`` (train split only).
        return_index: ``--return-data-index``: items also hold ``"index"``, int64 ``[1]``, the position asked
            for (before shuffling), as Megatron-DeepSpeed's items do; GPT training does not read it.

    Raises:
        ValueError: document ids outside the indexed dataset, or see :func:`build_index_mappings`.
    """

    def __init__(
        self,
        spec: GPTIndexSpec,
        documents: np.ndarray,
        indexed_dataset: Any,
        *,
        data_cache_path: str | None = None,
        use_cpp: bool | None = None,
        index_files: Mapping[str, str] | None = None,
        return_index: bool = False,
    ) -> None:
        documents = np.asarray(documents)
        num_seqs = len(indexed_dataset.sizes)
        if len(documents) == 0 or documents.min() < 0 or documents.max() >= num_seqs:
            raise ValueError(
                f"dataset {spec.name!r} of {spec.data_prefix}: documents must be a non-empty set of ids in "
                f"[0, {num_seqs}); got {len(documents)} ids"
                + (f" in [{documents.min()}, {documents.max()}]" if len(documents) else "")
                + "."
            )
        self.name = spec.name
        self.data_prefix = spec.data_prefix
        self.indexed_dataset = indexed_dataset
        self.seq_length = spec.seq_length
        arrays, self.desc, self.cache_dir = build_index_mappings(
            spec,
            documents,
            indexed_dataset.sizes,
            data_cache_path=data_cache_path,
            use_cpp=use_cpp,
            data_identity=getattr(indexed_dataset, "content_id", None),
            index_files=index_files,
        )
        self.return_index = bool(return_index)
        self.doc_idx = arrays["doc_idx"]
        self.sample_idx = arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]
        # Arrays backed by files, re-mapped (not copied) in DataLoader workers started with "spawn".
        self.index_paths: dict[str, str] = {}
        if self.cache_dir is not None:
            self.index_paths = cache_file_paths(self.cache_dir, self.desc, GPT_INDEX_NAMES)
            del self.index_paths["desc"]
        for name in index_files or {}:
            filename = getattr(
                arrays[name], "filename", None
            )  # None: an empty array, held in memory
            if filename is not None:
                self.index_paths[name] = str(filename)
            else:
                self.index_paths.pop(name, None)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in self.index_paths:
            state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("index_paths", {})
        self.__dict__.update(state)
        for name, path in self.index_paths.items():
            setattr(self, name, np.load(path, mmap_mode="r", allow_pickle=False))

    def __len__(self) -> int:
        return self.sample_idx.shape[0] - 1

    def get_tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of (shuffled) sample ``idx`` as int64."""
        if not 0 <= idx < len(self):
            raise IndexError(
                f"sample {idx} out of range for {self.name} dataset of {len(self)} samples"
            )
        j = int(self.shuffle_idx[idx])
        doc_f, offset_f = (int(x) for x in self.sample_idx[j])
        doc_l, offset_l = (int(x) for x in self.sample_idx[j + 1])
        get = self.indexed_dataset.get
        if doc_f == doc_l:
            sample = get(int(self.doc_idx[doc_f]), offset=offset_f, length=offset_l - offset_f + 1)
            return np.array(sample, dtype=np.int64)
        parts = [get(int(self.doc_idx[doc_f]), offset=offset_f)]
        parts.extend(get(int(self.doc_idx[k])) for k in range(doc_f + 1, doc_l))
        parts.append(get(int(self.doc_idx[doc_l]), length=offset_l + 1))
        return np.concatenate(parts).astype(np.int64, copy=False)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        item = {"text": self.get_tokens(int(idx))}
        if self.return_index:
            item["index"] = np.array([int(idx)], dtype=np.int64)
        return item
