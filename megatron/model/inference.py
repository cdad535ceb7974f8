"""Key/value cache for autoregressive inference (Megatron's ``InferenceParams``).

Legend: ``s`` new tokens this forward, ``S`` cached + new tokens, ``b`` batch, ``gp`` K/V groups on this TP rank,
``hn`` head dim.

Batches of prompts of different lengths are left-padded: ``set_padding(pad [b, S_max])`` marks the cache slots that
hold padding; every query then ignores those keys (a padding query sees only itself, so no row of the softmax is
empty). A row's real tokens see exactly the keys they would see alone.

Beam search reorders the batch rows of every layer's cache with :meth:`InferenceParams.reorder`.

Usage: create one ``InferenceParams`` per generated batch, run the prompt through the model with it (the
"prefill"), then one token at a time; after every forward the caller advances ``sequence_len_offset`` by the number
of tokens it fed. Each attention layer keeps ``[max_sequence_length, b, gp, hn]`` K and V buffers, writes the new
tokens' K/V at ``[offset, offset + s)`` and attends over ``[0, offset + s)``; a query at absolute position
``offset + i`` sees keys ``0 .. offset + i`` (causal across the cache). Position ids (learned table or RoPE angle)
are the caller's: ``offset .. offset + s - 1``.
"""

from __future__ import annotations

import torch


class InferenceParams:
    """Per-batch inference state shared by every layer.

    Args:
        max_batch_size: ``b`` of the batch being generated.
        max_sequence_length: prompt + generated tokens the cache must hold.

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int) -> None:
        if max_batch_size < 1 or max_sequence_length < 1:
            raise ValueError(
                f"InferenceParams needs max_batch_size ({max_batch_size}) and max_sequence_length "
                f"({max_sequence_length}) >= 1."
            )
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.key_value_memory_dict: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.padding: torch.Tensor | None = (
            None  # [b, max_sequence_length] bool, True = a padding slot
        )

    def set_padding(self, padding: torch.Tensor | None) -> None:
        """Mark padding slots: bool ``[b, max_sequence_length]`` (True = padding), or None for none.

        Raises:
            ValueError: a shape other than ``[b <= max_batch_size, max_sequence_length]``.
        """
        if padding is not None and (
            padding.dim() != 2
            or padding.shape[0] > self.max_batch_size
            or padding.shape[1] != self.max_sequence_length
        ):
            raise ValueError(
                f"padding must be [b <= {self.max_batch_size}, {self.max_sequence_length}]; got "
                f"{tuple(padding.shape)}."
            )
        self.padding = None if padding is None or not bool(padding.any()) else padding.bool()

    def reorder(self, rows: torch.Tensor) -> None:
        """Replace every layer's cache rows by ``rows`` (int64 ``[b]`` indices into the batch; beam search)."""
        for number, (k, v) in self.key_value_memory_dict.items():
            idx = rows.to(k.device)
            self.key_value_memory_dict[number] = (
                k.index_select(1, idx),  # [S_max, b, gp, hn] -> rows picked
                v.index_select(1, idx),
            )
        if self.padding is not None:
            self.padding = self.padding.index_select(0, rows.to(self.padding.device))

    def update_kv(
        self, layer_number: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's ``key``/``value`` ``[s, b, gp, hn]`` and return all so far ``[S, b, gp, hn]``.

        Raises:
            ValueError: the cache would overflow ``max_sequence_length`` or the batch is larger than allocated.
        """
        s, b = key.shape[0], key.shape[1]
        start, end = self.sequence_len_offset, self.sequence_len_offset + s
        if end > self.max_sequence_length or b > self.max_batch_size:
            raise ValueError(
                f"KV cache overflow: tokens {start}..{end} of batch {b} do not fit max_sequence_length "
                f"{self.max_sequence_length} / max_batch_size {self.max_batch_size}."
            )
        if layer_number not in self.key_value_memory_dict:
            shape = (self.max_sequence_length, self.max_batch_size, *key.shape[2:])
            self.key_value_memory_dict[layer_number] = (
                key.new_empty(shape),
                value.new_empty(shape),
            )
        k_cache, v_cache = self.key_value_memory_dict[layer_number]
        k_cache[start:end, :b] = key  # [s, b, gp, hn] -> cache rows [start, end)
        v_cache[start:end, :b] = value
        return k_cache[:end, :b], v_cache[:end, :b]  # [S, b, gp, hn]

    def attention_mask(self, s: int, device: torch.device) -> torch.Tensor | None:
        """Bool mask (True = masked) for ``s`` new queries after ``offset`` cached tokens: ``[1, 1, s, S]``
        causal, ``[b, 1, s, S]`` with padding slots masked too; None (plain causal) when nothing is padding and
        either nothing is cached yet or one query comes after the cache (it sees every cached key)."""
        offset = self.sequence_len_offset
        if self.padding is None and (offset == 0 or s == 1):
            return None  # plain causal, or one query that sees every cached key
        total = offset + s
        full = torch.ones(s, total, dtype=torch.bool, device=device)
        causal = full.triu(offset + 1).view(1, 1, s, total)  # query i sees keys <= offset + i
        if self.padding is None:
            return causal
        pad = self.padding[:, :total].to(device)  # [b, S]
        b = pad.shape[0]
        masked = causal | pad.view(b, 1, 1, total)  # [b, 1, s, S]
        own = torch.arange(s, device=device)
        diag = torch.zeros(1, 1, s, total, dtype=torch.bool, device=device)
        # a padding query keeps its own key: no empty softmax row
        diag[0, 0, own, own + offset] = True
        return masked & ~diag
