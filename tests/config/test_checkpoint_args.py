"""``--use-checkpoint-args`` in the parser: the model flags of a checkpoint (``model_flags``, the converters'
``model_args.sh``) give back its architecture, and the checkpoint's model record fills the flags a run leaves out,
refusing an explicit flag that disagrees. The checkpoint reader is injected (config reads no file); the reader over a
real directory is tested in ``tests/checkpointing/test_ckpt_model_args.py``, the refusals through ``pretrain_gpt.py``
in the bad-input catalogue (``tests/badinput/cases_r4_ckargs.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron.config import ModelConfig, parse_args, validate
from megatron.config.checkpoint_args import (
    DEFAULT_FIELDS,
    RUN_FIELDS,
    CheckpointModel,
    checkpoint_fields,
    model_flags,
)
from megatron.config.lora import LoraConfig
from megatron.config.moe import MoEConfig

LLAMA = {"normalization": "rmsnorm", "swiglu": True, "use_rotary_position_embeddings": True}
LLAMA.update(add_position_embedding=False, add_bias_linear=False)
MODELS = {
    # GPT-2: learned positions, the table (None: the training length) is a weight shape
    "gpt2": ModelConfig(num_layers=3, hidden_size=48, num_attention_heads=6, seq_length=96),
    # Llama 3.x: GQA, scaled RoPE with every factor off its default, untied, no biases
    "llama3": ModelConfig(
        num_layers=3, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
        ffn_hidden_size=200, max_position_embeddings=4096, layernorm_epsilon=1e-6,
        rotary_position_embeddings_theta=500000.0, use_rope_scaling=True, rope_scaling_factor=32.0,
        rope_scaling_low_freq_factor=2.0, rope_scaling_high_freq_factor=8.0,
        rope_scaling_original_max_position_embeddings=1024, untie_embeddings_and_output_weights=True,
        **LLAMA,
    ),
    # Qwen2 / Qwen3 / Mistral: QKV bias, QK-norm, kv-channels != h/n, a sliding window, linear RoPE
    "qwen3": ModelConfig(
        num_layers=2, hidden_size=40, num_attention_heads=6, num_key_value_heads=3, kv_channels=12,
        add_qkv_bias=True, qk_layernorm=True, window_size=(4, 0),
        rotary_seq_len_interpolation_factor=2.0, rotary_percent=0.5, make_vocab_size_divisible_by=64,
        **LLAMA,
    ),
    # MoE: per-layer expert counts, top-2, residual MoE; MoE training knobs are the run's (not listed)
    "moe": ModelConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, apply_layernorm_1p=True,
        moe=MoEConfig(num_experts=(4, 2), expert_interval=2, topk=2, mlp_type="residual"),
    ),
}  # fmt: skip
SOURCE = "ck/global_step0/trident_meta.json"


def _architecture(m: ModelConfig) -> dict[str, object]:
    """What a checkpoint fixes of ``m``: every architecture field, the position table resolved."""
    out = {mf.name: mf.value(m) for mf in checkpoint_fields() if mf.name != "seq_length"}
    learned = m.add_position_embedding and not m.use_rotary_position_embeddings
    out["max_position_embeddings"] = m.max_positions if learned else m.max_position_embeddings
    return out


@pytest.mark.parametrize("name", MODELS)
def test_model_flags_give_back_the_architecture(name: str) -> None:
    m = MODELS[name]
    flags = model_flags(m)
    assert "--seq-length" not in flags
    got = parse_args([*flags, "--seq-length", "64"]).model
    assert _architecture(got) == _architecture(m)
    # what no flag list carries: the run's own fields stay at the parser's defaults
    assert got.seq_length == 64 and got.attention_dropout == ModelConfig.attention_dropout


def test_every_model_field_is_in_one_table() -> None:
    """A field added to ModelConfig is an architecture field unless listed: nothing falls between the tables."""
    arch = {mf.name for mf in checkpoint_fields()}
    names = {f.name for f in dataclasses.fields(ModelConfig)} | {
        f.name for f in dataclasses.fields(MoEConfig)
    }
    names |= {f.name for f in dataclasses.fields(LoraConfig)}
    assert arch | set(RUN_FIELDS) | {"vocab_size", "moe", "lora"} == names
    assert not arch & set(RUN_FIELDS) and set(DEFAULT_FIELDS) <= arch


def _reader(m: ModelConfig, calls: list | None = None):
    def read(load: str, load_tag: str | None, universal: bool) -> CheckpointModel:
        if calls is not None:
            calls.append((load, load_tag, universal))
        return CheckpointModel(model=dataclasses.asdict(m), source=SOURCE)

    return read


def _with_checkpoint(m: ModelConfig, *flags: str, calls: list | None = None) -> ModelConfig:
    argv = ["--use-checkpoint-args", "--load", "ck", *flags]
    return parse_args(argv, read_checkpoint_model=_reader(m, calls)).model


def test_omitted_model_flags_come_from_the_checkpoint() -> None:
    m = MODELS["llama3"]
    calls: list = []
    got = _with_checkpoint(m, "--load-tag", "global_step0", "--attention-dropout", "0", calls=calls)
    assert calls == [("ck", "global_step0", False)]
    assert _architecture(got) == _architecture(m)
    # --seq-length defaults to the checkpoint's; the run's fields are the flags'
    assert got.seq_length == m.seq_length and got.attention_dropout == 0.0
    assert got.hidden_dropout == ModelConfig.hidden_dropout
    # the flags that agree (explicitly, at the parser's default, or a derived value) are fine
    same = ("--num-layers", "3", "--rotary-percent", "1.0", "--swiglu", "--kv-channels", "16")
    agreed = _with_checkpoint(m, *same)
    assert _architecture(dataclasses.replace(agreed, kv_channels=None)) == _architecture(m)
    assert agreed.head_dim == m.head_dim == 16
    moe = MODELS["moe"]
    assert _with_checkpoint(moe).moe == moe.moe


def test_sequence_and_position_rules() -> None:
    rope = MODELS["llama3"]
    # rotary: the training length and the context are the run's (a long-context extension raises both)
    got = _with_checkpoint(rope, "--seq-length", "8192", "--max-position-embeddings", "8192")
    assert (got.seq_length, got.max_position_embeddings) == (8192, 8192)
    assert _with_checkpoint(rope, "--seq-length", "32").max_position_embeddings == 4096
    # learned table (saved as None = its training length 96): its rows stay whatever --seq-length says
    gpt2 = MODELS["gpt2"]
    got = _with_checkpoint(gpt2, "--seq-length", "32")
    assert (got.seq_length, got.max_positions) == (32, 96)
    assert _with_checkpoint(gpt2, "--max-position-embeddings", "96").max_positions == 96
    with pytest.raises(ValueError, match=r"--max-position-embeddings 128 \(checkpoint: 96\)"):
        _with_checkpoint(gpt2, "--max-position-embeddings", "128")
    # a longer --seq-length than the table is validate()'s usual error
    cfg = parse_args(
        ["--use-checkpoint-args", "--load", "ck", "--seq-length", "128"],
        read_checkpoint_model=_reader(gpt2),
    )
    too_long = r"--seq-length \(128\) exceeds --max-position-embeddings \(96\)"
    with pytest.raises(ValueError, match=too_long):
        validate(cfg, world_size=1)


@pytest.mark.parametrize(
    ("name", "flags", "message"),
    [
        ("llama3", ("--num-layers", "4"), r"--num-layers 4 \(checkpoint: 3\) disagrees"),
        # an explicit flag at the parser's default still counts as given
        ("llama3", ("--normalization", "layernorm"), r"--normalization layernorm \(checkpoint: rmsnorm\)"),
        ("llama3", ("--rope-scaling-factor", "8"), r"--rope-scaling-factor 8.0 \(checkpoint: 32.0\)"),
        ("gpt2", ("--swiglu",), r"--swiglu \(checkpoint: swiglu=False\)"),
        ("qwen3", ("--window-size", "7"), r"--window-size 7,0 \(checkpoint: 4,0\)"),
        ("qwen3", ("--kv-channels", "10"), r"--kv-channels 10 \(checkpoint: 12\)"),
        ("llama3", ("--num-key-value-heads", "6"), r"--num-key-value-heads 6 \(checkpoint: 2\)"),
        ("gpt2", ("--kv-channels", "6"), r"--kv-channels 6 \(checkpoint: head_dim 8\)"),
        ("moe", ("--num-experts", "4"), r"--num-experts 4 \(checkpoint: 4 2\)"),
        (
            "qwen3",
            ("--num-layers", "3", "--hidden-size", "48"),
            r"--num-layers 3 \(checkpoint: 2\); --hidden-size 48 \(checkpoint: 40\) disagree with",
        ),
    ],
)  # fmt: skip
def test_a_conflicting_flag_is_one_line(name: str, flags: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        _with_checkpoint(MODELS[name], *flags)
    text = str(err.value)
    assert "\n" not in text and SOURCE in text and text.startswith("--use-checkpoint-args: ")


def test_no_load_or_no_reader_is_one_line() -> None:
    with pytest.raises(ValueError, match="but neither was given; add --load DIR"):
        parse_args(["--use-checkpoint-args"], read_checkpoint_model=_reader(ModelConfig()))
    with pytest.raises(ValueError, match="this program does not read checkpoints"):
        parse_args(["--use-checkpoint-args", "--load", "ck"])
    # without the flag the reader is never asked
    calls: list = []
    parse_args(["--load", "ck"], read_checkpoint_model=_reader(ModelConfig(), calls))
    assert calls == []


def test_a_lora_run_takes_the_model_from_its_base() -> None:
    """With --pretrained-checkpoint (LoRA's frozen base) the model comes from the base's ``latest``: a LoRA run's
    --load is its own adapter directory, empty at the first start."""
    m, calls = MODELS["llama3"], []
    argv = ["--use-checkpoint-args", "--pretrained-checkpoint", "base", "--lora-rank", "4"]
    for extra in ([], ["--load", "adapters", "--load-tag", "global_step9"]):
        got = parse_args([*argv, *extra], read_checkpoint_model=_reader(m, calls)).model
        assert _architecture(got) == _architecture(m) and got.lora.lora_rank == 4
    assert calls == [("base", None, False)] * 2
