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
