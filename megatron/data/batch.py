"""Turning a batch of samples into model inputs: tokens/labels, masks and position ids (Megatron semantics).

``text`` items hold ``seq_length + 1`` tokens: ``tokens = text[:, :-1]``, ``labels = text[:, 1:]``. Masks follow
Megatron's ``get_ltor_masks_and_position_ids``; the per-EOD loops are vectorised (same results, tested against a
literal port of the loops).
"""

from __future__ import annotations

import torch


def _segment_starts(data: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s]: first position of the EOD-delimited segment each position belongs to (EOD ends its segment)."""
    b, s = data.shape
    positions = torch.arange(s, device=data.device).unsqueeze(0).expand(b, s)
    # A segment starts right after each EOD; position t belongs to the segment of the last EOD strictly before t.
    after_eod = torch.where(data == eod, positions + 1, torch.zeros_like(positions))
    shifted = torch.zeros_like(after_eod)
    shifted[:, 1:] = after_eod[:, :-1]
    return torch.cummax(shifted, dim=1).values


def get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    skip_mask: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Left-to-right masks and positions for a ``[b, s]`` batch of token ids.

    Args:
        data: ``[b, s]`` integer token ids (the model inputs, i.e. ``text[:, :-1]``).
        eod: the end-of-document token id.
        reset_position_ids: ``--reset-position-ids``: positions restart at 0 after every EOD.
        reset_attention_mask: ``--reset-attention-mask``: no attention across an EOD (per-sample mask).
        eod_mask_loss: ``--eod-mask-loss``: zero loss weight where the input token is EOD.
        skip_mask: return None instead of a mask (causal attention handled by the kernel).

    Returns:
        ``attention_mask``: bool ``[b or 1, 1, s, s]``, True = masked (``[1, ...]`` unless
        ``reset_attention_mask``), or None with ``skip_mask``; ``loss_mask``: float32 ``[b, s]``;
        ``position_ids``: int64 ``[b, s]``.
    """
    if data.dim() != 2:
        raise ValueError(f"data must be [b, s] token ids, got shape {tuple(data.shape)}")
    b, s = data.shape
    device = data.device
    loss_mask = torch.ones((b, s), dtype=torch.float, device=device)
    if eod_mask_loss:
        loss_mask[data == eod] = 0.0
    positions = torch.arange(s, dtype=torch.long, device=device)
    starts = _segment_starts(data, eod) if (reset_position_ids or reset_attention_mask) else None
    if reset_position_ids:
        position_ids = positions.unsqueeze(0) - starts  # [b, s]
    else:
        position_ids = positions.unsqueeze(0).expand(b, s)
    if skip_mask:
        return None, loss_mask, position_ids
    causal = positions.unsqueeze(1) >= positions.unsqueeze(0)  # [s, s] row t may see column u <= t
    if reset_attention_mask:
        # [b, s, s]: row t also may not see columns before its segment start.
        allowed = causal.unsqueeze(0) & (positions.view(1, 1, s) >= starts.unsqueeze(2))
        attention_mask = ~allowed.unsqueeze(1)  # [b, 1, s, s]
    else:
        attention_mask = ~causal.view(1, 1, s, s)
    return attention_mask, loss_mask, position_ids


def prepare_gpt_batch(
    text: torch.Tensor,
    *,
    eod: int,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    skip_mask: bool = False,
) -> dict[str, torch.Tensor | None]:
    """Megatron's ``get_batch`` minus the broadcast: ``text [b, s + 1]`` -> model inputs.

    Returns:
        ``tokens`` ``[b, s]``, ``labels`` ``[b, s]`` (int64), ``loss_mask`` ``[b, s]`` float, ``attention_mask``
        (see :func:`get_ltor_masks_and_position_ids`), ``position_ids`` ``[b, s]``.
    """
    if text.dim() != 2 or text.shape[1] < 2:
        raise ValueError(
            f"text must be [b, seq_length + 1] with seq_length >= 1, got {tuple(text.shape)}"
        )
    text = text.long()
    tokens = text[:, :-1].contiguous()  # [b, s + 1] -> [b, s]
    labels = text[:, 1:].contiguous()  # [b, s + 1] -> [b, s]
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss, skip_mask
    )
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }


WHOLE_SEQUENCE_KEYS = frozenset({"attention_mask", "document_ids"})
"""Batch entries every rank keeps whole when the sequence is split: the ``[b or 1, 1, s, s]`` dense mask and the
``[b, S]`` document ids of packed documents (each rank takes its own tokens' ids by position)."""


def take_positions(
    batch: dict[str, torch.Tensor], positions: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Keep the tokens at ``positions`` (``[s']`` int64 indices into the sequence) of every ``[b, s]`` tensor.

    Tokens, labels, loss mask, position ids and any other per-token ``[b, s]`` entry are gathered, so the position
    ids stay GLOBAL (RoPE and the learned table see the true positions); the entries of
    :data:`WHOLE_SEQUENCE_KEYS` are kept whole.
    """
    return {
        # [b, s] -> [b, s']
        key: value if key in WHOLE_SEQUENCE_KEYS else value.index_select(1, positions).contiguous()
        for key, value in batch.items()
    }


def slice_sequence(batch: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """DeepSpeed-Ulysses: rank ``rank`` of ``size`` keeps positions ``rank*s/size .. (rank+1)*s/size - 1``.

    Every ``[b, s]`` tensor (tokens, labels, loss mask, position ids) is sliced (:func:`take_positions`), so the
    position ids stay GLOBAL; the ``[b or 1, 1, s, s]`` attention mask and document ids are kept whole (attention
    runs over the gathered sequence).

    Raises:
        ValueError: ``s`` is not divisible by ``size`` (validate() checks --seq-length; the curriculum's lengths
            are multiples of it too).
    """
    if size == 1:
        return batch
    s = batch["tokens"].shape[1]
    if s % size:
        raise ValueError(
            f"sequence length {s} is not divisible by --ds-sequence-parallel-size ({size}); every "
            "sequence-parallel rank must hold the same number of tokens."
        )
    return take_positions(batch, torch.arange(rank * (s // size), (rank + 1) * (s // size)))
