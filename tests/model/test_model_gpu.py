"""GPU checks of megatron.model (skipped without CUDA): the same model on CPU and GPU, and the SDPA (flash) path
against the plain reference path in bf16."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.config import ModelConfig
from megatron.model import GPTModel, loss_func
from megatron.model.attention import reference_attention, sdpa_attention
from megatron.mpu.context import ParallelContext

V = 1000

CFG = ModelConfig(
    num_layers=2,
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=2,
    ffn_hidden_size=512,
    seq_length=128,
    vocab_size=V,
    normalization="rmsnorm",
    swiglu=True,
    use_rotary_position_embeddings=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


def _loss(model: GPTModel, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (4, 128), generator=g).to(device)
    pos = torch.arange(128, device=device).expand(4, 128)
    return loss_func(model(ids, pos, labels=ids), torch.ones(4, 128, device=device))


@pytest.mark.gpu
def test_gpu_fp32_matches_cpu_and_bf16_flash_matches_reference() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cpu = _loss(GPTModel(CFG, ParallelContext(seed=1)), "cpu")
    gpu_model = GPTModel(CFG, ParallelContext(seed=1, device="cuda"))
    gpu = _loss(gpu_model, "cuda")
    gpu.backward()
    assert abs(gpu.item() - cpu.item()) <= 1e-5 * abs(cpu.item())
    assert all(torch.isfinite(p.grad).all() for p in gpu_model.parameters())
    losses = {}
    for flash in (True, False):
        cfg = dataclasses.replace(CFG, use_flash_attn=flash)
        losses[flash] = _loss(
            GPTModel(cfg, ParallelContext(seed=1, params_dtype=torch.bfloat16, device="cuda")),
            "cuda",
        )
    assert abs(losses[True].item() - losses[False].item()) <= 2e-2 * abs(cpu.item())
    assert abs(losses[True].item() - cpu.item()) <= 5e-2 * abs(cpu.item())


@pytest.mark.gpu
def test_gpu_sdpa_bf16_close_to_fp32_reference() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    s, b, n, gq, hn = 512, 2, 8, 2, 64
    q, k, v = (torch.randn(s, b, heads, hn, generator=g, device="cuda") for heads in (n, gq, gq))
    ref = reference_attention(q, k, v)
    out = sdpa_attention(q.bfloat16(), k.bfloat16(), v.bfloat16()).float()
    assert (out - ref).abs().max().item() <= 2e-2
