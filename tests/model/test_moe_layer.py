"""The MoE layer on one process: state-dict names, layout-invariant expert init, aux loss, residual MoE, logging."""

from __future__ import annotations

import json

import torch

from megatron.config import ModelConfig
from megatron.config.moe import MoEConfig
from megatron.model import GPTModel
from megatron.model.moe import MoEMLP, moe_aux_loss
from megatron.mpu.context import ParallelContext

CFG = ModelConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64, ffn_hidden_size=48,
    swiglu=True, hidden_dropout=0.0, attention_dropout=0.0,
    moe=MoEConfig(num_experts=(4,), expert_interval=2, topk=2, moe_token_dropping=False,
                  moe_top2_2nd_expert_sampling=False),
)  # fmt: skip
PREFIX = "language_model.encoder.layers.1.mlp."


def test_state_dict_names_and_shapes() -> None:
    sd = GPTModel(CFG, ParallelContext(seed=3)).state_dict()
    assert "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight" in sd  # layer 1 of 2 is dense
    assert sd[PREFIX + "deepspeed_moe.gate.wg.weight"].shape == (4, 32)
    expert = PREFIX + "deepspeed_moe.experts.deepspeed_experts.3."
    assert sd[expert + "dense_h_to_4h.weight"].shape == (96, 32)  # [gate; up], whole expert
    assert sd[expert + "dense_4h_to_h.weight"].shape == (32, 48)
    assert sd[expert + "dense_4h_to_h.bias"].shape == (32,)


def test_expert_init_depends_on_global_id_only() -> None:
    """EP rank 1 of 2 holds global experts 2, 3 as its local 0, 1, with the values they have at EP = 1."""
    whole = MoEMLP(CFG, ParallelContext(seed=3), layer_number=1, num_experts=4).state_dict()
    half = MoEMLP(
        CFG,
        ParallelContext(seed=3, expert_parallel_size=2, expert_parallel_rank=1),
        layer_number=1,
        num_experts=4,
    ).state_dict()
    for local, glob in ((0, 2), (1, 3)):
        for name in ("dense_h_to_4h.weight", "dense_4h_to_h.weight"):
            a = half[f"deepspeed_moe.experts.deepspeed_experts.{local}.{name}"]
            b = whole[f"deepspeed_moe.experts.deepspeed_experts.{glob}.{name}"]
            assert torch.equal(a, b)
    assert torch.equal(half["deepspeed_moe.gate.wg.weight"], whole["deepspeed_moe.gate.wg.weight"])
    e0, e1 = (
        whole[f"deepspeed_moe.experts.deepspeed_experts.{j}.dense_h_to_4h.weight"] for j in (0, 1)
    )
    assert not torch.equal(e0, e1)


def test_aux_loss_and_residual_moe_train() -> None:
    """The MoE term (coeff x l_aux) is differentiable and reaches the gate; PR-MoE adds mlp.mlp and coefficient."""
    residual = ModelConfig(
        **{**CFG.__dict__, "moe": MoEConfig(num_experts=(4,), mlp_type="residual")}
    )
    for cfg in (CFG, residual):
        model = GPTModel(cfg, ParallelContext(seed=3))
        ids = torch.randint(0, 64, (2, 8))
        pos = torch.arange(8).expand(2, 8)
        lm = model(ids, pos, labels=ids).mean()
        aux = moe_aux_loss(model)
        assert aux is not None and aux.item() > 0
        (lm + aux).backward()
        gate = model.language_model.encoder.layers[1].mlp.deepspeed_moe.gate.wg.weight
        assert gate.grad is not None and gate.grad.abs().sum() > 0
    keys = GPTModel(residual, ParallelContext(seed=3)).state_dict()
    assert PREFIX + "mlp.dense_h_to_4h.weight" in keys and keys[
        PREFIX + "coefficient.weight"
    ].shape == (2, 32)


def test_log_line_and_metrics_record(tmp_path) -> None:
    """The progress line gains ``moe loss:`` after ``lm loss:``; the JSONL record ``moe_loss`` and ``expert_load``
    (dense records keep neither key); ``read_metrics`` reads both."""
    from megatron.training.metrics import (
        MetricsWriter,
        TrainRecord,
        format_train_line,
        read_metrics,
    )

    load = {"layers": [1], "tokens_per_expert": [[3, 5, 0, 8]], "dropped_tokens": [2]}
    common = {
        "consumed_samples": 8, "lm_loss": 4.5, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": 1.0, "skipped_iter": 0,
        "tokens_per_sec": 1.0, "tflops_per_device": 0.0, "mfu": None,
    }  # fmt: skip
    moe = TrainRecord(iteration=1, moe_loss=0.25, expert_load=load, **common)
    line = format_train_line(moe, train_iters=2, elapsed_ms=1.0, skipped_total=0)
    assert "lm loss: 4.500000E+00 | moe loss: 2.500000E-01 | grad norm: 1.000 |" in line
    dense = TrainRecord(iteration=2, **common)
    assert "moe loss" not in format_train_line(
        dense, train_iters=2, elapsed_ms=1.0, skipped_total=0
    )
    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(str(path), None, enabled=True)
    writer.train(moe)
    writer.train(dense)
    writer.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows[0]["moe_loss"] == 0.25 and rows[0]["expert_load"] == load
    assert "moe_loss" not in rows[1] and "expert_load" not in rows[1]
    train, _ = read_metrics(path)
    assert [r["iteration"] for r in train] == [1, 2]


def test_flops_count_the_active_experts() -> None:
    """MFU's N counts the gate and the top-k experts of an MoE layer, not all E experts."""
    from megatron.planning.flops import layer_params

    dense = ModelConfig(**{**CFG.__dict__, "moe": MoEConfig()})
    mlp = 3 * 32 * 48 + 2 * 48 + 32  # SwiGLU weights and biases
    assert layer_params(CFG, 64) - layer_params(dense, 64) == 4 * 32 + (2 - 1) * mlp
