"""Tokenizer, datasets and the per-rank micro-batch iterators of a run.

Every rank reads its own micro-batches (no broadcast over TP: each TP rank of a DP index draws the same indices
from the same files). The sampler (``megatron.data.samplers``) keys the order to the GLOBAL batch: global batch
``k`` is sample positions ``[k*G, (k+1)*G)`` whatever the DP size, so every layout trains on the same samples in
the same steps.

Context parallelism and DeepSpeed-Ulysses: the ranks splitting one sequence (one DP index) read the same
micro-batch and keep their own tokens of every ``[b, s]`` tensor (:class:`SequenceSplit`): CP rank ``r`` of ``N``
chunks ``r`` and ``2N-1-r`` of ``2N`` (``model/token_layout.py``), Ulysses rank ``u`` of ``sp`` the ``u``-th
contiguous ``1/sp`` of those. The position ids are gathered with the tokens, so they stay global.

Sample counts are Megatron's (``megatron.data.builders.get_train_valid_test_num_samples``): train = train iters x G;
valid = (train iters // eval interval + 1) x eval iters x G; test = eval iters x G.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron.config import DataConfig, RunPlan, TridentConfig
from megatron.data.batch import prepare_gpt_batch, take_positions
from megatron.data.samplers import BatchLayout, build_pretraining_data_loader
from megatron.data.sft_dataset import dense_document_attention_mask, prepare_sft_batch
from megatron.launch.exit_codes import ConfigError
from megatron.log import log_rank_0
from megatron.model.token_layout import document_ids, load_balanced_positions
from megatron.mpu.parallel_state import ParallelState
from megatron.training.curriculum import CurrentSeqlen, truncate_batch
from megatron.training.initialize import Distributed
from megatron.training.token_weights import GlobalTokenWeights

Batch = dict[str, torch.Tensor]
logger = logging.getLogger(__name__)


def check_data_flags(cfg: TridentConfig) -> None:
    """Data/tokenizer flag checks that ``validate()`` leaves to the trainer (no process group needed).

    Raises:
        ValueError: no data source, or no way to know the vocabulary.
    """
    d = cfg.data
    given = [
        flag
        for flag, on in (
            ("--mock-data", d.mock_data),
            ("--data-path", bool(d.data_path)),
            (
                "--train/valid/test-data-path",
                bool(d.train_data_path or d.valid_data_path or d.test_data_path),
            ),
        )
        if on
    ]
    if not given:
        raise ValueError(
            "no training data: give --data-path PREFIX (from tools/preprocess_data.py), --train-data-path, "
            "or --mock-data for synthetic tokens."
        )
    if len(given) > 1:
        raise ValueError(f"give exactly one data source; got {' and '.join(given)}.")
    if (d.valid_data_path or d.test_data_path) and not d.train_data_path:
        raise ValueError("--valid-data-path/--test-data-path need --train-data-path too.")
    if d.tokenizer_type is None and d.vocab_size is None:
        raise ValueError(
            "no tokenizer: give --tokenizer-type (GPT2BPETokenizer, SentencePieceTokenizer, "
            "GPTSentencePieceTokenizer, HFTokenizer, NullTokenizer) or --vocab-size N (NullTokenizer)."
        )
    _check_data_files(cfg)
    _check_index_files(cfg)


def _check_data_files(cfg: TridentConfig) -> None:
    """Every --*data-path prefix has a readable .bin/.idx pair, --split parses, and the training data is not empty
    (FileNotFoundError / ValueError naming the flag and the files)."""
    from megatron.data.builders import parse_data_path
    from megatron.data.gpt_dataset import get_train_valid_test_split_
    from megatron.data.indexed_dataset import MMapIndexedDataset
    from megatron.data.sft_dataset import check_loss_mask

    d = cfg.data
    if d.data_path:
        get_train_valid_test_split_(d.split, 1)  # the string itself (ValueError naming --split)
    for flag, values in (
        ("--data-path", d.data_path),
        ("--train-data-path", d.train_data_path),
        ("--valid-data-path", d.valid_data_path),
        ("--test-data-path", d.test_data_path),
    ):
        if not values:
            continue
        prefixes, _ = parse_data_path(values, flag)
        for prefix in prefixes:
            missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                raise FileNotFoundError(
                    f"{flag} {prefix}: missing {', '.join(missing)}; give the prefix that "
                    "tools/preprocess_data.py wrote (without .bin/.idx)."
                )
            try:
                docs = len(MMapIndexedDataset(prefix))
            except (ValueError, OSError) as err:
                raise ValueError(f"{flag} {prefix}: unreadable dataset ({err}).") from None
            if d.sft:
                check_loss_mask(prefix, flag)  # P_loss_mask beside P, document by document
            train_docs = docs
            if flag == "--data-path":
                bounds = get_train_valid_test_split_(d.split, docs)
                train_docs = bounds[1] - bounds[0]
            training = flag in ("--data-path", "--train-data-path") and not cfg.training.skip_train
            if training and train_docs == 0:
                raise ValueError(
                    f"{flag} {prefix}: no training documents ({docs} documents in the dataset"
                    + (f", split {d.split!r} gives training none" if flag == "--data-path" else "")
                    + "); preprocess more text or give training a share of --split."
                )


def _check_index_files(cfg: TridentConfig) -> None:
    """--train-*-idx-path / --train-data-exact-num-epochs before any rank starts: one real training dataset, and
    forced index files that exist, load and fit it (their sample count is checked when the datasets are built)."""
    from megatron.data.builders import check_index_flags, index_files, parse_data_path
    from megatron.data.index_files import (
        check_gpt_index_arrays,
        check_index_file_kind,
        load_index_file,
        resolve_index_file,
    )
    from megatron.data.indexed_dataset import MMapIndexedDataset

    d = cfg.data
    flag = "--data-path" if d.data_path else "--train-data-path"
    values = d.data_path or d.train_data_path
    prefixes = parse_data_path(values, flag)[0] if values else []
    check_index_flags(d, len(prefixes))
    forced = index_files(d)
    if not forced or len(prefixes) != 1:
        return
    directories = [os.path.join(os.path.dirname(prefixes[0]), "index-cache")]
    directories += [d.data_cache_path] if d.data_cache_path is not None else []
    paths = {n: resolve_index_file(p, directories, n) for n, p in forced.items()}
    arrays = {n: load_index_file(p, n) for n, p in paths.items()}
    sources = {n: f"--train-{n.replace('_', '-')}-path {p}" for n, p in paths.items()}
    for name, array in arrays.items():
        check_index_file_kind(array, name, sources[name])
    if len(paths) < 3:
        return  # the others come from the index cache, built with the datasets
    sizes = MMapIndexedDataset(prefixes[0]).sizes
    check_gpt_index_arrays(
        arrays, sources, sizes=sizes, seq_length=cfg.model.seq_length, num_samples=0
    )


def check_data_vocab(d: DataConfig, vocab_size: int, sample_tokens: int = 1 << 23) -> None:
    """Token ids in the --*data-path datasets must be < the tokenizer's vocabulary: a dataset preprocessed with
    another tokenizer otherwise fails inside the model, on some ranks only. Reads up to ``sample_tokens`` tokens
    in all (a blend's datasets share them), spread over 64 chunks of each file (a sample: cheap at any size, and a foreign tokenizer's ids
    almost always show up in it).

    Raises:
        ValueError: naming the flag, the prefix, the id found and the vocabulary.
    """
    import numpy as np

    from megatron.data.builders import parse_data_path
    from megatron.data.indexed_dataset import MMapIndexedDataset

    for flag, values in (
        ("--data-path", d.data_path),
        ("--train-data-path", d.train_data_path),
        ("--valid-data-path", d.valid_data_path),
        ("--test-data-path", d.test_data_path),
    ):
        prefixes = parse_data_path(values, flag)[0] if values else []
        budget = max(1 << 12, sample_tokens // max(1, len(prefixes)))  # a blend shares the sample
        for prefix in prefixes:
            if os.path.getsize(prefix + ".bin") == 0:
                continue
            dtype = np.dtype(MMapIndexedDataset(prefix).dtype)
            tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
            chunk = max(1, min(len(tokens), budget) // 64)
            starts = np.linspace(0, max(len(tokens) - chunk, 0), num=64, dtype=np.int64)
            top = max((int(tokens[s : s + chunk].max()) for s in starts if len(tokens)), default=-1)
            if top >= vocab_size:
                raise ValueError(
                    f"{flag} {prefix}: holds token id {top} but the tokenizer has {vocab_size} tokens; the "
                    "data was preprocessed with another tokenizer. Pass that tokenizer's flags (or "
                    "re-run tools/preprocess_data.py with this one)."
                )


def build_run_tokenizer(d: DataConfig) -> Any:
    """--tokenizer-type's tokenizer, or NullTokenizer(--vocab-size) when only --vocab-size is given."""
    from megatron.tokenizer.tokenizer import build_tokenizer

    if d.tokenizer_type is None:
        return build_tokenizer(d, tokenizer_type="NullTokenizer")
    return build_tokenizer(d)


