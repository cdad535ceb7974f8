"""Checking a converted model against its source: logit differences and greedy-decode agreement."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
"""``tokens [1, s] int64 -> logits [1, s, v']`` (any ``v' >= vocab``; padded columns are ignored)."""


class LogitComparison(NamedTuple):
    """Result of :func:`compare_logits` (unpacks as ``(max_abs_dlogit, greedy_agreement)``)."""

    max_abs_dlogit: float
    """Largest ``|logits_a - logits_b|`` over every prompt and position of model A's greedy sequences."""
    greedy_agreement: float
    """Generated tokens up to each prompt's first disagreement of the two independent greedy decodes, over all
    prompts x steps (1.0 = identical decodes)."""

    def passes(self, tolerance: float) -> bool:
        """Within ``tolerance`` and with identical greedy decodes (what the tools accept, else exit 3)."""
        return self.max_abs_dlogit <= tolerance and self.greedy_agreement == 1.0


@dataclass(frozen=True)
class Verification:
    """How a converter checks what it wrote: both models decode :func:`fixed_prompts` greedily and their logits
    are compared (:func:`compare_logits`). A converter given ``verification=None`` (``--no-verify``) skips it."""

    steps: int = 32
    """Greedy tokens decoded per prompt (``--verify-steps``; fewer where the context is shorter)."""
    tolerance: float | None = None
    """Largest ``|delta logit|`` that passes (:meth:`LogitComparison.passes`); None accepts any result.
    ``export_to_hf`` keeps an export that fails it out of ``--out``; the checkpoint writers return the comparison
    and leave the verdict to their caller."""


def _greedy(fn: LogitsFn, prompt: torch.Tensor, steps: int, vocab: int) -> torch.Tensor:
    seq = prompt.view(1, -1)  # [1, s]
    for _ in range(steps):
        logits = fn(seq)[0, -1, :vocab]  # [1, s, v'] -> [v]
        seq = torch.cat([seq, logits.argmax().view(1, 1)], dim=1)  # [1, s] -> [1, s+1]
    return seq


@torch.no_grad()
def compare_logits(
    model_a_fn: LogitsFn,
    model_b_fn: LogitsFn,
    prompts: Sequence[Sequence[int]] | Sequence[torch.Tensor],
    steps: int = 32,
    *,
    vocab_size: int | None = None,
) -> LogitComparison:
    """Greedy-decode ``steps`` tokens from every prompt with both models and compare them.

    Each model decodes independently (no KV cache: the whole sequence is re-run per token). The logits are then
    compared with both models reading the same tokens, model A's greedy sequence, so ``max_abs_dlogit`` stays
    meaningful after the decodes diverge.

    Args:
        model_a_fn: reference model (e.g. HF), ``tokens [1, s] -> logits [1, s, v']``.
        model_b_fn: converted model, same signature.
        prompts: non-empty token-id lists; ``len(prompt) + steps`` must fit both models' context.
        steps: tokens generated per prompt.
        vocab_size: columns compared (the true vocabulary); default the smaller of the two logit widths.

    Returns:
        ``LogitComparison(max_abs_dlogit, greedy_agreement)``.
    """
    if not prompts:
        raise ValueError("compare_logits needs at least one prompt.")
    if steps < 1:
        raise ValueError(f"steps ({steps}) must be >= 1.")
    max_diff, agree, total = 0.0, 0, 0
    for prompt in prompts:
        tokens = torch.as_tensor(prompt, dtype=torch.long).view(1, -1)
        if tokens.numel() == 0:
            raise ValueError("compare_logits: every prompt needs at least one token.")
        width_a = model_a_fn(tokens).shape[-1]
        width_b = model_b_fn(tokens).shape[-1]
        vocab = vocab_size or min(width_a, width_b)
        if vocab > min(width_a, width_b):
            raise ValueError(
                f"vocab_size ({vocab}) exceeds a model's logit width ({width_a}, {width_b})."
            )
        seq_a = _greedy(model_a_fn, tokens, steps, vocab)
        seq_b = _greedy(model_b_fn, tokens, steps, vocab)
        logits_a = model_a_fn(seq_a)[..., :vocab].double()  # [1, s+steps, v]
        logits_b = model_b_fn(seq_a)[..., :vocab].double()
        max_diff = max(max_diff, (logits_a - logits_b).abs().max().item())
        gen_a, gen_b = seq_a[0, tokens.shape[1] :], seq_b[0, tokens.shape[1] :]
        differs = (gen_a != gen_b).nonzero()
        agree += int(differs[0, 0]) if differs.numel() else steps
        total += steps
    return LogitComparison(max_diff, agree / total)


def fixed_prompts(vocab: int, max_positions: int, steps: int) -> tuple[list[list[int]], int]:
    """Three deterministic prompts (lengths 1, 4, 7) and the decode length that fits ``max_positions``."""
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (4, 7, 1)]
    return prompts, max(1, min(steps, max_positions - 7))


def megatron_logits_fn(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``tokens [1, s] -> logits [1, s, v]`` of a ``GPTModel`` (TP = 1)."""

    def fn(tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1]).unsqueeze(0)  # [1, s]
        return model(tokens, pos)

    return fn


def hf_logits_fn(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``tokens [1, s] -> logits [1, s, V]`` of a transformers causal LM."""
    return lambda tokens: model(input_ids=tokens).logits
