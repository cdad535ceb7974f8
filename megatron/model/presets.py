"""Architecture presets as plain Megatron flag lists (append sizes, parallelism and training flags to them).

    from megatron.config import parse_args
    cfg = parse_args(LLAMA_FLAGS + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                    "--num-key-value-heads", "2", "--seq-length", "32"])

Every preset is expressible with ordinary flags (nothing here that a launch script cannot write by hand).
"""

from __future__ import annotations

GPT2_FLAGS: list[str] = [
    "--normalization", "layernorm",
    "--layernorm-epsilon", "1e-5",
    "--attention-dropout", "0.1",
    "--hidden-dropout", "0.1",
    "--init-method-std", "0.02",
    "--make-vocab-size-divisible-by", "128",
]  # fmt: skip
"""GPT-2: pre-LN LayerNorm, GeLU (tanh), learned positions, biases, tied embeddings, dropout 0.1."""

LLAMA_FLAGS: list[str] = [
    "--normalization", "rmsnorm",
    "--layernorm-epsilon", "1e-5",
    "--swiglu",
    "--use-rotary-position-embeddings",
    "--rotary-position-embeddings-theta", "10000",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--attention-dropout", "0",
    "--hidden-dropout", "0",
    "--no-query-key-layer-scaling",
]  # fmt: skip
"""LLaMA: RMSNorm, SwiGLU, RoPE (half-split), no linear biases, untied output layer, no dropout. Add
``--num-key-value-heads`` for GQA and ``--ffn-hidden-size`` for LLaMA's MLP width."""

TINY_GPT2_FLAGS: list[str] = GPT2_FLAGS + [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "64",
]  # fmt: skip
"""A GPT-2-style model small enough for CPU tests."""

TINY_LLAMA_FLAGS: list[str] = LLAMA_FLAGS + [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--num-key-value-heads", "2", "--ffn-hidden-size", "128", "--seq-length", "32",
]  # fmt: skip
"""A LLaMA-style GQA model small enough for CPU tests."""

PRESETS: dict[str, list[str]] = {
    "gpt2": GPT2_FLAGS,
    "llama": LLAMA_FLAGS,
    "tiny-gpt2": TINY_GPT2_FLAGS,
    "tiny-llama": TINY_LLAMA_FLAGS,
}


def preset_flags(name: str) -> list[str]:
    """A copy of the flag list of preset ``name``.

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}.")
    return list(PRESETS[name])
