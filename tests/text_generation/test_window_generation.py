"""Sliding-window attention in generation: greedy tokens through the KV-cached engine (prefill, then one token at a
time, left-padded batch) equal a no-cache decode that re-runs the whole sequence every step, on prompts longer
than the window and with QK-norm, QKV bias and Llama 3 RoPE scaling on."""

from __future__ import annotations

import dataclasses

import torch

from megatron.config import ModelConfig
from megatron.model.stage import GPTStage
from megatron.mpu.context import ParallelContext
from megatron.text_generation import SamplingParams
from megatron.text_generation.engine import InferenceEngine, TokenRequest

V = 97
CFG = ModelConfig(
    num_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, kv_channels=10,
    ffn_hidden_size=64, seq_length=32, vocab_size=V, attention_dropout=0.0, hidden_dropout=0.0,
    normalization="rmsnorm", swiglu=True, use_rotary_position_embeddings=True, add_bias_linear=False,
    add_qkv_bias=True, qk_layernorm=True, use_rope_scaling=True,
    rope_scaling_original_max_position_embeddings=8, window_size=(3, 0), init_method_std=0.2,
)  # fmt: skip
NEW = 10


def _no_cache_greedy(stage: GPTStage, prompt: list[int]) -> list[int]:
    seq = list(prompt)
    for _ in range(NEW):
        ids = torch.tensor([seq])  # [1, s]
        logits = stage(ids, torch.arange(len(seq)).view(1, -1))  # [s, 1, vp], no cache
        seq.append(int(logits[-1, 0, :V].argmax()))
    return seq[len(prompt) :]


@torch.no_grad()
def test_window_with_kv_cache_equals_full_forward_decode() -> None:
    stage = GPTStage(
        CFG, ParallelContext(seed=5), layers=(0, 2), pre_process=True, post_process=True
    )
    stage.eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (11, 6, 1)]
    reference = [_no_cache_greedy(stage, p) for p in prompts]
    engine = InferenceEngine(stage, pp_group=None, device=torch.device("cpu"))

    def request(p: list[int]) -> TokenRequest:
        return TokenRequest(p, NEW, SamplingParams(greedy=True), torch.Generator().manual_seed(1))

    batched = [
        r.tokens for r in engine.generate([request(p) for p in prompts])
    ]  # one left-padded batch
    alone = [engine.generate([request(p)])[0].tokens for p in prompts]
    assert batched == alone == reference, (batched, alone, reference)
    # the window matters here: without it the same weights decode other tokens
    wide = GPTStage(
        dataclasses.replace(CFG, window_size=None),
        ParallelContext(seed=5),
        layers=(0, 2),
        pre_process=True,
        post_process=True,
    ).eval()
    assert [_no_cache_greedy(wide, p) for p in prompts[:2]] != reference[:2]