def build_datasets(
    cfg: TridentConfig, tokenizer: Any, *, train_iters: int, global_batch: int
) -> tuple[Any, Any, Any]:
    """(train, valid, test) datasets with Megatron's sample counts (None where there is none).

    Raises:
        ConfigError: a forced --train-*-idx-path file does not fit the dataset (checked here, on every rank alike,
            when the other arrays come from the index cache: one line and exit 2, not a traceback), or the samples
            asked for need an absurd number of epochs or an index larger than this machine's memory.
    """
    from megatron.data.builders import (
        build_train_valid_test_datasets,
        get_train_valid_test_num_samples,
    )
    from megatron.data.index_budget import DatasetRequestError
    from megatron.data.index_files import IndexFileError

    t = cfg.training
    counts = get_train_valid_test_num_samples(
        train_iters=train_iters,
        train_samples=None,
        global_batch_size=global_batch,
        eval_interval=t.eval_interval,
        eval_iters=t.eval_iters,
    )
    try:
        return build_train_valid_test_datasets(
            cfg.data,
            seq_length=cfg.model.seq_length,
            seed=t.seed,
            train_valid_test_num_samples=counts,
            vocab_size=tokenizer.vocab_size,
        )
    except (IndexFileError, DatasetRequestError) as err:
        raise ConfigError(str(err)) from None


