"""Megatron-LM's Switch MLP (``--num-experts-switch``): flags, names, the routing math, and the same losses at TP 1,
TP 2 and PP 2 (real gloo ranks, real DeepSpeed engine)."""

from __future__ import annotations

import pytest
import torch

from megatron.config import ModelConfig, parse_args, validate
from megatron.config.moe import MoEConfig
from megatron.model import GPTModel
from megatron.model.switch_mlp import SwitchMLP
from megatron.mpu.context import ParallelContext
from megatron.testing import run_distributed

CFG = ModelConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64, ffn_hidden_size=48,
    hidden_dropout=0.0, attention_dropout=0.0, moe=MoEConfig(num_experts_switch=4),
)  # fmt: skip
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--mock-data", "--vocab-size", "99"]  # fmt: skip


def test_flag_parses_and_bad_values_are_refused() -> None:
    assert parse_args([*BASE, "--num-experts-switch", "4"]).model.moe.num_experts_switch == 4
    assert parse_args(BASE).model.moe.num_experts_switch is None
    with pytest.raises(ValueError, match=r"--num-experts-switch \(0\) must be >= 1"):
        validate(parse_args([*BASE, "--num-experts-switch", "0"]), world_size=1)
    seq = [
        *BASE,
        "--num-experts-switch",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
    ]
    with pytest.raises(ValueError, match="--num-experts-switch .* with --sequence-parallel"):
        validate(parse_args(seq), world_size=2)


def test_names_and_routing_match_a_per_token_reference() -> None:
    model = GPTModel(CFG, ParallelContext(seed=5))
    sd = model.state_dict()
    layer = "language_model.encoder.layers.1.mlp."
    assert sd[layer + "router.weight"].shape == (4, 32) and sd[layer + "router.bias"].shape == (4,)
    assert sd[layer + "experts.3.dense_h_to_4h.weight"].shape == (48, 32)
    assert not torch.equal(
        sd[layer + "experts.0.dense_h_to_4h.weight"], sd[layer + "experts.1.dense_h_to_4h.weight"]
    )
    again = GPTModel(CFG, ParallelContext(seed=5)).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in sd.items())  # f(seed, name)

    switch = SwitchMLP(CFG, ParallelContext(seed=5), layer_number=0)
    with torch.no_grad():
        switch.router.weight.normal_(0.0, 1.0)  # routes tokens to several experts
    x = torch.randn(
        6, 3, 32, generator=torch.Generator().manual_seed(0), requires_grad=True
    )  # [s, b, h]
    out, bias = switch(x)
    assert bias is None and out.shape == x.shape
    chosen = set()
    for i in range(6):
        for j in range(3):
            tok = x[i, j]
            prob = torch.softmax(switch.router(tok).float(), dim=-1)
            e = int(prob.argmax())
            chosen.add(e)
            y, b = switch.experts[e](tok.view(1, 1, 32))
            ref = (y.view(32) + b) * prob[e]
            torch.testing.assert_close(out[i, j], ref, rtol=1e-6, atol=1e-6)
    assert len(chosen) > 1, chosen
    out.sum().backward()
    assert switch.router.weight.grad is not None and switch.router.weight.grad.abs().sum() > 0
    used = [m for m in switch.experts if m.dense_h_to_4h.weight.grad is not None]
    assert len(used) == len(chosen)


ITERS = 6
TRAIN = [*BASE, "--num-experts-switch", "4", "--global-batch-size", "4", "--train-iters", str(ITERS),
         "--lr", "2e-3", "--seed", "1234", "--attention-dropout", "0", "--hidden-dropout", "0",
         "--eval-interval", "1000", "--eval-iters", "0", "--log-interval", "1", "--log-level", "WARNING"]  # fmt: skip


def _train(argvs: list[list[str]]) -> list[list[float]]:
    from megatron.training import pretrain

    out = []
    for argv in argvs:
        result = pretrain(parse_args(argv))
        assert result.exit_code == 0 and result.iteration == ITERS
        out.append(result.losses)
    return out


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_switch_mlp_same_losses_at_tp2_and_pp2() -> None:
    layouts = [
        [],
        ["--tensor-model-parallel-size", "2"],
        ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"],
    ]
    single = run_distributed(_train, 1, [TRAIN], init_process_group=False, timeout=600)[0][0]
    per_rank = run_distributed(
        _train, 2, [[*TRAIN, *extra] for extra in layouts], init_process_group=False, timeout=600
    )
    assert single[-1] < single[0], single  # it learns
    for losses in per_rank[0]:
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, single, strict=True)) < 1e-5, (
            losses,
            single,
        )
