"""``DataConfig``: datasets, splits, tokenizer and loader settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are ordered."""

    data_path: tuple[str, ...] = ()
    """--data-path: PREFIX, or W1 PREFIX1 W2 PREFIX2 ... for a blend."""
    split: str = "969, 30, 1"
    """--split: train/valid/test proportions of each --data-path dataset."""
    train_data_path: tuple[str, ...] = ()
    """--train-data-path: separate train dataset(s) (then --split is ignored)."""
    valid_data_path: tuple[str, ...] = ()
    """--valid-data-path."""
    test_data_path: tuple[str, ...] = ()
    """--test-data-path."""
    data_cache_path: str | None = None
    """--data-cache-path: where index arrays are cached (default: index-cache/ beside the data)."""
    mock_data: bool = False
    """--mock-data: deterministic synthetic tokens (no files), for smoke tests and benchmarks."""
    dataloader_type: Literal["single", "cyclic"] = "single"
    """--dataloader-type: Megatron's sequential pretraining sampler or the cyclic random sampler."""
    num_workers: int = 0
    """--num-workers: DataLoader worker processes."""
    tokenizer_type: str | None = None
    """--tokenizer-type: GPT2BPETokenizer, (GPT)SentencePieceTokenizer, HFTokenizer, NullTokenizer."""
    vocab_file: str | None = None
    """--vocab-file: GPT-2 vocab.json."""
    merge_file: str | None = None
    """--merge-file: GPT-2 merges.txt."""
    tokenizer_model: str | None = None
    """--tokenizer-model: SentencePiece .model, or a local HF tokenizer dir / tokenizer.json."""
    vocab_size: int | None = None
    """--vocab-size: NullTokenizer vocabulary (ids 0..V-1; EOD = V)."""
    eod_mask_loss: bool = False
    """--eod-mask-loss: no loss on EOD tokens."""
    reset_position_ids: bool = False
    """--reset-position-ids: positions restart after each EOD."""
    reset_attention_mask: bool = False
    """--reset-attention-mask: no attention across EOD."""
    extra: dict[str, str] = field(default_factory=dict)
    """Reserved for tool-specific settings; empty for training."""
