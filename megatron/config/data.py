"""``DataConfig``: datasets, splits, tokenizer and loader settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are ordered."""

    data_path: tuple[str, ...] = ()
    """Dataset prefix from tools/preprocess_data.py, or a blend W1 PREFIX1 W2 PREFIX2 ..."""
    split: str = "969, 30, 1"
    """Train/valid/test proportions of each --data-path dataset."""
    train_data_path: tuple[str, ...] = ()
    """Separate training dataset(s) (then --split is not used)."""
    valid_data_path: tuple[str, ...] = ()
    """Separate validation dataset(s)."""
    test_data_path: tuple[str, ...] = ()
    """Separate test dataset(s)."""
    data_cache_path: str | None = None
    """Where the index arrays are cached (default: index-cache/ beside the data)."""
    mock_data: bool = False
    """Deterministic synthetic tokens (no files), for smoke tests and benchmarks."""
    dataloader_type: Literal["single", "cyclic"] = "single"
    """Megatron's sequential pretraining sampler (single) or its cyclic random sampler."""
    num_workers: int = 0
    """DataLoader worker processes (0: load in the main process)."""
    tokenizer_type: str | None = None
    """GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, HFTokenizer or NullTokenizer."""
    vocab_file: str | None = None
    """GPT-2 BPE vocab.json."""
    merge_file: str | None = None
    """GPT-2 BPE merges.txt."""
    tokenizer_model: str | None = None
    """SentencePiece .model file, or a local Hugging Face tokenizer directory / tokenizer.json."""
    vocab_size: int | None = None
    """NullTokenizer vocabulary: token ids 0..V-1, EOD = V."""
    eod_mask_loss: bool = False
    """No loss on end-of-document tokens."""
    reset_position_ids: bool = False
    """Positions restart after each end-of-document token."""
    reset_attention_mask: bool = False
    """No attention across end-of-document tokens."""
    train_doc_idx_path: str | None = None
    """Read the training split's doc_idx from this Megatron index .npy instead of building it."""
    train_sample_idx_path: str | None = None
    """Read the training split's sample_idx from this Megatron index .npy instead of building it."""
    train_shuffle_idx_path: str | None = None
    """Read the training split's shuffle_idx from this Megatron index .npy instead of building it."""
    train_data_exact_num_epochs: int | None = None
    """Build the training dataset from exactly this many epochs of its documents."""
    sft: bool = False
    """Supervised fine-tuning: conversations of --data-path P (with their loss mask P_loss_mask) packed whole."""
    return_data_index: bool = False
    """Dataset items also carry 'index', the sample's position (Megatron-DeepSpeed's data-efficiency hook)."""
    extra: dict[str, str] = field(default_factory=dict)
    """Reserved for tool-specific settings; empty for training (not a flag)."""
