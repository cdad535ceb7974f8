"""--sft data: conversations packed whole (``megatron/data/sft_dataset.py``) and the batch made of the packs.

Checked on a dataset written with our builders (``P`` + ``P_loss_mask``, issue #33's format): every conversation
of an epoch lands whole in exactly one pack (a too-long one alone, truncated, counted), packs are deterministic in
the seed (a second build, from the cache and from scratch, gives the same items; another seed other packs), the
batch has per-conversation positions and document ids, and the loss weight of label ``t`` is ``mask[t + 1]``
inside a conversation and 0 across a boundary and on padding. Bad input: a missing ``_loss_mask`` is one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.data.indexed_builder import MMapIndexedDatasetBuilder, make_builder
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.sft_dataset import (
    SFTDataset,
    SFTIndexSpec,
    check_loss_mask,
    compute_sft_indices,
    pack_order,
    prepare_sft_batch,
)

S = 32  # packs of S + 1 = 33 tokens


def write_sft_dataset(
    prefix: str, lengths: list[int], vocab: int, seed: int = 0
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``prefix`` + ``prefix_loss_mask`` with conversations of ``lengths`` (random tokens < ``vocab``): a prompt of
    about a third of the tokens (mask 0), then the response (mask 1). Returns the tokens and masks written."""
    rng = np.random.default_rng(seed)
    tokens, masks = [], []
    text = make_builder(prefix + ".bin", vocab_size=vocab)
    mask = MMapIndexedDatasetBuilder(prefix + "_loss_mask.bin", dtype=np.uint8)
    for n in lengths:
        t = rng.integers(0, vocab, n)
        m = (np.arange(n) >= max(1, n // 3)).astype(np.uint8)
        text.add_item(t)
        text.end_document()
        mask.add_item(m)
        mask.end_document()
        tokens.append(t)
        masks.append(m)
    text.finalize(prefix + ".idx")
    mask.finalize(prefix + "_loss_mask.idx")
    return tokens, masks


# 40 > S + 1: truncated; 33 fills a pack
LENGTHS = [5, 12, 40, 1, 9, 33, 17, 3, 20, 8, 14, 2, 30, 6, 11]  # fmt: skip


def _dataset(prefix: str, num_samples: int, seed: int = 7, cache: str | None = None) -> SFTDataset:
    spec = SFTIndexSpec("train", prefix, "100,0,0", num_samples, S, seed)
    tokens, mask = MMapIndexedDataset(prefix), MMapIndexedDataset(prefix + "_loss_mask")
    docs = np.arange(len(LENGTHS), dtype=np.int32)
    return SFTDataset(spec, docs, tokens, mask, data_cache_path=cache)


def test_packing_is_whole_deterministic_and_cached(tmp_path) -> None:
    prefix = str(tmp_path / "chat")
    tokens, masks = write_sft_dataset(prefix, LENGTHS, vocab=300)
    ds = _dataset(prefix, num_samples=20)
    assert ds.truncated == 1 and len(ds) >= 20
    per_epoch = len(LENGTHS)
    # every conversation of each epoch sits whole (or truncated, alone) in one pack
    seen: list[int] = []
    for k in range(len(ds)):
        item = ds[k]
        assert (
            item["text"].shape == item["loss_mask"].shape == item["document_ids"].shape == (S + 1,)
        )
        convs = ds.doc_idx[ds.pack_idx[k] : ds.pack_idx[k + 1]].tolist()
        seen += convs
        end = 0
        for j, c in enumerate(convs):
            n = min(len(tokens[c]), S + 1)
            assert n == len(tokens[c]) or len(convs) == 1  # only a pack of its own truncates
            assert item["text"][end : end + n].tolist() == tokens[c][:n].tolist()
            assert item["loss_mask"][end : end + n].tolist() == masks[c][:n].tolist()
            assert (item["document_ids"][end : end + n] == j).all()
            end += n
        assert (item["loss_mask"][end:] == 0).all() and (item["text"][end:] == 0).all()
        assert (item["document_ids"][end:] == len(convs)).all()  # padding: a document of its own
        if k + 1 < len(ds):  # next-fit: the next pack's first conversation did not fit here
            first = ds.doc_idx[ds.pack_idx[k + 1]]
            same_epoch = ds.pack_idx[k + 1] % per_epoch != 0
            assert not same_epoch or end + min(len(tokens[first]), S + 1) > S + 1
    epochs = len(seen) // per_epoch
    assert len(seen) == epochs * per_epoch >= 2 * per_epoch
    for e in range(epochs):  # each epoch is a permutation of the conversations
        assert sorted(seen[e * per_epoch : (e + 1) * per_epoch]) == list(range(per_epoch))
    assert seen[:per_epoch] != seen[per_epoch : 2 * per_epoch]  # shuffled per epoch
    # deterministic: from the cache, and rebuilt from scratch elsewhere; another seed packs otherwise
    again = _dataset(prefix, num_samples=20)
    fresh = compute_sft_indices(np.arange(len(LENGTHS)), ds.sizes, 20, S, 7)
    assert again.cache_dir == ds.cache_dir is not None
    for name in ("doc_idx", "pack_idx"):
        assert np.array_equal(getattr(again, name), getattr(ds, name))
        assert np.array_equal(fresh[name], getattr(ds, name))
    other = compute_sft_indices(np.arange(len(LENGTHS)), ds.sizes, 20, S, 8)
    assert not np.array_equal(other["doc_idx"], ds.doc_idx)


def test_pack_order_next_fit() -> None:
    sizes = np.array([10, 20, 5, 40, 3, 30], dtype=np.int32)
    # capacity 33: [10 20] [5] [40 -> 33 alone] [3 30]
    assert pack_order(np.arange(6), sizes, 33).tolist() == [0, 2, 3, 4, 6]


def test_sft_batch_positions_documents_and_weights() -> None:
    # one pack: conversation a (4 tokens), b (3 tokens), padding (2): S + 1 = 9
    text = torch.tensor([[11, 12, 13, 14, 21, 22, 23, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 0, 0]])
    ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2]])
    b = prepare_sft_batch(text, mask, ids)
    assert b["tokens"].tolist() == [[11, 12, 13, 14, 21, 22, 23, 0]]
    assert b["labels"].tolist() == [[12, 13, 14, 21, 22, 23, 0, 0]]
    assert b["document_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 2]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    # label t weighs mask[t + 1] inside a conversation; 14 -> 21 crosses a boundary: 0; padding 0
    assert b["loss_mask"].tolist() == [[0, 1, 1, 0, 1, 1, 0, 0]]


def test_missing_or_mismatched_loss_mask_is_one_line(tmp_path) -> None:
    prefix = str(tmp_path / "chat")
    write_sft_dataset(prefix, [4, 5], vocab=100)
    check_loss_mask(prefix, "--data-path")
    other = str(tmp_path / "other")
    write_sft_dataset(other, [4, 6], vocab=100)
    (tmp_path / "other_loss_mask.bin").replace(tmp_path / "chat_loss_mask.bin")
    (tmp_path / "other_loss_mask.idx").replace(tmp_path / "chat_loss_mask.idx")
    with pytest.raises(ValueError, match=r"does not match the conversations \(document 1 has 5"):
        check_loss_mask(prefix, "--data-path")
    (tmp_path / "chat_loss_mask.idx").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"missing .*chat_loss_mask.idx; --sft reads the loss"
    ):
        check_loss_mask(prefix, "--data-path")


