"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus) sampling.

Megatron's semantics: ``top_k = 0`` and ``top_p = 0.0`` disable the filters; ``greedy`` (or ``top_k = 1``) takes the
argmax. Filters apply after the temperature: top-k keeps the ``k`` largest logits, top-p keeps the most likely tokens
until their probability sum exceeds ``p`` (the token that crosses ``p`` stays; always at least one token). Sampling draws on the CPU from
a caller-owned ``torch.Generator`` so a seed gives the same text on CPU and GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How :func:`sample_next` picks a token."""

    greedy: bool = False
    """Take the argmax (``--greedy``)."""
    temperature: float = 1.0
    """Logits are divided by it (``--temperature``); must be > 0."""
    top_k: int = 0
    """Keep the ``k`` most likely tokens (``--top_k``); 0 = off."""
    top_p: float = 0.0
    """Nucleus: keep the most likely tokens up to probability ``p`` (``--top_p``); 0.0 = off."""

    def __post_init__(self) -> None:
        if not self.temperature > 0.0:
            raise ValueError(f"--temperature ({self.temperature}) must be > 0.")
        if self.top_k < 0:
            raise ValueError(f"--top_k ({self.top_k}) must be >= 0 (0 = off).")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"--top_p ({self.top_p}) must be in [0, 1] (0 = off).")
        if self.top_k > 0 and self.top_p > 0.0:
            raise ValueError(
                f"--top_k ({self.top_k}) and --top_p ({self.top_p}) are exclusive (as in Megatron); "
                "set one of them to 0."
            )


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k or top-p: ``[b, v]`` logits -> ``[b, v]`` with dropped tokens at ``-inf``."""
    out = logits.float() / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, out.shape[-1])
        kth = torch.topk(out, k, dim=-1).values[..., -1:]  # [b, v] -> [b, 1]
        out = out.masked_fill(out < kth, float("-inf"))
    elif params.top_p > 0.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)  # [b, v]
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already exceed p (the first token always stays).
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) > params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> torch.Tensor:
    """Next token per row: ``[b, v]`` logits -> ``[b]`` int64 ids (on the logits' device).

    Args:
        logits: the last position's logits over the true vocabulary (padding columns already removed).
        params: greedy or the sampling filters.
        generator: a CPU generator (the draw is made on the CPU).
    """
    if params.greedy or params.top_k == 1:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filter_logits(logits, params), dim=-1).cpu()  # [b, v]
    return torch.multinomial(probs, 1, generator=generator).view(-1).to(logits.device)