@dataclass
class LossTokenCount:
    """Loss tokens (ones of the loss mask) in the training micro-batches this rank drew since the last
    :meth:`take` (counted on the host, before the batch moves to the device: no device sync)."""

    value: int = 0

    def take(self) -> int:
        """The count so far; restarts it at 0."""
        value, self.value = self.value, 0
        return value


@dataclass(frozen=True)
class BatchRecipe:
    """How the samples of a micro-batch become model inputs (Megatron's ``get_batch`` minus the broadcast)."""

    data: DataConfig
    """--reset-position-ids, --reset-attention-mask, --eod-mask-loss."""
    eod: int
    """The tokenizer's end-of-document id."""
    dense_mask: bool = False
    """Packed documents as the dense ``[b, 1, s, s]`` mask (see :func:`dense_document_mask`), not document ids."""

    def make(self, text: torch.Tensor) -> Batch:
        """``text [b, s + 1]`` -> tokens, labels, loss_mask, position_ids ``[b, s]``; with --reset-attention-mask
        also ``document_ids [b, s]`` (``model.token_layout.document_ids``; the model attends through
        ``PackedDocuments``, no ``[s, s]`` tensor), or the dense ``attention_mask`` when ``dense_mask``."""
        d = self.data
        batch = prepare_gpt_batch(
            text,
            eod=self.eod,
            reset_position_ids=d.reset_position_ids,
            reset_attention_mask=d.reset_attention_mask,
            eod_mask_loss=d.eod_mask_loss,
            skip_mask=not self.dense_mask,
        )
        out = {k: v for k, v in batch.items() if v is not None}
        if d.reset_attention_mask and not self.dense_mask:
            out["document_ids"] = document_ids(out["tokens"], self.eod)  # [b, s] int64
        return out

    def make_item(self, raw: dict[str, torch.Tensor]) -> Batch:
        """A collated batch of dataset items -> model inputs: :meth:`make` of its ``text``, or with --sft the
        packed conversations (``data/sft_dataset.py``: document ids, per-conversation positions, the stored loss
        mask aligned to the labels; the dense ``[b, 1, s, s]`` mask instead of the ids when ``dense_mask``)."""
        if not self.data.sft:
            return self.make(raw["text"])
        batch = prepare_sft_batch(raw["text"], raw["loss_mask"], raw["document_ids"])
        if self.dense_mask:
            batch["attention_mask"] = dense_document_attention_mask(batch.pop("document_ids"))
        return batch


