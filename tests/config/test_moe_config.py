"""MoE flags: parsing (Megatron-DeepSpeed spellings and semantics), layer placement, and every validation message."""

from __future__ import annotations

import dataclasses

import pytest

from megatron.config import ModelConfig, parse_args, validate
from megatron.config.moe import MoEConfig

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--train-iters", "1", "--mock-data", "--vocab-size", "99"]  # fmt: skip


def _cfg(*flags: str):
    return parse_args([*BASE, *flags])


def test_flags_parse_into_moe_config() -> None:
    cfg = _cfg(
        "--num-experts", "8", "--expert-interval", "1", "--topk", "2", "--moe-train-capacity-factor", "1.5",
        "--moe-eval-capacity-factor", "2", "--moe-min-capacity", "0", "--disable-moe-token-dropping",
        "--disable-moe-top2-2nd-expert-sampling", "--moe-loss-coeff", "0.01", "--create-moe-param-group",
        "--mlp-type", "residual", "--moe-expert-parallel-size", "2", "--enable-expert-tensor-parallelism",
    )  # fmt: skip
    assert cfg.model.moe == MoEConfig(
        num_experts=(8,),
        expert_interval=1,
        topk=2,
        moe_train_capacity_factor=1.5,
        moe_eval_capacity_factor=2.0,
        moe_min_capacity=0,
        moe_token_dropping=False,
        moe_top2_2nd_expert_sampling=False,
        moe_loss_coeff=0.01,
        create_moe_param_group=True,
        mlp_type="residual",
    )
    assert (
        cfg.parallel.moe_expert_parallel_size == 2 and cfg.parallel.enable_expert_tensor_parallelism
    )
    # Megatron-DeepSpeed's defaults: dense, every 2nd layer, top-1, factor 1, min 4, dropping and sampling on
    assert _cfg().model.moe == MoEConfig()
    assert MoEConfig().moe_min_capacity == 4 and MoEConfig().moe_loss_coeff == 0.1
    for bad in (["--topk", "3"], ["--mlp-type", "dense"]):
        with pytest.raises(ValueError, match="invalid choice"):
            _cfg(*bad)
    assert (
        _cfg("--num-experts-switch", "8").model.moe.num_experts_switch == 8
    )  # Switch MLP: test_switch_mlp.py


def test_layers_follow_megatron_deepspeed() -> None:
    """Layer l (1-based) is MoE when l % interval == 0; one count or one per MoE layer."""
    assert MoEConfig(num_experts=(8,)).experts_per_layer(4) == (1, 8, 1, 8)
    assert MoEConfig(num_experts=(8,), expert_interval=1).experts_per_layer(3) == (8, 8, 8)
    assert MoEConfig(num_experts=(4, 8), expert_interval=2).experts_per_layer(4) == (1, 4, 1, 8)
    assert MoEConfig(num_experts=(1,)).experts_per_layer(4) == (1, 1, 1, 1)
    assert not MoEConfig().is_moe(4) and MoEConfig(num_experts=(2,)).is_moe(4)
    assert MoEConfig(num_experts=(2,), expert_interval=3).moe_layer_numbers(6) == (2, 5)


def test_saved_form_round_trips() -> None:
    """Checkpoint meta and converters keep ``dataclasses.asdict(model)``: the dict comes back as a MoEConfig."""
    model = _cfg("--num-experts", "4", "6").model
    again = ModelConfig(**dataclasses.asdict(model))
    assert again == model and isinstance(again.moe, MoEConfig) and again.moe.num_experts == (4, 6)


@pytest.mark.parametrize(
    ("flags", "world", "message"),
    [
        (["--num-experts", "4", "4", "4"], 1, "give one value, or one per MoE layer: --num-layers \\(4\\) // "),
        (["--num-experts", "4", "0"], 1, "every count must be >= 1"),
        (["--expert-interval", "0"], 1, "--expert-interval \\(0\\) must be >= 1"),
        (["--num-experts", "4", "--expert-interval", "5"], 1, "exceeds --num-layers"),
        (["--num-experts", "4", "--moe-train-capacity-factor", "0"], 1, "must be positive"),
        (["--num-experts", "4", "--moe-min-capacity", "-1"], 1, "--moe-min-capacity \\(-1\\) must be >= 0"),
        (["--moe-expert-parallel-size", "2"], 2, "needs MoE layers"),
        (["--enable-expert-tensor-parallelism"], 1, "needs MoE layers"),
        (["--num-experts", "4", "--moe-expert-parallel-size", "0"], 1, "must be >= 1"),
        (["--num-experts", "4", "--moe-expert-parallel-size", "2"], 1, "must divide the data-parallel size \\(1"),
        (["--num-experts", "4", "--moe-expert-parallel-size", "4", "--tensor-model-parallel-size", "2"], 4,
         "must divide the data-parallel size \\(2"),
        (["--num-experts", "6", "--moe-expert-parallel-size", "4"], 4, "\\[6\\] are not"),
        (["--num-experts", "4", "--ds-sequence-parallel-size", "2"], 2, "not composed with DeepSpeed-Ulysses"),
        (["--num-experts", "4", "--zero-stage", "3"], 1, "Native DeepSpeed MoE is not supported with ZeRO Stage 3"),
        (["--num-experts", "4", "--zero-stage", "1"], 1, "needs --create-moe-param-group"),
        (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
         "drop --sequence-parallel"),
        (["--num-experts", "4", "--checkpoint-activations"], 1, "recompute-granularity selective"),
        (["--num-experts", "4", "--universal-checkpoint", "--load", "x"], 1, "universal checkpoints are refused"),
        (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--enable-expert-tensor-parallelism",
          "--disable-moe-token-dropping"], 2, "keep token dropping"),
        (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--enable-expert-tensor-parallelism",
          "--moe-train-capacity-factor", "1.1", "--moe-min-capacity", "0"], 2, "expert capacity 5"),
    ],
)  # fmt: skip
def test_validation_messages(flags: list[str], world: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate(_cfg(*flags), world_size=world)


def test_valid_layouts_pass() -> None:
    for flags, world in (
        (["--num-experts", "8", "--moe-expert-parallel-size", "4"], 4),
        (["--num-experts", "4", "8", "--moe-expert-parallel-size", "2", "--tensor-model-parallel-size", "2"], 8),
        (["--num-experts", "4", "--zero-stage", "2", "--create-moe-param-group"], 1),
        (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--enable-expert-tensor-parallelism"], 2),
        (["--num-experts", "4", "--pipeline-model-parallel-size", "2", "--zero-stage", "1",
          "--create-moe-param-group", "--moe-expert-parallel-size", "2"], 4),
    ):  # fmt: skip
        validate(_cfg(*flags), world_size=world)


def test_save_refused_where_deepspeed_writes_no_loadable_moe_checkpoint(tmp_path) -> None:
    """TP 2 with whole experts and EP 1: DeepSpeed 0.19.8 leaves TP rank 1 without its files, so --save is refused;
    EP 2 (a multiple of TP) and the same layout without --save pass."""
    base = [*BASE, "--num-experts", "4", "--tensor-model-parallel-size", "2", "--zero-stage", "1",
            "--create-moe-param-group"]  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"--moe-expert-parallel-size \(1\) with --tensor-model-parallel-size \(2\)",
    ):
        validate(parse_args([*base, "--save", str(tmp_path / "ck")]), world_size=4)
    validate(parse_args(base), world_size=4)
    validate(
        parse_args([*base, "--moe-expert-parallel-size", "2", "--save", str(tmp_path / "ck")]),
        world_size=4,
    )
