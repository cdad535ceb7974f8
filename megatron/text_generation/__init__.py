"""Text generation from trained checkpoints: sampling filters and an autoregressive generator."""

from megatron.text_generation.generation import Generated, TextGenerator, generate_tokens
from megatron.text_generation.sampling import SamplingParams, filter_logits, sample_next

__all__ = [
    "Generated",
    "SamplingParams",
    "TextGenerator",
    "filter_logits",
    "generate_tokens",
    "sample_next",
]