def dense_document_mask(cfg: TridentConfig) -> bool:
    """True where packed documents keep the dense ``[b, 1, s, s]`` mask: --reset-attention-mask or --sft with
    --attention-dropout > 0 (the document-id attention has no dropout; at PP > 1 ``validate()`` refuses it)."""
    packed = cfg.data.reset_attention_mask or cfg.data.sft
    return packed and cfg.model.attention_dropout > 0


@dataclass(frozen=True)
class SequenceSplit:
    """Which tokens of every sequence this rank keeps (see the module docstring)."""

    cp_rank: int = 0
    cp_size: int = 1
    sp_rank: int = 0
    sp_size: int = 1

    @classmethod
    def of(cls, state: ParallelState) -> SequenceSplit:
        """This rank's place in its context-parallel and Ulysses groups."""
        return cls(
            cp_rank=state.get_context_parallel_rank(),
            cp_size=state.get_context_parallel_world_size(),
            sp_rank=state.get_sequence_parallel_rank(),
            sp_size=state.get_sequence_parallel_world_size(),
        )

    def positions(self, seq_length: int) -> torch.Tensor:
        """``[S / (cp * sp)]`` int64: the positions this rank keeps of a sequence of ``seq_length`` tokens.

        Raises:
            ValueError: ``seq_length`` does not split (validate() checks --seq-length and the curriculum's lengths).
        """
        chunks = 2 * self.cp_size if self.cp_size > 1 else 1
        if seq_length % (chunks * self.sp_size):
            raise ValueError(
                f"sequence length {seq_length} is not divisible by {chunks} chunks x "
                f"--ds-sequence-parallel-size ({self.sp_size}) (--context-parallel-size {self.cp_size}); every "
                "rank must hold the same number of tokens."
            )
        mine = load_balanced_positions(seq_length, self.cp_size, self.cp_rank)  # [S/cp]
        n = mine.numel() // self.sp_size
        return mine[
            self.sp_rank * n : (self.sp_rank + 1) * n
        ]  # [S/cp] -> [S/(cp*sp)], contiguous inside

    def apply(self, batch: Batch) -> Batch:
        """``batch`` with only this rank's tokens of every ``[b, s]`` tensor (the same batch when not split)."""
        if self.cp_size * self.sp_size == 1:
            return batch
        return take_positions(batch, self.positions(batch["tokens"].shape[1]))


def _micro_batches(
    loader: Any,
    recipe: BatchRecipe,
    *,
    device: torch.device,
    split: SequenceSplit,
    seqlen: CurrentSeqlen | None = None,
    loss_tokens: LossTokenCount | None = None,
) -> Iterator[Batch]:
    """``split``: this rank's tokens of each sequence; ``loss_tokens``: counts the loss tokens of every
    micro-batch yielded (training only)."""
    for raw in loader:
        batch = recipe.make_item(raw)
        if seqlen is not None:
            batch = truncate_batch(batch, seqlen.value)
        batch = split.apply(batch)  # CP x Ulysses: this rank's s/(cp*sp) tokens
        if loss_tokens is not None:
            loss_tokens.value += int(batch["loss_mask"].count_nonzero())
        yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def pipe_batch(b: Batch) -> Any:
    """The pipe tuple ``((tokens, position_ids[, document_ids]), (labels, loss_mask))`` of a micro-batch
    (``gpt_model_pipe.py``)."""
    docs = (b["document_ids"],) if "document_ids" in b else ()
    return (b["tokens"], b["position_ids"], *docs), (b["labels"], b["loss_mask"])


def _pipe_batches(micro: Iterator[Batch]) -> Iterator[Any]:
    """:func:`pipe_batch` of every micro-batch."""
    for b in micro:
        yield pipe_batch(b)


