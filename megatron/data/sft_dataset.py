"""Supervised fine-tuning samples (``--sft``): conversations packed whole into ``seq_length + 1`` tokens.

Data (issue #33's format): ``P`` holds one document per conversation (tokens), ``P_loss_mask`` the same documents as
uint8 0/1 (1 = the token is a training target). A pack is ``S + 1`` tokens (``S = --seq-length``)::

    | conversation a        | conversation b   | conversation c      | padding (id 0) |
      document 0              document 1         document 2            document 3

Index of one split (deterministic in the seed and the data only, so every TP/PP/DP/CP layout trains on the same
packs in the same order; cached like the GPT dataset's, under the md5 of its description)::

    rng = np.random.RandomState(seed)
    epoch e = 0, 1, ...: order = rng.permutation(documents of the split)
                         next-fit: walk `order`, start a new pack when the next conversation does not fit
    until the packs number at least num_samples (at least one epoch)
    doc_idx  int32 [conversations]   the order, epoch after epoch
    pack_idx int64 [packs + 1]       pack k holds doc_idx[pack_idx[k] : pack_idx[k + 1]]

A pack never spans two epochs. A conversation longer than ``S + 1`` tokens is a pack of its own, cut to its first
``S + 1`` tokens (the count is logged once per dataset). The sampler's order is the pack order: the packs of a
shuffled stream are already in random order, so there is no second shuffle (the GPT dataset's ``shuffle_idx``).

Item ``k``: ``{"text": int64 [S + 1], "loss_mask": int64 [S + 1], "document_ids": int64 [S + 1]}``, the mask of
each token as stored (padding 0) and the index of its conversation in the pack (padding: one more document).
:func:`prepare_sft_batch` turns a batch of items into model inputs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron.data.index_budget import DatasetRequestError
from megatron.data.index_cache import load_or_build
from megatron.data.indexed_dataset import MMapIndexedDataset, loss_mask_prefix
from megatron.log import log_rank_0

logger = logging.getLogger(__name__)

SFT_INDEX_NAMES = ("doc_idx", "pack_idx")
PAD_TOKEN = 0
"""Token id of the padding at the end of a pack (its own document, loss weight 0: the value never matters)."""
_MAX_DOC_IDX_ENTRIES = 1 << 31


def check_loss_mask(prefix: str, flag: str) -> None:
    """``prefix``'s loss-mask dataset exists and matches it document by document (cheap: the ``.idx`` files).

    Raises:
        FileNotFoundError: the ``_loss_mask`` files are missing (naming them and how to make them).
        ValueError: another number of documents or other lengths than the conversations.
    """
    mask = loss_mask_prefix(prefix)
    missing = [mask + ext for ext in (".bin", ".idx") if not os.path.isfile(mask + ext)]
    if missing:
        raise FileNotFoundError(
            f"--sft {flag} {prefix}: missing {', '.join(missing)}; --sft reads the loss mask beside the "
            "conversations: preprocess them with tools/preprocess_data.py --sft, which "
            "writes P and P_loss_mask, or drop --sft."
        )
    sizes, mask_sizes = MMapIndexedDataset(prefix).sizes, MMapIndexedDataset(mask).sizes
    if len(sizes) != len(mask_sizes) or not np.array_equal(sizes, mask_sizes):
        bad = int(np.argmax(sizes != mask_sizes)) if len(sizes) == len(mask_sizes) else None
        where = (
            f"{len(sizes)} documents vs {len(mask_sizes)}"
            if bad is None
            else f"document {bad} has {sizes[bad]} tokens vs {mask_sizes[bad]} mask values"
        )
        raise ValueError(
            f"--sft {flag} {prefix}: the loss mask {mask} does not match the conversations ({where}); "
            "write both from the same preprocessing run."
        )


def pack_order(order: np.ndarray, sizes: np.ndarray, capacity: int) -> np.ndarray:
    """Next-fit packing of the conversations ``order`` (ids into ``sizes``) into packs of ``capacity`` tokens.

    Returns:
        int64 ``[packs + 1]`` boundaries into ``order``; a conversation longer than ``capacity`` is a pack alone.
    """
    starts = [0]
    used = 0
    for i, n in enumerate(np.minimum(sizes[order], capacity).tolist()):
        if used and used + n > capacity:
            starts.append(i)
            used = 0
        used += n
    starts.append(len(order))
    return np.asarray(starts, dtype=np.int64)


def compute_sft_indices(
    documents: np.ndarray, sizes: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> dict[str, np.ndarray]:
    """``doc_idx`` and ``pack_idx`` of the module docstring, built in memory (no cache).

    Raises:
        DatasetRequestError: the request needs an absurd number of epochs of the split.
    """
    rng = np.random.RandomState(seed=seed)
    orders: list[np.ndarray] = []
    bounds: list[np.ndarray] = []
    packs = offset = 0
    while packs < max(num_samples, 1):
        order = rng.permutation(np.asarray(documents, dtype=np.int32))
        cuts = pack_order(order, sizes, seq_length + 1)
        orders.append(order)
        bounds.append(cuts[:-1] + offset)
        packs += len(cuts) - 1
        offset += len(order)
        if len(orders) == 1 and offset * (-(-num_samples // packs)) >= _MAX_DOC_IDX_ENTRIES:
            raise DatasetRequestError(
                f"{num_samples} packs of {seq_length + 1} tokens need about {num_samples // packs + 1} epochs of "
                f"{len(documents)} conversations ({packs} packs each); that is not a sensible request. Use "
                "more data or fewer samples (--train-iters, --eval-iters, --split)."
            )
    pack_idx = np.concatenate([*bounds, np.asarray([offset], dtype=np.int64)])
    return {"doc_idx": np.concatenate(orders).astype(np.int32), "pack_idx": pack_idx}


@dataclass(frozen=True)
class SFTIndexSpec:
    """What one split's packs are built for (the fields of the cache description)."""

    name: str
    """Split name (``train``/``valid``/``test``)."""
    data_prefix: str
    """The conversations' prefix ``P`` (the loss mask is ``P_loss_mask``)."""
    splits_string: str
    """The ``--split`` string."""
    num_samples: int
    """Packs the run will draw; the index holds whole epochs, so it may hold more."""
    seq_length: int
    """``--seq-length``: packs have ``seq_length + 1`` tokens."""
    seed: int
    """``--seed``: the order of the conversations in each epoch."""

    def description(self) -> str:
        """The cache description (its md5 names the files)."""
        return (
            "SFT Dataset (next-fit packing of whole conversations)\n\n"
            f"Data prefix {self.data_prefix}\n"
            f"Dataset name {self.name}\n"
            f"Number of samples {int(self.num_samples)}\n"
            f"Sequence length {int(self.seq_length)}\n"
            f"Random seed {int(self.seed)}\n"
            f"Split {self.splits_string}\n"
        )