def test_builders_make_sft_datasets_and_blends(tmp_path) -> None:
    """--sft through the trainer's builder: each split packs its own conversations; a blend of two prefixes."""
    from megatron.config import DataConfig
    from megatron.data.blendable_dataset import BlendableDataset
    from megatron.data.builders import build_train_valid_test_datasets

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_sft_dataset(a, LENGTHS, vocab=300)
    write_sft_dataset(b, [7] * 20, vocab=300, seed=1)
    cfg = DataConfig(data_path=(a,), split="80,20,0", sft=True)
    train, valid, test = build_train_valid_test_datasets(
        cfg, seq_length=S, seed=3, train_valid_test_num_samples=(6, 2, 0)
    )
    assert isinstance(train, SFTDataset) and isinstance(valid, SFTDataset) and test is None
    assert set(train.doc_idx.tolist()) == set(range(12))
    assert set(valid.doc_idx.tolist()) == {12, 13, 14}
    blend_cfg = DataConfig(data_path=("0.5", a, "0.5", b), split="100,0,0", sft=True)
    blend, _, _ = build_train_valid_test_datasets(
        blend_cfg, seq_length=S, seed=3, train_valid_test_num_samples=(8, 0, 0)
    )
    assert isinstance(blend, BlendableDataset) and len(blend) >= 8
    assert {int(blend[i]["dataset_idx"]) for i in range(len(blend))} == {0, 1}
    assert sorted(blend[0]) == ["dataset_idx", "document_ids", "loss_mask", "text"]
    # no loss mask beside a prefix: one line before any index is built
    (tmp_path / "b_loss_mask.bin").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"--sft --data-path .*b: missing .*b_loss_mask.bin"
    ):
        build_train_valid_test_datasets(
            blend_cfg, seq_length=S, seed=3, train_valid_test_num_samples=(8, 0, 0)
        )
