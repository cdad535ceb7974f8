"""Tiny random Hugging Face models, built offline from configs (no downloads), shared by the checkpoint tests.

A plain module with a unique name (not conftest.py): spawned ranks re-import the test modules by name, and
``conftest`` would resolve to tests/conftest.py when both folders are on sys.path.
"""

from __future__ import annotations

import torch

VOCAB = 101  # not a multiple of 128: exercises vocabulary padding (-> 128 at TP 1)
# HF's 0.02 keeps a 32-wide model almost linear (erf vs tanh GeLU differ by < 1e-6 in the logits); 0.25 makes
# pre-activations O(1) so a wrong activation, gate/up order or norm epsilon shows up far above the tolerance.
INIT_STD = 0.25


def make_gpt2(*, activation: str = "gelu_new", tied: bool = True, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        activation_function=activation,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
        initializer_range=INIT_STD,
    )
    model = GPT2LMHeadModel(config).eval()
    # HF initializes biases and LN to 0/1; randomize them so a swapped bias or norm cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def make_llama(
    *, heads: int = 4, kv_heads: int = 2, tied: bool = False, seed: int = 0, hidden: int = 32
):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
        initializer_range=INIT_STD,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def make_mixtral(*, experts: int = 4, tied: bool = False, seed: int = 0, layers: int = 2):
    """A tiny random ``MixtralForCausalLM`` (top-2, GQA 4/2 heads, no sliding window); the router is drawn with
    a larger std than the other weights so routing probabilities are far from ties."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        sliding_window=None,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
        initializer_range=INIT_STD,
    )
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 1.0)
    return model


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
"""Llama 3 RoPE scaling for a 64-position model with head dim 10 and theta 500: of the 5 frequencies (wavelengths
6.3, 22, 76, 262, 904 tokens) the first is kept (< 32/4), the second blended, the rest divided by 4."""

FAMILY_SHAPES = {
    # Llama 3.2-like: tied embeddings, head dim 10 != 48/6, 3 query heads per K/V head, llama3 scaled RoPE
    "llama": {
        "hidden_size": 48,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 10,
        "tie_word_embeddings": True,
        "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500.0},
    },
    # Qwen2.5-0.5B-like: QKV bias, tied embeddings, head dim 48/6
    "qwen2": {
        "hidden_size": 48,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    },
    # Qwen3: QK-norm, head dim 12 != 40/6, a window of 5 on every layer, linear RoPE scaling
    "qwen3": {
        "hidden_size": 40,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "use_sliding_window": True,
        "sliding_window": 5,
        "max_window_layers": 0,
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
    },
    # Mistral 7B v0.1-like: a window of 5 (shorter than the prompts), head dim 12 != 40/6
    "mistral": {
        "hidden_size": 40,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "sliding_window": 5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    },
}
"""Awkward sizes per family: odd query heads per group, GQA, head dim != hidden / heads where the family allows."""


def make_family(kind: str, *, seed: int = 0, layers: int = 2, **overrides):
    """A tiny random ``*ForCausalLM`` of ``kind`` (llama, qwen2, qwen3, mistral) with :data:`FAMILY_SHAPES`; norm
    weights and biases are randomized so a swapped norm or bias cannot hide."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        kind,
        vocab_size=VOCAB,
        intermediate_size=40,
        num_hidden_layers=layers,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        initializer_range=INIT_STD,
        **{**FAMILY_SHAPES[kind], **overrides},
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model
