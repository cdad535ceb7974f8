"""Rules of the model shape that several layers need: each written once, here at the bottom of the package order.

- :func:`divisors` / :func:`choice_list`: the sizes a fix may suggest, in one wording.
- :func:`check_head_layout`: hidden size, heads, key/value heads and the rotary head dim fit together (flag
  validation and the model).
- :func:`check_tensor_parallel_split`: heads, key/value heads and FFN width split evenly over ``tp`` ranks (flag
  validation, the model, resharding and the checkpoint tools all call it, each naming its own TP flag).
- :func:`padded_vocab_size`: Megatron's vocabulary padding (the model, checkpoints, conversions and the run plan).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron.config.model import ModelConfig


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in ascending order (``[]`` for ``n < 1``)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def choice_list(values: Sequence[int]) -> str:
    """``[1, 2, 4]`` -> ``"1, 2 or 4"`` (the form error messages suggest sizes in)."""
    words = [str(v) for v in values]
    if len(words) <= 1:
        return "".join(words)
    return ", ".join(words[:-1]) + f" or {words[-1]}"


def check_head_layout(model: ModelConfig) -> None:
    """Heads and key/value heads of ``model`` fit together (the rules that do not depend on the layout).

    Raises:
        ValueError: naming the flags, their values and a fix.
    """
    n, g = model.num_attention_heads, model.num_query_groups
    if n < 1:
        raise ValueError(f"--num-attention-heads ({n}) must be a positive integer.")
    if model.kv_channels is None and model.hidden_size % n:
        raise ValueError(
            f"--hidden-size ({model.hidden_size}) must be divisible by --num-attention-heads ({n}); use a "
            f"head count among {choice_list(divisors(model.hidden_size))}, or set --kv-channels."
        )
    if g < 1 or n % g:
        raise ValueError(
            f"--num-key-value-heads ({g}) must divide --num-attention-heads ({n}); use "
            f"{choice_list(divisors(n))}."
        )
    if model.use_rotary_position_embeddings and model.head_dim % 2:
        raise ValueError(
            f"rotary embeddings need an even head dim; the head dim (--kv-channels, or --hidden-size / "
            f"--num-attention-heads) is {model.head_dim}."
        )


def check_tensor_parallel_split(
    model: ModelConfig, tp: int, *, tp_flag: str = "--tensor-model-parallel-size"
) -> None:
    """The attention heads, key/value heads and FFN width of ``model`` must each split evenly over ``tp`` ranks.

    Args:
        model: the architecture (``num_query_groups`` and ``ffn_size`` resolved).
        tp: the tensor-parallel size asked for.
        tp_flag: how the caller's user spells the TP size (``--tp`` in the checkpoint tools).

    Raises:
        ValueError: naming the first size ``tp`` does not divide and every TP size that divides them all, e.g.
            ``--num-attention-heads (12) must be divisible by --tensor-model-parallel-size (5); use 1, 2, 3, 4, 6
            or 12.``
    """
    if tp < 1:
        raise ValueError(f"{tp_flag} ({tp}) must be a positive integer.")
    sizes = (
        ("--num-attention-heads", model.num_attention_heads),
        ("--num-key-value-heads", model.num_query_groups),
        ("--ffn-hidden-size", model.ffn_size),
    )
    for flag, value in sizes:
        if value % tp:
            common = math.gcd(*(v for _, v in sizes))
            raise ValueError(
                f"{flag} ({value}) must be divisible by {tp_flag} ({tp}); use "
                f"{choice_list(divisors(common))} (the sizes that divide the attention heads "
                f"({sizes[0][1]}), the key/value heads ({sizes[1][1]}) and the FFN width ({sizes[2][1]}))."
            )


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's padded vocabulary: the smallest multiple of ``make_vocab_size_divisible_by * tp`` >= ``vocab_size``.

    Same rule as Megatron's ``_vocab_size_with_padding``: GPT-2's 50257 -> 50304 (tp 1), 50432 (tp 2), 50688 (tp 4).

    Raises:
        ValueError: when any argument is not a positive integer.
    """
    for flag, value in (
        ("vocab size", vocab_size),
        ("--make-vocab-size-divisible-by", make_vocab_size_divisible_by),
        ("--tensor-model-parallel-size", tp),
    ):
        if int(value) != value or value < 1:
            raise ValueError(f"{flag} ({value}) must be a positive integer to pad the vocabulary.")
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple
