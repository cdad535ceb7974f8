"""Masks and position ids against a literal port of Megatron's per-EOD loops."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron.data.batch import get_ltor_masks_and_position_ids, prepare_gpt_batch


def megatron_reference(data, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    b, s = data.size()
    att_b = b if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones((att_b, s, s))).view(att_b, 1, s, s)
    loss_mask = torch.ones(data.size(), dtype=torch.float)
    if eod_mask_loss:
        loss_mask[data == eod] = 0.0
    position_ids = torch.arange(s, dtype=torch.long).unsqueeze(0).expand_as(data)
    if reset_position_ids:
        position_ids = position_ids.clone()
    if reset_position_ids or reset_attention_mask:
        for row in range(b):
            eod_index = position_ids[row, data[row] == eod]
            if reset_position_ids:
                eod_index = eod_index.clone()
            prev = 0
            for j in range(eod_index.size()[0]):
                i = eod_index[j]
                if reset_attention_mask:
                    attention_mask[row, 0, (i + 1) :, : (i + 1)] = 0
                if reset_position_ids:
                    position_ids[row, (i + 1) :] -= i + 1 - prev
                    prev = i + 1
    return attention_mask < 0.5, loss_mask, position_ids


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=3)))
def test_masks_match_megatron(flags) -> None:
    g = torch.Generator().manual_seed(0)
    eod = 7
    data = torch.randint(0, 10, (4, 33), generator=g)
    data[0, 0] = eod  # EOD at the first and last positions too
    data[1, -1] = eod
    data[2] = eod
    data[3] = 3  # no EOD at all
    mask, loss, pos = get_ltor_masks_and_position_ids(data, eod, *flags)
    ref_mask, ref_loss, ref_pos = megatron_reference(data, eod, *flags)
    assert mask.dtype == torch.bool and mask.shape == ref_mask.shape
    assert torch.equal(mask, ref_mask)
    assert loss.dtype == torch.float32 and torch.equal(loss, ref_loss)
    assert pos.dtype == torch.int64 and torch.equal(pos, ref_pos)
    skipped, loss2, pos2 = get_ltor_masks_and_position_ids(data, eod, *flags, skip_mask=True)
    assert skipped is None and torch.equal(loss2, ref_loss) and torch.equal(pos2, ref_pos)


def test_prepare_gpt_batch_shifts_tokens_and_labels() -> None:
    text = torch.arange(2 * 9).view(2, 9)
    batch = prepare_gpt_batch(text, eod=4, eod_mask_loss=True)
    assert torch.equal(batch["tokens"], text[:, :-1]) and torch.equal(batch["labels"], text[:, 1:])
    assert batch["loss_mask"][0, 4] == 0 and batch["loss_mask"].sum() == 15
    assert batch["attention_mask"].shape == (1, 1, 8, 8)
    with pytest.raises(ValueError, match=r"text must be \[b, seq_length \+ 1\]"):
        prepare_gpt_batch(torch.zeros(3, dtype=torch.long), eod=0)


def test_document_ids_are_megatrons_reset_attention_mask() -> None:
    """Packed documents as ids (``token_layout.document_ids`` + the layout rule) mask exactly what Megatron's
    ``--reset-attention-mask`` loops mask; Ulysses slicing keeps the ids whole."""
    from megatron.data.batch import slice_sequence
    from megatron.model.token_layout import TokenLayout, document_ids

    g = torch.Generator().manual_seed(1)
    eod = 7
    data = torch.randint(0, 10, (4, 32), generator=g)
    data[0, 0] = data[1, -1] = eod
    data[2] = eod
    ref_mask, _, _ = megatron_reference(data, eod, False, True, False)
    ids = document_ids(data, eod)  # [b, s]
    layout = TokenLayout.contiguous(32, data.device, ids)
    assert torch.equal(layout.visible(layout), ~ref_mask[:, 0])  # [b, s, s] True = sees
    batch = {"tokens": data, "document_ids": ids}
    half = slice_sequence(batch, 1, 2)
    assert torch.equal(half["tokens"], data[:, 16:]) and half["document_ids"] is ids
