"""Tokenizers (GPT-2 BPE, SentencePiece, local Hugging Face, Null) behind one interface; vocab padding."""

from megatron.tokenizer.hf_config import TokenizerFileError
from megatron.tokenizer.tokenizer import (
    TOKENIZER_TYPES,
    GPT2BPETokenizer,
    HFTokenizer,
    MegatronTokenizer,
    NullTokenizer,
    build_tokenizer,
    encoding_fingerprint,
    vocab_size_with_padding,
)

__all__ = [
    "TOKENIZER_TYPES",
    "GPT2BPETokenizer",
    "HFTokenizer",
    "MegatronTokenizer",
    "NullTokenizer",
    "TokenizerFileError",
    "build_tokenizer",
    "encoding_fingerprint",
    "vocab_size_with_padding",
]