def _index_checker(num_seqs: int) -> Any:
    def check(arrays: dict[str, np.ndarray]) -> str | None:
        doc_idx, pack_idx = arrays["doc_idx"], arrays["pack_idx"]
        if doc_idx.dtype != np.int32 or doc_idx.ndim != 1 or pack_idx.dtype != np.int64:
            return (
                f"doc_idx {doc_idx.dtype}{doc_idx.shape}, pack_idx {pack_idx.dtype}{pack_idx.shape}"
            )
        if len(pack_idx) < 2 or int(pack_idx[0]) != 0 or int(pack_idx[-1]) != len(doc_idx):
            return "pack_idx does not cover doc_idx"
        if np.any(np.diff(pack_idx) <= 0):
            return "pack_idx is not increasing"
        if len(doc_idx) and (int(doc_idx.min()) < 0 or int(doc_idx.max()) >= num_seqs):
            return "doc_idx holds ids outside the dataset"
        return None

    return check


def _content_id(indexed: Any) -> str:
    """What names a dataset's contents in the cache: its ``content_id``, else a hash of its sizes."""
    found = getattr(indexed, "content_id", None)
    if found is not None:
        return str(found)
    return (
        "sizes-sha256 " + hashlib.sha256(np.ascontiguousarray(indexed.sizes).data).hexdigest()[:32]
    )


