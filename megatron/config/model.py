"""``ModelConfig``: the shape and numerics of the transformer. Parallel degrees live in ``ParallelConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a GPT/LLaMA-style decoder; every field mirrors a Megatron flag."""

    num_layers: int = 2
    """--num-layers: number of transformer layers."""
    hidden_size: int = 64
    """--hidden-size: model width h."""
    num_attention_heads: int = 4
    """--num-attention-heads: query heads n."""
    num_key_value_heads: int | None = None
    """--num-key-value-heads: K/V heads for GQA (None = num_attention_heads, i.e. MHA)."""
    kv_channels: int | None = None
    """--kv-channels: per-head dim (None = hidden_size / num_attention_heads)."""
    ffn_hidden_size: int | None = None
    """--ffn-hidden-size: MLP width (None = 4h, or int(8h/3/64)*64 with --swiglu as in Megatron)."""
    seq_length: int = 128
    """--seq-length: training sequence length s."""
    max_position_embeddings: int | None = None
    """--max-position-embeddings: learned position table size (None = seq_length)."""
    normalization: Literal["layernorm", "rmsnorm"] = "layernorm"
    """--normalization: layernorm (GPT-2) or rmsnorm (LLaMA)."""
    layernorm_epsilon: float = 1e-5
    """--layernorm-epsilon: epsilon of every norm."""
    swiglu: bool = False
    """--swiglu: gated SiLU MLP instead of GeLU."""
    use_rotary_position_embeddings: bool = False
    """--use-rotary-position-embeddings: RoPE (half-split, HF LLaMA convention) instead of learned positions."""
    rotary_position_embeddings_theta: float = 10000.0
    """--rotary-position-embeddings-theta: RoPE base."""
    add_bias_linear: bool = True
    """Inverse of --disable-bias-linear: biases on QKV, attention output and both MLP linears."""
    untie_embeddings_and_output_weights: bool = False
    """--untie-embeddings-and-output-weights: separate output projection instead of the tied embedding."""
    attention_dropout: float = 0.1
    """--attention-dropout: dropout on attention probabilities."""
    hidden_dropout: float = 0.1
    """--hidden-dropout: dropout after attention and MLP (before the residual add)."""
    init_method_std: float = 0.02
    """--init-method-std: std of the normal init; output layers use std / sqrt(2 * num_layers)."""
    make_vocab_size_divisible_by: int = 128
    """--make-vocab-size-divisible-by: the vocab is padded to a multiple of this times the TP size."""
    vocab_size: int = 0
    """True (unpadded) vocabulary size; set from the tokenizer by the trainer, not a flag."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """--recompute-granularity (or --checkpoint-activations = full): activation recomputation."""
    recompute_num_layers: int = 1
    """--recompute-num-layers / --checkpoint-num-layers: layers per recomputed chunk."""
    use_flash_attn: bool = True
    """Attention through torch SDPA (flash kernels on GPU); --no-flash-attn selects the plain reference path."""
    layout_invariant_init: bool = True
    """Each parameter's full value depends on (seed, name) only; --per-shard-init trades that for speed."""

    @property
    def num_query_groups(self) -> int:
        """K/V heads (GQA groups)."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Per-head channels hn."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """Resolved MLP width."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            return int(4 * self.hidden_size * 2 / 3 / 64) * 64 or 4 * self.hidden_size
        return 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        """Resolved learned-position table size."""
        return self.max_position_embeddings or self.seq_length
