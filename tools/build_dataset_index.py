"""Prebuild the GPT index cache (doc/sample/shuffle indices) for a training configuration, off-cluster.

Takes the training run's own Megatron flags (unrelated model flags are accepted and ignored) and computes the
sample counts as the trainer does: train = --train-samples or --train-iters x --global-batch-size; valid =
(train_iters // --eval-interval + 1) x --eval-iters x GBS; test = --eval-iters x GBS. The files land where the
trainer looks (``index-cache/`` beside the data, or --data-cache-path), named by Megatron's md5 scheme, so the
training job finds them and builds nothing. Writes are atomic: running this while a job reads the cache is safe.

    python -m tools.build_dataset_index --data-path 0.3 data/a_text_document 0.7 data/b_text_document \\
        --split 969,30,1 --seq-length 2048 --seed 1234 --train-iters 100000 --global-batch-size 512 \\
        --eval-interval 1000 --eval-iters 10 [--data-cache-path /shared/index-cache]

A configuration whose training set gets no documents (e.g. --split gives train a share that rounds to 0
documents, or the dataset is empty) is an error naming --split and the document counts: the trainer could not
run on it. Valid/test without data are reported as "no data" (allowed, as in Megatron).

Exit codes: 0 ok, 1 bad input (one ``error:`` line), 2 bad flags (argparse).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from megatron.config import build_parser, config_from_namespace
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.builders import (
    SPLIT_NAMES,
    build_train_valid_test_datasets,
    get_train_valid_test_num_samples,
    parse_data_path,
)
from megatron.data.gpt_dataset import get_train_valid_test_split_
from megatron.data.index_cache import desc_hash
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.log import setup_logging


def _describe(name: str, ds: Any) -> list[str]:
    if ds is None:
        return [f"{name}: no data"]
    if isinstance(ds, BlendableDataset):
        lines = [f"{name}: blend of {len(ds.datasets)} datasets, {len(ds):,} samples"]
        for sub, w in zip(ds.datasets, ds.weights):
            lines += ["  " + line for line in _describe(f"weight {w:.4f}", sub)]
        return lines
    where = f"{ds.cache_dir}/{desc_hash(ds.desc)}_*" if ds.cache_dir else "not cached (unwritable)"
    return [f"{name}: {ds.data_prefix}: {len(ds):,} samples -> {where}"]


def _check_train_data(data: Any) -> None:
    """Refuse, before anything is built, a configuration whose training set gets no documents.

    Raises:
        ValueError: names --split and each dataset's document count (or the missing --train-data-path).
    """
    if data.mock_data or data.train_data_path:
        return
    if not data.data_path:
        raise ValueError(
            "the training set has no data: --valid-data-path/--test-data-path are given without "
            "--train-data-path; add --train-data-path (or use --data-path with --split)."
        )
    prefixes, _ = parse_data_path(data.data_path)
    if not all(MMapIndexedDataset.exists(p) for p in prefixes):
        return  # the builder names the missing files
    parts, train_docs = [], 0
    for prefix in prefixes:
        n = len(MMapIndexedDataset(prefix).sizes)
        b = get_train_valid_test_split_(data.split, n)
        train_docs += b[1] - b[0]
        parts.append(
            f"{prefix} has {n:,} document(s) -> train {b[1] - b[0]:,}, valid {b[2] - b[1]:,}, "
            f"test {b[3] - b[2]:,}"
        )
    if train_docs == 0:
        raise ValueError(
            f"--split {data.split!r} gives the training set no documents: {'; '.join(parts)}. Give train a "
            "larger share of --split (e.g. --split 969,30,1), or use a dataset with more documents (an empty "
            "one needs tools/preprocess_data.py re-run on input with text)."
        )


def main(argv: list[str] | None = None) -> int:
    setup_logging(logging.INFO)
    try:
        args = build_parser("build_dataset_index.py").parse_args(argv)
        cfg = config_from_namespace(args)
        if cfg.data.mock_data:
            raise ValueError(
                "--mock-data has no index to build; pass --data-path or --train-data-path."
            )
        gbs = cfg.training.global_batch_size
        if gbs is None:
            raise ValueError(
                "--global-batch-size is required here: off-cluster the data-parallel size is unknown, so the "
                "trainer's default (micro batch x DP) cannot be derived."
            )
        counts = get_train_valid_test_num_samples(
            train_iters=cfg.training.train_iters,
            train_samples=cfg.training.train_samples,
            global_batch_size=gbs,
            eval_interval=cfg.training.eval_interval,
            eval_iters=cfg.training.eval_iters,
        )
        if counts[0] > 0:
            _check_train_data(cfg.data)
        start = time.time()
        datasets = build_train_valid_test_datasets(
            cfg.data,
            seq_length=cfg.model.seq_length,
            seed=cfg.training.seed,
            train_valid_test_num_samples=counts,
        )
    except (ValueError, OSError) as e:  # OSError: missing data files, unwritable cache
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"sample targets: train {counts[0]:,}, valid {counts[1]:,}, test {counts[2]:,}")
    for name, ds in zip(SPLIT_NAMES, datasets):
        print("\n".join(_describe(name, ds)))
    print(f"done in {time.time() - start:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
