"""Text generation from trained checkpoints: sampling filters, batched generation and beam search at any TP x PP
layout, and the REST server."""

from megatron.text_generation.generation import (
    Generated,
    LogitsSource,
    PromptRequest,
    TextGenerator,
    generate_tokens,
    prompt_seed,
)
from megatron.text_generation.sampling import SamplingParams, filter_logits, sample_next

__all__ = [
    "Generated",
    "LogitsSource",
    "PromptRequest",
    "SamplingParams",
    "TextGenerator",
    "filter_logits",
    "generate_tokens",
    "prompt_seed",
    "sample_next",
]