class SFTDataset(torch.utils.data.Dataset):
    """Packed conversations of one split of ``P`` / ``P_loss_mask`` (see the module docstring).

    Args:
        spec: the split's name, prefix, ``--split`` string, pack count, sequence length and seed.
        documents: int32 conversation ids of this split.
        tokens: the conversations (``MMapIndexedDataset`` of ``P``).
        mask: their loss mask (``MMapIndexedDataset`` of ``P_loss_mask``, the same lengths).
        data_cache_path: ``--data-cache-path`` (default ``index-cache/`` beside the data).

    Raises:
        ValueError: no conversation with a token in the split.
    """

    def __init__(
        self,
        spec: SFTIndexSpec,
        documents: np.ndarray,
        tokens: Any,
        mask: Any,
        *,
        data_cache_path: str | None = None,
    ) -> None:
        documents = np.asarray(documents, dtype=np.int32)
        sizes = np.asarray(tokens.sizes)
        if len(documents) == 0 or int(sizes[documents].sum()) == 0:
            raise ValueError(
                f"dataset {spec.name!r} of {spec.data_prefix}: no conversation with a token in this split; "
                "give it more data (--split) or use a larger dataset."
            )
        self.name, self.data_prefix, self.seq_length = spec.name, spec.data_prefix, spec.seq_length
        self.tokens, self.mask, self.sizes = tokens, mask, sizes
        self.desc = spec.description()
        directories = [os.path.join(os.path.dirname(spec.data_prefix), "index-cache")]
        directories += [data_cache_path] if data_cache_path is not None else []
        identity = " ".join(_content_id(ds) for ds in (tokens, mask))

        def build() -> dict[str, np.ndarray]:
            start = time.time()
            arrays = compute_sft_indices(
                documents, sizes, spec.num_samples, spec.seq_length, spec.seed
            )
            log_rank_0(
                logger,
                "built %s packs of %s: %d packs of %d tokens in %.2f s",
                spec.name,
                spec.data_prefix,
                len(arrays["pack_idx"]) - 1,
                spec.seq_length + 1,
                time.time() - start,
            )
            return arrays

        arrays, self.cache_dir = load_or_build(
            directories,
            self.desc,
            SFT_INDEX_NAMES,
            build,
            _index_checker(len(sizes)),
            identity=identity,
        )
        self.doc_idx, self.pack_idx = arrays["doc_idx"], arrays["pack_idx"]
        self.truncated = int(np.count_nonzero(sizes[documents] > spec.seq_length + 1))
        if self.truncated:
            log_rank_0(
                logger,
                "%s split of %s: %d of %d conversations are longer than --seq-length + 1 (%d tokens) and are "
                "truncated to it",
                spec.name,
                spec.data_prefix,
                self.truncated,
                len(documents),
                spec.seq_length + 1,
                level=logging.WARNING,
            )

    def __len__(self) -> int:
        return len(self.pack_idx) - 1

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < len(self):
            raise IndexError(
                f"pack {idx} out of range for {self.name} dataset of {len(self)} packs"
            )
        capacity = self.seq_length + 1
        text = np.full(capacity, PAD_TOKEN, dtype=np.int64)
        mask = np.zeros(capacity, dtype=np.int64)
        ids = np.empty(capacity, dtype=np.int64)
        conversations = self.doc_idx[int(self.pack_idx[idx]) : int(self.pack_idx[idx + 1])]
        end = 0
        for j, doc in enumerate(conversations.tolist()):
            n = min(int(self.sizes[doc]), capacity - end)
            text[end : end + n] = self.tokens.get(doc, length=n)
            mask[end : end + n] = self.mask.get(doc, length=n)
            ids[end : end + n] = j
            end += n
        ids[end:] = len(conversations)  # the padding is a document of its own
        return {"text": text, "loss_mask": mask, "document_ids": ids}


def prepare_sft_batch(
    text: torch.Tensor, loss_mask: torch.Tensor, document_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A batch of packs ``[b, S + 1]`` (items of :class:`SFTDataset`) -> model inputs ``[b, S]``.

    ``tokens = text[:, :-1]``, ``labels = text[:, 1:]``; the loss weight of label position ``t`` is
    ``mask[t + 1]`` when tokens ``t`` and ``t + 1`` belong to the same conversation, else 0 (the last token of a
    conversation does not predict the next one's first); ``position_ids`` restart at 0 in every conversation;
    ``document_ids`` are the inputs' (the attention path of packed documents).
    """
    ids = document_ids.long()
    same = ids[:, 1:] == ids[:, :-1]  # [b, S]
    inputs = ids[:, :-1].contiguous()  # [b, S + 1] -> [b, S]
    positions = torch.arange(inputs.shape[1], device=ids.device).unsqueeze(0)  # [1, S]
    starts = torch.ones_like(inputs, dtype=torch.bool)
    starts[:, 1:] = inputs[:, 1:] != inputs[:, :-1]  # [b, S]: True where a conversation starts
    start_of = torch.cummax(torch.where(starts, positions, torch.zeros_like(inputs)), dim=1).values
    return {
        "tokens": text[:, :-1].long().contiguous(),
        "labels": text[:, 1:].long().contiguous(),
        "loss_mask": (loss_mask[:, 1:].float() * same.float()).contiguous(),
        "position_ids": positions - start_of,  # [b, S]
        "document_ids": inputs,
    }


def dense_document_attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[b, 1, S, S]``, True = masked: causal attention inside each document of ``document_ids [b, S]``
    (the dense path, kept for --attention-dropout > 0 at PP = 1; Megatron's mask convention)."""
    s = document_ids.shape[1]
    positions = torch.arange(s, device=document_ids.device)
    causal = positions.unsqueeze(1) >= positions.unsqueeze(0)  # [S, S]: row t sees columns u <= t
    same = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)  # [b, S, S]
    return ~(causal.unsqueeze(0) & same).unsqueeze(1)  # [b, S, S] -> [b, 1, S, S]
