"""Small pure helpers of tensor parallelism: exact division, splits, vocabulary ranges.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``p`` TP size, ``v`` vocab, ``vp = v/p``.
"""

from __future__ import annotations

import torch


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``, refusing a remainder.

    Raises:
        ValueError: ``denominator`` is not positive or does not divide ``numerator``.
    """
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(
            f"{numerator} is not divisible by {denominator}; tensor-parallel splits must be exact "
            "(choose sizes that are multiples of the tensor-model-parallel size)"
        )
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """Split ``[..., h]`` into ``num_partitions`` views ``[..., h/num_partitions]``.

    Args:
        contiguous_split_chunks: return contiguous copies instead of views.

    Raises:
        ValueError: the last dimension is not divisible by ``num_partitions``.
    """
    last = divide(tensor.size(-1), num_partitions)
    chunks = torch.split(tensor, last, dim=-1)  # [..., h] -> num_partitions x [..., h/p]
    if contiguous_split_chunks:
        return tuple(c.contiguous() for c in chunks)
    return chunks


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, rank: int, world_size: int
) -> torch.Tensor:
    """The ``rank``-th of ``world_size`` equal chunks of ``tensor`` flattened to 1-D (a view when possible).

    Raises:
        ValueError: ``tensor.numel()`` is not divisible by ``world_size``.
    """
    chunk = divide(tensor.numel(), world_size)
    return tensor.reshape(-1)[rank * chunk : (rank + 1) * chunk]  # [numel] -> [numel/p]


class VocabUtility:
    """Vocabulary range ``[first, last)`` owned by a TP rank: rank ``r`` owns rows ``r*vp ... (r+1)*vp - 1``."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """``[rank * vp, (rank + 1) * vp)``."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(
        global_vocab_size: int, rank: int, world_size: int
    ) -> tuple[int, int]:
        """Same, from the global (padded) vocabulary size, which must be divisible by ``world_size``."""
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            per_partition, rank, world_size
        )
