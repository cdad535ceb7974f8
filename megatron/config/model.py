"""``ModelConfig``: the shape and numerics of the transformer. Parallel degrees live in ``ParallelConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megatron.config.lora import LoraConfig
from megatron.config.moe import MoEConfig


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a GPT/LLaMA-style decoder.

    Every field but ``vocab_size`` (the tokenizer's) is a Megatron flag of the same name.
    """

    num_layers: int = 2
    """Number of transformer layers L."""
    hidden_size: int = 64
    """Model width h."""
    num_attention_heads: int = 4
    """Query heads n."""
    num_key_value_heads: int | None = None
    """Key/value heads for grouped-query attention (default: as many as query heads, i.e. MHA)."""
    kv_channels: int | None = None
    """Channels per head (default: hidden size / attention heads)."""
    ffn_hidden_size: int | None = None
    """MLP width (default: 4h, or int(8h/3/64)*64 with --swiglu, as in Megatron)."""
    seq_length: int = 128
    """Training sequence length s."""
    max_position_embeddings: int | None = None
    """Rows of the learned position table (default: the sequence length)."""
    normalization: Literal["layernorm", "rmsnorm"] = "layernorm"
    """Norm of every layer: layernorm (GPT-2) or rmsnorm (LLaMA)."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every norm."""
    swiglu: bool = False
    """Gated SiLU MLP (LLaMA) instead of GeLU."""
    use_rotary_position_embeddings: bool = False
    """Rotary position embeddings (half-split, HF LLaMA convention) instead of learned positions."""
    rotary_position_embeddings_theta: float = 10000.0
    """Base of the rotary frequencies."""
    use_rope_scaling: bool = False
    """Llama 3's frequency-dependent RoPE scaling (transformers' rope_type "llama3"): low frequencies divided by
    --rope-scaling-factor, high ones kept, a smooth blend between."""
    rope_scaling_factor: float = 8.0
    """Llama 3 RoPE scaling: the divisor of the low frequencies (needs --use-rope-scaling)."""
    rope_scaling_low_freq_factor: float = 1.0
    """Llama 3 RoPE scaling: wavelengths above original context / this factor are divided by the factor."""
    rope_scaling_high_freq_factor: float = 4.0
    """Llama 3 RoPE scaling: wavelengths below original context / this factor are kept (must exceed the low
    one)."""
    rope_scaling_original_max_position_embeddings: int = 8192
    """Llama 3 RoPE scaling: the context length the model was first trained at."""
    rotary_seq_len_interpolation_factor: float | None = None
    """Linear RoPE scaling (position interpolation; transformers' rope_type "linear"): positions are divided by
    this factor."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that rotary rotates (the first int(fraction x head dim)); the rest pass
    through unrotated."""
    add_position_embedding: bool = True
    """The learned absolute position table (never with --use-rotary-position-embeddings)."""
    apply_layernorm_1p: bool = False
    """Zero-centered norm weights: the stored weight w starts at 0 and the norm multiplies by (1 + w)."""
    add_bias_linear: bool = True
    """Biases on QKV, the attention output and both MLP linears."""
    add_qkv_bias: bool = False
    """A bias on the QKV projection even with --disable-bias-linear (Qwen2); the other linears follow
    --disable-bias-linear."""
    qk_layernorm: bool = False
    """Per-head norm of queries and keys over the head dim (Qwen3), after the QKV projection and before RoPE: the
    --normalization kind and --layernorm-epsilon, one [kv-channels] weight shared by all heads."""
    untie_embeddings_and_output_weights: bool = False
    """A separate output projection instead of the tied word embeddings."""
    window_size: tuple[int, int] | None = None
    """Sliding-window attention (left, right): a query at i sees keys i-left .. i (right must be 0, the model is
    causal); give W or L,R. Hugging Face's sliding_window W is --window-size W-1 (see window_from_hf)."""
    attention_dropout: float = 0.1
    """Dropout on the attention probabilities."""
    hidden_dropout: float = 0.1
    """Dropout after attention and MLP, before the residual add."""
    init_method_std: float = 0.02
    """Std of the normal initialization; output layers use std / sqrt(2 L)."""
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this times the tensor-parallel size."""
    vocab_size: int = 0
    """True (unpadded) vocabulary size; set from the tokenizer by the trainer, not a flag."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recomputation: full (whole layers) or selective (core attention only); --checkpoint-activations
    is full."""
    recompute_method: Literal["uniform", "block"] | None = None
    """With full recomputation: uniform checkpoints every chunk of --recompute-num-layers layers (the default),
    block only the first --recompute-num-layers layers of each pipeline stage."""
    recompute_num_layers: int = 1
    """Layers per recomputed chunk (uniform) or layers recomputed per stage (block); alias
    --checkpoint-num-layers."""
    deepspeed_activation_checkpointing: bool = False
    """Full recomputation checkpoints its layer chunks through deepspeed.checkpointing (configured with Trident's
    mpu and RNG tracker) instead of Trident's own checkpoint; needs --checkpoint-activations or
    --recompute-granularity full."""
    partition_activations: bool = False
    """DeepSpeed activation checkpointing: each TP rank keeps 1/TP of every checkpointed input, all-gathered in
    backward (TP = 1: kept whole)."""
    contiguous_checkpointing: bool = False
    """DeepSpeed activation checkpointing: partitioned checkpoints go into preallocated contiguous buffers (needs
    --partition-activations); alias --contigious-checkpointing."""
    checkpoint_in_cpu: bool = False
    """DeepSpeed activation checkpointing: keep the checkpointed inputs in CPU memory."""
    synchronize_each_layer: bool = False
    """DeepSpeed activation checkpointing: synchronize the device before and after each checkpointed chunk."""
    profile_backward: bool = False
    """DeepSpeed activation checkpointing: log the forward and backward time of each checkpointed chunk."""
    use_flash_attn: bool = True
    """Attention through torch SDPA (flash kernels on GPU) instead of the plain reference path."""
    masked_softmax_fusion: bool = True
    """The reference attention path (--no-flash-attn) runs its scaled, masked softmax as one fused kernel (csrc/)
    where one is built."""
    bias_gelu_fusion: bool = True
    """The MLP's bias add and tanh-GeLU run as one fused kernel where one is built."""
    bias_swiglu_fusion: bool = True
    """The MLP's bias add and SwiGLU run as one fused kernel where one is built."""
    apply_rope_fusion: bool = True
    """The rotary embedding of q and k runs as one fused kernel each where one is built."""
    persist_layer_norm: bool = True
    """LayerNorm and RMSNorm run as fused kernels where built (Megatron's name; off: --no-persist-layer-norm)."""
    cross_entropy_loss_fusion: bool = True
    """The vocabulary-parallel cross-entropy runs as two fused kernel passes that write the gradient over the logits
    (no softmax-sized tensor kept) where built."""
    layout_invariant_init: bool = True
    """Layout-invariant initialization: each parameter's full value depends only on (seed, name), whatever the
    TP size (off: each TP shard is drawn on its own, faster)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-Experts layers (DeepSpeed-MoE); its fields are flags of their own (see ``MoEConfig``)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters for fine-tuning; its fields are flags of their own (see ``LoraConfig``)."""

    def __post_init__(self) -> None:
        moe: Any = self.moe
        # the saved ``dataclasses.asdict`` form (checkpoint meta, converters) becomes a MoEConfig again
        if isinstance(moe, dict):
            moe = {**moe, "num_experts": tuple(moe.get("num_experts", (1,)))}
            object.__setattr__(self, "moe", MoEConfig(**moe))
        if isinstance(self.lora, dict):
            object.__setattr__(self, "lora", LoraConfig(**self.lora))
        if self.window_size is not None and not isinstance(self.window_size, tuple):
            # JSON (checkpoint meta) gives a list
            object.__setattr__(self, "window_size", tuple(self.window_size))

    @property
    def num_query_groups(self) -> int:
        """K/V heads (GQA groups)."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Per-head channels hn."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        """The QKV projection has a bias: every linear has one, or --add-qkv-bias."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def ffn_size(self) -> int:
        """Resolved MLP width."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            return int(4 * self.hidden_size * 2 / 3 / 64) * 64 or 4 * self.hidden_size
        return 4 * self.hidden_size

    @property
    def moe_layers(self) -> tuple[tuple[int, ...], str] | None:
        """(experts of each layer, MoE mlp type): what an MoE checkpoint's shapes depend on; None for a dense
        model."""
        if not self.moe.is_moe(self.num_layers):
            return None
        return self.moe.experts_per_layer(self.num_layers), self.moe.mlp_type

    @property
    def max_positions(self) -> int:
        """Resolved learned-position table size."""
        return self.max_position_embeddings or self.seq_length


def window_from_hf(sliding_window: int) -> tuple[int, int]:
    """``--window-size`` of a Hugging Face ``sliding_window`` (Mistral, Qwen2).

    Hugging Face's query at ``i`` sees keys ``j`` with ``i - sliding_window < j <= i`` (``sliding_window_overlay``
    in ``transformers/masking_utils.py``): itself and ``sliding_window - 1`` earlier ones. Ours sees
    ``i - left <= j <= i``, so ``left = sliding_window - 1``.

    Raises:
        ValueError: ``sliding_window`` below 1.
    """
    if sliding_window < 1:
        raise ValueError(f"sliding_window ({sliding_window}) must be >= 1 to map to --window-size.")
    return (sliding_window - 1, 0)


def window_to_hf(window_size: tuple[int, int]) -> int:
    """Hugging Face's ``sliding_window`` of a ``--window-size`` (inverse of :func:`window_from_hf`).

    Raises:
        ValueError: a window with a right side (Hugging Face's causal models have none) or a negative left.
    """
    left, right = window_size
    if right != 0 or left < 0:
        raise ValueError(
            f"--window-size {left},{right} has no Hugging Face sliding_window: that needs right = 0 and left >= 0."
        )
    return left + 1


def parse_window_size(text: str) -> tuple[int, int]:
    """``--window-size`` from the command line: ``W`` (= ``W,0``) or ``L,R``.

    Raises:
        ValueError: anything else (argparse reports it as an invalid value of the flag).
    """
    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) == 1:
        return (values[0], 0)
    if len(values) == 2:
        return (values[0], values[1])
    raise ValueError(f"--window-size takes W or L,R (integers), not {text!r}")
