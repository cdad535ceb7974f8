"""GPU check of generation (skipped without CUDA): greedy decoding of the same weights gives the same tokens on
the GPU as on the CPU (fp32)."""

from __future__ import annotations

import pytest
import torch

from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.mpu.context import ParallelContext
from megatron.text_generation import LogitsSource, SamplingParams, generate_tokens

CFG = ModelConfig(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=48,
    max_position_embeddings=48,
    vocab_size=300,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


@pytest.mark.gpu
def test_greedy_tokens_same_on_cpu_and_gpu() -> None:
    cpu = GPTModel(CFG, ParallelContext(seed=5)).eval()
    gpu = GPTModel(CFG, ParallelContext(seed=5)).eval().cuda()
    outs = []
    for model, dev in ((cpu, "cpu"), (gpu, "cuda")):

        def logits(tokens: torch.Tensor, m: GPTModel = model) -> torch.Tensor:
            pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
            return m(tokens, pos)

        with torch.no_grad():
            outs.append(
                generate_tokens(
                    LogitsSource(CFG.vocab_size, 48, logits_fn=logits, device=dev),
                    [1, 2, 3],
                    max_new_tokens=24,
                    params=SamplingParams(greedy=True),
                    generator=torch.Generator(),
                )
            )
    assert outs[0] == outs[1]
