"""Flags of the model features of issue #31 (QKV bias, QK-norm, kv-channels, RoPE scaling, sliding window): their
parse, the Hugging Face window mapping, and every refusal by its message."""

from __future__ import annotations

import json

import pytest

from megatron.checkpointing.meta import model_config_from_dict, model_mismatches
from megatron.config import ModelConfig, TridentConfig, parse_args, validate
from megatron.config.model import parse_window_size, window_from_hf, window_to_hf

BASE = (
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--train-iters", "10", "--eval-iters", "0",
)  # fmt: skip
ROPE = ("--use-rotary-position-embeddings", "--normalization", "rmsnorm")


def _validated(*extra: str) -> TridentConfig:
    cfg = parse_args([*BASE, *extra])
    validate(cfg, world_size=1)
    return cfg


def test_feature_flags_set_their_fields_and_round_trip_through_the_meta() -> None:
    cfg = _validated(
        *ROPE, "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm", "--kv-channels", "24",
        "--use-rope-scaling", "--rope-scaling-factor", "32", "--rope-scaling-low-freq-factor", "2",
        "--rope-scaling-high-freq-factor", "8", "--rope-scaling-original-max-position-embeddings", "16",
        "--window-size", "7",
    )  # fmt: skip
    m = cfg.model
    assert (m.add_bias_linear, m.add_qkv_bias, m.qkv_bias, m.qk_layernorm) == (
        False,
        True,
        True,
        True,
    )
    assert m.head_dim == 24 and m.window_size == (7, 0)
    assert (m.rope_scaling_factor, m.rope_scaling_low_freq_factor) == (32.0, 2.0)
    assert (m.rope_scaling_high_freq_factor, m.rope_scaling_original_max_position_embeddings) == (
        8.0,
        16,
    )
    # what trident_meta.json records (dataclasses.asdict -> JSON) gives the same config back
    import dataclasses

    saved = json.loads(json.dumps(dataclasses.asdict(m)))
    assert saved["window_size"] == [7, 0] and model_config_from_dict(saved) == m
    # the QKV bias and the QK-norm change the checkpoint's parameters: a mismatch is named
    plain = dataclasses.replace(m, add_qkv_bias=False, qk_layernorm=False)
    assert model_mismatches(saved, plain) == [
        "qkv_bias: checkpoint True, flags False",
        "qk_layernorm: checkpoint True, flags False",
    ]
    linear = _validated(*ROPE, "--rotary-seq-len-interpolation-factor", "4", "--window-size", "5,0")
    assert linear.model.rotary_seq_len_interpolation_factor == 4.0
    assert linear.model.window_size == (5, 0) and not linear.model.use_rope_scaling
    default = _validated().model
    assert default.window_size is None and default.qkv_bias and not default.add_qkv_bias


def test_window_size_mapping_to_and_from_hugging_face() -> None:
    # HF Mistral: query i sees keys j with i - sliding_window < j <= i, i.e. sliding_window keys with itself
    assert window_from_hf(4096) == (4095, 0) and window_to_hf((4095, 0)) == 4096
    assert window_from_hf(1) == (0, 0)
    assert all(window_to_hf(window_from_hf(w)) == w for w in (1, 2, 3, 17))
    with pytest.raises(ValueError, match=r"sliding_window \(0\) must be >= 1"):
        window_from_hf(0)
    with pytest.raises(ValueError, match=r"--window-size 3,2 has no Hugging Face sliding_window"):
        window_to_hf((3, 2))
    assert parse_window_size("12") == (12, 0) and parse_window_size("3,0") == (3, 0)
    for bad in ("", "a", "1,2,3", "1.5"):
        with pytest.raises(ValueError, match="--window-size takes W or L,R"):
            parse_window_size(bad)
    with pytest.raises(ValueError, match=r"argument --window-size: --window-size takes W or L,R"):
        parse_args([*BASE, "--window-size", "4,x"])


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        (("--window-size", "4,2"), r"--window-size 4,2: the GPT model is causal, so the right side must be 0; "
         r"use --window-size 4\."),
        (("--window-size", "-3"), r"--window-size \(-3\) must be >= 0 keys to the left"),
        (("--use-rope-scaling",), r"--use-rope-scaling scales rotary position embeddings; add "
         r"--use-rotary-position-embeddings"),
        (("--rotary-seq-len-interpolation-factor", "2"), r"--rotary-seq-len-interpolation-factor scales rotary"),
        ((*ROPE, "--rope-scaling-factor", "4"), r"--rope-scaling-factor \(4.0\) sets Llama 3 RoPE scaling, which "
         r"is off; add --use-rope-scaling"),
        ((*ROPE, "--rope-scaling-original-max-position-embeddings", "4"),
         r"--rope-scaling-original-max-position-embeddings \(4\) sets Llama 3"),
        ((*ROPE, "--use-rope-scaling", "--rotary-seq-len-interpolation-factor", "2"),
         r"--use-rope-scaling \(Llama 3\) and --rotary-seq-len-interpolation-factor \(linear\) both rescale"),
        ((*ROPE, "--use-rope-scaling", "--rope-scaling-high-freq-factor", "1"),
         r"--rope-scaling-high-freq-factor \(1.0\) must exceed --rope-scaling-low-freq-factor \(1.0\)"),
        ((*ROPE, "--use-rope-scaling", "--rope-scaling-factor", "0"), r"--rope-scaling-factor \(0.0\) must be > 0"),
        ((*ROPE, "--rotary-seq-len-interpolation-factor", "-1"),
         r"--rotary-seq-len-interpolation-factor \(-1.0\) must be > 0"),
    ],
)  # fmt: skip
def test_bad_feature_combinations_are_one_line(extra: tuple[str, ...], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        _validated(*extra)


def test_accepted_edges() -> None:
    """A window that reaches every key is accepted (it masks nothing in training, limits generation past
    --seq-length); --add-qkv-bias with the linear biases on changes nothing; kv-channels needs no divisibility."""
    assert _validated("--window-size", "100").model.window_size == (100, 0)
    both = _validated("--add-qkv-bias").model
    assert both.qkv_bias and both.add_bias_linear
    odd = _validated(
        *ROPE, "--hidden-size", "60", "--num-attention-heads", "5", "--kv-channels", "6"
    ).model
    assert odd.head_dim == 6
    assert ModelConfig(window_size=[3, 0]).window_size == (3, 0)  # type: ignore[arg-type]
