"""The trainer's entry to the data pipeline: train/valid/test datasets from a :class:`DataConfig`.

    counts = get_train_valid_test_num_samples(train_iters=..., train_samples=None, global_batch_size=...,
                                              eval_interval=..., eval_iters=...)
    train, valid, test = build_train_valid_test_datasets(cfg.data, seq_length=..., seed=...,
                                                         train_valid_test_num_samples=counts)

Sources, as in Megatron-DeepSpeed: ``--mock-data``; ``--data-path PREFIX`` (split by ``--split``);
``--data-path W1 P1 W2 P2 ...`` (each prefix split, then a :class:`BlendableDataset` per split, each dataset built
with ``ceil(n * w * 1.005)`` samples and the blend sized to their sum); or ``--train-data-path`` /
``--valid-data-path`` / ``--test-data-path`` (each a prefix or a weighted list, whole files, ``--split`` ignored).
Every rank calls this; all input checks run before any index is built, so all ranks fail alike.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron.config.data import DataConfig
from megatron.data.blendable_dataset import BlendableDataset, normalize_weights
from megatron.data.gpt_dataset import GPTDataset, GPTIndexSpec, get_train_valid_test_split_
from megatron.data.helpers import num_blend_samples
from megatron.data.indexed_dataset import MMapIndexedDataset, loss_mask_prefix
from megatron.data.mock_dataset import MockGPTDataset
from megatron.data.sft_dataset import (
    SFTDataset,
    SFTIndexSpec,
    check_loss_mask,
)
from megatron.log import log_rank_0

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")


def get_train_valid_test_num_samples(
    *,
    train_iters: int | None,
    train_samples: int | None,
    global_batch_size: int,
    eval_interval: int,
    eval_iters: int,
) -> tuple[int, int, int]:
    """Megatron's sample targets: train = samples or iters x G; valid = (iters // interval + 1) x eval_iters x G;
    test = eval_iters x G (with ``--train-samples``, iters = samples // G).

    Raises:
        ValueError: neither or both of train_iters/train_samples, or non-positive sizes.
    """
    if (train_iters is None) == (train_samples is None):
        raise ValueError("give exactly one of --train-iters and --train-samples.")
    if global_batch_size < 1 or eval_interval < 1 or eval_iters < 0:
        raise ValueError(
            f"--global-batch-size ({global_batch_size}) and --eval-interval ({eval_interval}) must be >= 1 and "
            f"--eval-iters ({eval_iters}) >= 0."
        )
    if train_samples is not None:
        train = int(train_samples)
        iters = train // global_batch_size
    else:
        iters = int(train_iters)  # type: ignore[arg-type]
        train = iters * global_batch_size
    valid = (iters // eval_interval + 1) * eval_iters * global_batch_size
    test = eval_iters * global_batch_size
    return train, valid, test


def parse_data_path(
    values: Sequence[str], flag: str = "--data-path"
) -> tuple[list[str], list[float]]:
    """``PREFIX`` -> ``([PREFIX], [1.0])``; ``W1 P1 W2 P2 ...`` -> prefixes and normalised weights.

    Raises:
        ValueError: an odd count, a weight that is not a number, or bad weights.
    """
    values = [str(v).strip() for v in values]
    if len(values) == 1:
        return [values[0]], [1.0]
    if len(values) == 0 or len(values) % 2:
        raise ValueError(
            f"{flag} takes one PREFIX or pairs 'W1 PREFIX1 W2 PREFIX2 ...'; got {len(values)} values: {values}."
        )
    weights, prefixes = [], []
    for w, p in zip(values[0::2], values[1::2]):
        try:
            weights.append(float(w))
        except ValueError:
            raise ValueError(
                f"{flag}: {w!r} is not a weight; a blend is given as weight/prefix pairs, e.g. "
                f"{flag} 0.3 data/a_text_document 0.7 data/b_text_document."
            ) from None
        prefixes.append(p)
    normalized = [float(x) for x in normalize_weights(weights, f"{flag} weights")]
    for w, p in zip(weights, prefixes):
        if w == 0:
            raise ValueError(
                f"{flag}: weight 0 for {p!r}; remove it from the blend (Megatron's greedy blending would still "
                "draw from it when the other datasets are exactly on target)."
            )
    return prefixes, normalized


def _gpt_dataset(
    spec: GPTIndexSpec,
    documents: np.ndarray,
    indexed: MMapIndexedDataset,
    data_cfg: DataConfig,
    use_cpp: bool | None,
) -> GPTDataset | SFTDataset:
    """One GPTDataset with the Megatron-DeepSpeed data flags; the index flags apply to the train split. With
    --sft the packed conversations of the same split instead (``sft_dataset.py``)."""
    if data_cfg.sft:
        sft = SFTIndexSpec(
            spec.name,
            spec.data_prefix,
            spec.splits_string,
            spec.num_samples,
            spec.seq_length,
            spec.seed,
        )
        mask = MMapIndexedDataset(loss_mask_prefix(spec.data_prefix))
        return SFTDataset(sft, documents, indexed, mask, data_cache_path=data_cfg.data_cache_path)
    train = spec.name == "train"
    if train:
        spec = dataclasses.replace(spec, exact_num_epochs=data_cfg.train_data_exact_num_epochs)
    return GPTDataset(
        spec,
        documents,
        indexed,
        data_cache_path=data_cfg.data_cache_path,
        use_cpp=use_cpp,
        index_files=index_files(data_cfg) if train else None,
        return_index=data_cfg.return_data_index,
    )


def index_files(data_cfg: DataConfig) -> dict[str, str]:
    """``{"doc_idx": path, ...}`` of the --train-*-idx-path flags given."""
    given = {
        "doc_idx": data_cfg.train_doc_idx_path,
        "sample_idx": data_cfg.train_sample_idx_path,
        "shuffle_idx": data_cfg.train_shuffle_idx_path,
    }
    return {name: path for name, path in given.items() if path is not None}


def check_index_flags(data_cfg: DataConfig, num_train_prefixes: int) -> None:
    """The forced-index and exact-epoch flags need one real training dataset (not mock data, not a blend)."""
    flags = [f"--train-{name.replace('_', '-')}-path" for name in index_files(data_cfg)]
    if data_cfg.train_data_exact_num_epochs is not None:
        flags.append("--train-data-exact-num-epochs")
    if not flags:
        return
    if data_cfg.mock_data:
        raise ValueError(
            f"{', '.join(flags)}: only for a .bin/.idx training dataset, and --mock-data has no documents; "
            "use --data-path or --train-data-path, or drop the flag."
        )
    if index_files(data_cfg) and num_train_prefixes > 1:
        raise ValueError(
            f"{' and '.join(f for f in flags if f.endswith('idx-path'))} give(s) the indices of ONE training "
            f"dataset, but the training data blends {num_train_prefixes} datasets; use a single --data-path or "
            "--train-data-path prefix, or drop the flag(s)."
        )


def _open_indexed(prefix: str, flag: str, *, sft: bool = False) -> MMapIndexedDataset:
    if not MMapIndexedDataset.exists(prefix):
        missing = [f"{prefix}{ext}" for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        raise FileNotFoundError(
            f"{flag}: dataset prefix {prefix!r} not found ({', '.join(missing)} missing). Pass the prefix without "
            "extension as written by tools/preprocess_data.py, e.g. data/my-gpt2_text_document."
        )
    if sft:
        check_loss_mask(prefix, flag)
    return MMapIndexedDataset(prefix)


def _split_datasets(
    prefix: str,
    data_cfg: DataConfig,
    num_samples: Sequence[int],
    seq_length: int,
    seed: int,
    use_cpp: bool | None,
) -> list[GPTDataset | None]:
    """One prefix cut by ``--split`` into up to three GPTDatasets (None for an empty split)."""
    indexed = _open_indexed(prefix, "--data-path", sft=data_cfg.sft)
    splits = get_train_valid_test_split_(data_cfg.split, len(indexed.sizes))
    out: list[GPTDataset | None] = []
    for i, name in enumerate(SPLIT_NAMES):
        if splits[i + 1] <= splits[i]:
            out.append(None)
            continue
        documents = np.arange(splits[i], splits[i + 1], dtype=np.int32)
        spec = GPTIndexSpec(name, prefix, data_cfg.split, num_samples[i], seq_length, seed)
        out.append(_gpt_dataset(spec, documents, indexed, data_cfg, use_cpp))
    return out


def _whole_file_dataset(
    name: str,
    values: Sequence[str],
    flag: str,
    data_cfg: DataConfig,
    num_samples: int,
    seq_length: int,
    seed: int,
    use_cpp: bool | None,
) -> Any:
    """``--{name}-data-path``: a prefix or a weighted blend of whole files (``--split`` ignored)."""
    prefixes, weights = parse_data_path(values, flag)
    indexed = [
        _open_indexed(p, flag, sft=data_cfg.sft) for p in prefixes
    ]  # check every file before building anything
    counts = (
        [num_samples]
        if len(prefixes) == 1
        else [num_blend_samples(w, num_samples) for w in weights]
    )
    datasets = [
        _gpt_dataset(
            GPTIndexSpec(name, p, data_cfg.split, n, seq_length, seed),
            np.arange(len(ds.sizes), dtype=np.int32),
            ds,
            data_cfg,
            use_cpp,
        )
        for p, ds, n in zip(prefixes, indexed, counts)
    ]
    if len(datasets) == 1:
        return datasets[0]
    return BlendableDataset(
        datasets, weights, sum(counts), data_cfg.data_cache_path, use_cpp=use_cpp
    )


def _blended_split_datasets(
    prefixes: Sequence[str],
    weights: Sequence[float],
    data_cfg: DataConfig,
    counts: Sequence[int],
    seq_length: int,
    seed: int,
    use_cpp: bool | None,
) -> tuple[Any, Any, Any]:
    """``--data-path W1 P1 W2 P2 ...``: split every prefix, then blend each split (Megatron's sizes)."""
    per_dataset = [[num_blend_samples(w, n) for n in counts] for w in weights]
    parts = [
        _split_datasets(p, data_cfg, n, seq_length, seed, use_cpp)
        for p, n in zip(prefixes, per_dataset)
    ]
    blends: list[Any] = []
    for i in range(3):
        members = [(part[i], w, n[i]) for part, w, n in zip(parts, weights, per_dataset)]
        members = [m for m in members if m[0] is not None]
        size = sum(m[2] for m in members)
        if size == 0:
            blends.append(None)
            continue
        blends.append(
            BlendableDataset(
                [m[0] for m in members],
                [m[1] for m in members],
                size,
                data_cfg.data_cache_path,
                use_cpp=use_cpp,
            )
        )
    return blends[0], blends[1], blends[2]


def build_train_valid_test_datasets(
    data_cfg: DataConfig,
    *,
    seq_length: int,
    seed: int,
    train_valid_test_num_samples: Sequence[int],
    vocab_size: int | None = None,
    use_cpp: bool | None = None,
) -> tuple[Any, Any, Any]:
    """Train, valid and test datasets (each None when it has no data) for a run.

    Args:
        data_cfg: the run's :class:`DataConfig` (paths, split, cache path, mock data).
        seq_length: ``--seq-length``.
        seed: ``--seed``.
        train_valid_test_num_samples: targets, see :func:`get_train_valid_test_num_samples`.
        vocab_size: token-id bound for ``--mock-data`` (default ``data_cfg.vocab_size``).
        use_cpp: force (True) or forbid (False) the C++ index helpers; None picks them when built.

    Returns:
        ``(train, valid, test)``: map-style datasets with items ``{"text": int64[seq_length + 1]}`` (blends add
        ``"dataset_idx"``).

    Raises:
        ValueError: conflicting or missing sources, bad --split / --data-path, impossible sample counts.
        FileNotFoundError: a dataset prefix without its .bin/.idx.
    """
    counts = [int(n) for n in train_valid_test_num_samples]
    if len(counts) != 3 or min(counts) < 0:
        raise ValueError(
            f"train_valid_test_num_samples must be 3 non-negative counts, got {list(train_valid_test_num_samples)}."
        )
    separate = (data_cfg.train_data_path, data_cfg.valid_data_path, data_cfg.test_data_path)
    sources = sum([bool(data_cfg.mock_data), bool(data_cfg.data_path), any(separate)])
    if sources != 1:
        raise ValueError(
            "give exactly one data source: --mock-data, --data-path, or --train-data-path/--valid-data-path/"
            f"--test-data-path (got {sources})."
        )
    train_flag = "--data-path" if data_cfg.data_path else "--train-data-path"
    train_values = data_cfg.data_path or data_cfg.train_data_path
    check_index_flags(
        data_cfg, len(parse_data_path(train_values, train_flag)[0]) if train_values else 0
    )
    if data_cfg.mock_data:
        vocab = vocab_size if vocab_size is not None else data_cfg.vocab_size
        if vocab is None:
            raise ValueError(
                "--mock-data needs a vocabulary size: pass --vocab-size or a tokenizer."
            )
        return tuple(  # type: ignore[return-value]
            MockGPTDataset(n, seq_length, vocab, seed + 1000 * i, name) if n > 0 else None
            for i, (name, n) in enumerate(zip(SPLIT_NAMES, counts))
        )
    if data_cfg.data_path:
        get_train_valid_test_split_(data_cfg.split, 1)  # validate the string before touching files
        prefixes, weights = parse_data_path(data_cfg.data_path)
        for p in prefixes:
            _open_indexed(p, "--data-path", sft=data_cfg.sft)
        if len(prefixes) == 1:
            log_rank_0(
                logger, "building GPT datasets from %s (split %s)", prefixes[0], data_cfg.split
            )
            return tuple(_split_datasets(prefixes[0], data_cfg, counts, seq_length, seed, use_cpp))  # type: ignore[return-value]
        return _blended_split_datasets(
            prefixes, weights, data_cfg, counts, seq_length, seed, use_cpp
        )
    out = []
    for i, (name, values) in enumerate(zip(SPLIT_NAMES, separate)):
        flag = f"--{name}-data-path"
        out.append(
            _whole_file_dataset(name, values, flag, data_cfg, counts[i], seq_length, seed, use_cpp)
            if values
            else None
        )
    return tuple(out)  # type: ignore[return-value]