@dataclass
class RunIterators:
    """This rank's micro-batch iterators (dicts for DeepSpeedEngine, pipe tuples for PipelineEngine)."""

    train: Iterator[Any]
    valid: Iterator[Any] | None
    test: Iterator[Any] | None = None
    seqlen: CurrentSeqlen = field(default_factory=CurrentSeqlen)
    """The length training micro-batches are cut to (the DeepSpeed JSON's curriculum; evaluation is never cut)."""
    loss_tokens: LossTokenCount | None = None
    """Counts the loss tokens of the training micro-batches drawn (None: not counted)."""
    token_weights: GlobalTokenWeights | None = None
    """--sft: the global per-token loss weights of each global batch (the iterators then yield dicts, also for
    the pipeline engine: the trainer weighs a global batch, then makes its pipe tuples); None: mean per
    micro-batch."""


def build_iterators(
    cfg: TridentConfig,
    plan: RunPlan,
    tokenizer: Any,
    run: Distributed,
    *,
    consumed_train_samples: int,
    consumed_valid_samples: int = 0,
) -> RunIterators:
    """Datasets + Megatron samplers (DP slicing of the global batch) + batch preparation, for this rank.

    Pipe tuples for the pipeline engine (``plan.pipeline_engine``), dicts otherwise; on ``run.device``, sliced
    over this rank's DP, CP and Ulysses groups of ``run.state``.
    """
    state = run.state
    gbs = plan.global_batch_size
    train_ds, valid_ds, test_ds = build_datasets(
        cfg, tokenizer, train_iters=plan.train_iters, global_batch=gbs
    )
    layout = BatchLayout(
        micro_batch_size=plan.micro_batch_size,
        global_batch_size=gbs,
        data_parallel_rank=state.get_data_parallel_rank(),
        data_parallel_size=state.get_data_parallel_world_size(),
    )
    common = {
        "layout": layout,
        "num_workers": cfg.data.num_workers,
        "seed": cfg.training.seed,
        "pin_memory": run.device.type == "cuda",
    }
    # A resumed run that already finished (or --skip-train after the last iteration) has no training left.
    finished = train_ds is None or consumed_train_samples >= len(train_ds)
    train_loader = (
        None
        if finished
        else build_pretraining_data_loader(
            train_ds, consumed_train_samples, dataloader_type=cfg.data.dataloader_type, **common
        )
    )
    if valid_ds is not None and consumed_valid_samples >= len(valid_ds):
        consumed_valid_samples %= len(
            valid_ds
        )  # more evaluations than planned: start the stream over
    valid_loader = build_pretraining_data_loader(
        valid_ds, consumed_valid_samples, dataloader_type="single", **common
    )
    test_loader = build_pretraining_data_loader(test_ds, 0, dataloader_type="single", **common)
    recipe = BatchRecipe(cfg.data, tokenizer.eod, dense_document_mask(cfg))
    if recipe.dense_mask:
        log_rank_0(
            logger,
            "packed documents with --attention-dropout %s use the dense [b, 1, s, s] "
            "mask (the document-id path has no attention dropout; --attention-dropout 0 selects it)",
            cfg.model.attention_dropout,
            level=logging.WARNING,
        )
    split = SequenceSplit.of(state)

    seqlen = CurrentSeqlen()
    loss_tokens = LossTokenCount()

    def batches(
        loader: Any, cut: CurrentSeqlen | None = None, tokens: LossTokenCount | None = None
    ) -> Iterator[Any] | None:
        if loader is None:
            return None
        micro = _micro_batches(
            loader,
            recipe,
            device=run.device,
            split=split,
            seqlen=cut,
            loss_tokens=tokens,
        )
        # --sft: the trainer weighs each global batch's dicts first (``token_weights.py``), then makes pipe tuples
        return _pipe_batches(micro) if plan.pipeline_engine and weights is None else micro

    weights = GlobalTokenWeights.of(state) if cfg.data.sft else None
    return RunIterators(
        train=batches(train_loader, seqlen, loss_tokens) or iter(()),
        valid=batches(valid_loader),
        test=batches(test_loader),
        seqlen=seqlen,
        loss_tokens=loss_tokens,
        token_weights=weights,
    )
