"""HF LLaMA (Llama 3 RoPE scaling), Qwen2, Qwen3 and Mistral <-> Trident: the config and weight mapping, what is
refused, and the tools at TP = 2 x PP = 2 with text generation against transformers' greedy decode.

Every family is a tiny random model with awkward sizes (``ckpt_models.FAMILY_SHAPES``: 3 query heads per K/V head,
head dim != hidden / heads where the family allows, Llama 3 and linear RoPE scaling, a window of 5 shorter than the
prompts). Default suite: the mapping of all four (config.json -> ModelConfig -> config.json, weights exact, our
model's logits within 1e-5 of HF's at TP = 1), both transformers spellings of RoPE scaling, the refusals, and ONE
combined case through the tools (Qwen3: QK-norm, head dim 12 != 40/6, window 5, linear RoPE) at TP = 2 x PP = 2 with
greedy generation there. ``-m slow``: the same for LLaMA, Qwen2 and Mistral.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import torch
from ckpt_models import LLAMA3_ROPE, VOCAB, make_family

from megatron.checkpointing.meta import model_config_from_meta
from megatron.checkpointing.readers import build_megatron_model
from megatron.config import parse_args
from megatron.config.checkpoint_args import checkpoint_fields
from megatron.config.model import ModelConfig
from megatron.conversion.hf_features import export_family
from megatron.conversion.hf_import import hf_converter
from megatron.conversion.hf_llama import llama_hf_to_megatron, megatron_to_llama_hf
from megatron.conversion.hf_mixtral import verification_config
from megatron.conversion.verify import (
    compare_logits,
    fixed_prompts,
    hf_logits_fn,
    megatron_logits_fn,
)
from megatron.testing import run_distributed
from tools.checkpoint import hf_to_trident, trident_to_hf

TOL = 1e-5
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
EXPECTED = {
    # (kv_channels, add_qkv_bias, qk_layernorm, window_size, tied, RoPE fields)
    "llama": (10, False, False, None, True, {
        "use_rope_scaling": True, "rope_scaling_factor": 4.0, "rope_scaling_low_freq_factor": 1.0,
        "rope_scaling_high_freq_factor": 4.0, "rope_scaling_original_max_position_embeddings": 32,
        "rotary_position_embeddings_theta": 500.0}),
    "qwen2": (None, True, False, None, True, {"rotary_position_embeddings_theta": 1e6}),
    "qwen3": (12, False, True, (4, 0), False, {
        "rotary_seq_len_interpolation_factor": 2.0, "rotary_position_embeddings_theta": 1e4}),
    "mistral": (12, False, False, (4, 0), False, {"rotary_position_embeddings_theta": 1e6}),
}  # fmt: skip


@pytest.fixture(scope="module")
def models():
    return {kind: make_family(kind) for kind in FAMILIES}


def _ours_vs_hf(hf, full: dict[str, torch.Tensor], cfg: ModelConfig):
    ours = build_megatron_model(full, verification_config(cfg))
    prompts, steps = fixed_prompts(
        VOCAB, 64, 16
    )  # prompts of 1, 4, 7 tokens + 16: past the window of 5
    with torch.no_grad():
        return compare_logits(
            hf_logits_fn(hf), megatron_logits_fn(ours), prompts, steps, vocab_size=VOCAB
        )


@pytest.mark.parametrize("kind", FAMILIES)
def test_family_config_and_weights_round_trip(models, kind: str) -> None:
    hf = models[kind]
    sd = hf.state_dict()
    full, cfg = llama_hf_to_megatron(sd, hf.config.to_dict(), model_type=kind)
    kv, qkv_bias, qk_norm, window, tied, rope = EXPECTED[kind]
    assert (cfg.kv_channels, cfg.add_qkv_bias, cfg.qk_layernorm, cfg.window_size) == (
        kv, qkv_bias, qk_norm, window,
    )  # fmt: skip
    assert cfg.untie_embeddings_and_output_weights is not tied and not cfg.add_bias_linear
    assert {k: getattr(cfg, k) for k in rope} == rope
    assert (cfg.num_attention_heads, cfg.num_query_groups) == (6, 2)
    # our model at TP = 1 computes HF's logits (the features are load-bearing: see the test below)
    cmp = _ours_vs_hf(hf, full, cfg)
    assert cmp.max_abs_dlogit <= TOL and cmp.greedy_agreement == 1.0, cmp

    back, hf_cfg = megatron_to_llama_hf(full, cfg, VOCAB, recorded_family=kind)
    assert hf_cfg["model_type"] == kind and hf_cfg["architectures"] == [type(hf).__name__]
    expected_sd = {k: v for k, v in sd.items() if not (tied and k == "lm_head.weight")}
    assert sorted(back) == sorted(expected_sd)
    assert all(torch.equal(back[k], expected_sd[k]) for k in expected_sd)
    # config.json as written (JSON round trip) rebuilds the same HF model
    rebuilt_cfg = type(hf.config).from_dict(json.loads(json.dumps(hf_cfg)))
    rebuilt = type(hf)(rebuilt_cfg).eval()
    rebuilt.load_state_dict(back, strict=False)
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(rebuilt(tokens).logits, hf(tokens).logits)
    # the import of the export is the same model
    again, cfg_again = llama_hf_to_megatron(back, hf_cfg, model_type=kind)
    assert cfg_again == cfg and all(torch.equal(again[k], full[k]) for k in full)


def test_features_are_load_bearing(models) -> None:
    """Dropping the window, the QK-norm weights' effect or the RoPE scaling moves the logits far past TOL, so the
    round trips above check them."""
    for kind, change in (
        ("mistral", {"window_size": None}),
        ("qwen3", {"rotary_seq_len_interpolation_factor": None}),
        ("llama", {"use_rope_scaling": False}),
    ):
        hf = models[kind]
        full, cfg = llama_hf_to_megatron(hf.state_dict(), hf.config.to_dict(), model_type=kind)
        cmp = _ours_vs_hf(hf, full, dataclasses.replace(cfg, **change))
        assert cmp.max_abs_dlogit > 1e-2, (kind, change, cmp)
    hf = models["qwen3"]
    full, cfg = llama_hf_to_megatron(hf.state_dict(), hf.config.to_dict(), model_type="qwen3")
    ones = {
        k: (torch.ones_like(v) if "_layernorm" in k and "self_attention" in k else v)
        for k, v in full.items()
    }
    assert _ours_vs_hf(hf, ones, cfg).max_abs_dlogit > 1e-2


def test_transformers4_rope_spellings_map_alike(models) -> None:
    """transformers 4's ``rope_theta`` + ``rope_scaling`` (``type`` or ``rope_type``) and 5's ``rope_parameters``
    give the same model; the export writes both spellings."""
    hf = models["llama"]
    sd, v5 = hf.state_dict(), hf.config.to_dict()
    v4 = {**v5, "rope_theta": 500.0, "rope_scaling": dict(LLAMA3_ROPE)}
    del v4["rope_parameters"]
    assert llama_hf_to_megatron(sd, v4)[1] == llama_hf_to_megatron(sd, v5)[1]
    linear4 = {**v4, "rope_scaling": {"type": "linear", "factor": 3.0}}
    cfg = llama_hf_to_megatron(sd, linear4)[1]
    assert cfg.rotary_seq_len_interpolation_factor == 3.0 and not cfg.use_rope_scaling
    _, out = megatron_to_llama_hf(llama_hf_to_megatron(sd, linear4)[0], cfg, VOCAB)
    assert out["rope_theta"] == 500.0 and out["rope_scaling"] == {
        "rope_type": "linear",
        "factor": 3.0,
    }
    assert out["rope_parameters"] == {"rope_type": "linear", "factor": 3.0, "rope_theta": 500.0}
    # llama3 without original_max_position_embeddings: transformers falls back to max_position_embeddings
    no_orig = {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
    cfg = llama_hf_to_megatron(sd, {**v4, "rope_scaling": no_orig})[1]
    assert cfg.rope_scaling_original_max_position_embeddings == 64


REFUSED = [
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ("mistral", {"rope_parameters": {"rope_type": "longrope"}}, "rope_type 'longrope'"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "needs a positive number 'low_freq"),
    ("llama", {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary"),
    ("qwen3", {"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per layer type"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1, "layer_types": None},
     r"max_window_layers 1\)"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, r"slides the window on layers \[1\] only"),
    ("qwen2", {"layer_types": ["sliding_attention"] * 2}, "one attention kind"),
    ("qwen3", {"attention_bias": True}, "Qwen3 config.json has attention_bias: true"),
    ("llama", {"mlp_bias": True}, "LLaMA config.json has mlp_bias: true"),
    ("mistral", {"sliding_window": 0}, "sliding_window 0"),
    ("mistral", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
]  # fmt: skip


@pytest.mark.parametrize("kind,change,match", REFUSED, ids=[m for _, _, m in REFUSED])
def test_what_cannot_be_expressed_is_refused_by_name(models, kind, change, match) -> None:
    hf = models[kind]
    with pytest.raises(ValueError, match=match) as err:
        llama_hf_to_megatron(hf.state_dict(), {**hf.config.to_dict(), **change}, model_type=kind)
    assert "\n" not in str(err.value)


def test_moe_relatives_and_export_families_are_named(models, tmp_path: Path, capsys) -> None:
    for kind, what in (("qwen2_moe", "Qwen2-MoE"), ("qwen3_moe", "Qwen3-MoE")):
        with pytest.raises(ValueError, match=f"model_type '{kind}' is {what}"):
            hf_converter(kind, "d")
    # the tool: one line, exit 2, nothing written, no rank spawned
    models["qwen3"].save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_moe"}))
    argv = ["--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "out")]
    capsys.readouterr()
    assert hf_to_trident.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'qwen3_moe' is Qwen3-MoE" in err
    assert not (tmp_path / "out").exists()

    base = llama_hf_to_megatron(models["llama"].state_dict(), models["llama"].config.to_dict())[1]
    picks = [
        ({}, None, "llama"),
        ({}, "mistral", "mistral"),  # imported from Mistral (window null): back to Mistral
        ({"add_qkv_bias": True}, "llama", "qwen2"),
        ({"qk_layernorm": True, "window_size": (4, 0)}, None, "qwen3"),
        ({"window_size": (4, 0)}, "llama", "mistral"),
        ({"hidden_size": 50}, "llama", "mistral"),  # LlamaConfig needs hidden % heads == 0
    ]
    for change, recorded, family in picks:
        assert export_family(dataclasses.replace(base, **change), recorded) == family
    with pytest.raises(ValueError, match="--qk-layernorm and --add-qkv-bias"):
        export_family(dataclasses.replace(base, qk_layernorm=True, add_qkv_bias=True), "qwen3")


def _generate_at(ckpt: str, tp: int, pp: int, prompt: str, n: int) -> tuple[list[int], list[float]]:
    """Greedy generation (KV cache) from a checkpoint at TP x PP (spawned ranks)."""
    from megatron.mpu import parallel_state
    from megatron.text_generation import SamplingParams, TextGenerator
    from megatron.text_generation.distributed import init_inference_distributed

    layout = init_inference_distributed(tp, pp, ckpt_dir=ckpt, device="cpu")
    gen = TextGenerator.from_checkpoint(ckpt, device="cpu", layout=layout)
    out = gen.generate(
        prompt,
        max_new_tokens=n,
        params=SamplingParams(greedy=True),
        generator=torch.Generator(),
        stop_at_eod=False,
        return_log_probs=True,
    )
    parallel_state.destroy_model_parallel()
    assert out.log_probs is not None
    return out.tokens, out.log_probs


def _model_args_give_the_model(path: Path, cfg: ModelConfig) -> None:
    """The converter's model_args.sh, expanded by bash, parses back to the checkpoint's model."""
    words = subprocess.run(
        ["bash", "-c", 'source "$0" && printf "%s\\0" "${MODEL_ARGS[@]}"', str(path)],
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout.decode()
    got = parse_args([*words.split("\0")[:-1], "--seq-length", str(cfg.seq_length)]).model
    assert [mf.value(got) for mf in checkpoint_fields()] == [
        mf.value(cfg) for mf in checkpoint_fields()
    ]


def _round_trip_and_generate(kind: str, hf, tmp_path: Path, capsys) -> None:
    """HF -> Trident at TP = 2 x PP = 2 (verified by the tool) -> HF (verified) against the original, and greedy
    generation at TP = 2 x PP = 2 against transformers' ``generate`` (prompt of 9 > the window of 5)."""
    from transformers import AutoModelForCausalLM

    src, ck, back = tmp_path / "hf", tmp_path / "ck", tmp_path / "back"
    hf.save_pretrained(src)
    argv = ["--hf-dir", str(src), "--save", str(ck), "--tp", "2", "--pp", "2", "--no-progress"]
    assert hf_to_trident.main(argv) == 0
    assert "-> OK" in capsys.readouterr().out
    meta = json.loads((ck / "global_step0" / "trident_meta.json").read_text())
    assert meta["hf_model_type"] == kind
    _model_args_give_the_model(ck / "model_args.sh", model_config_from_meta(meta))
    assert trident_to_hf.main(["--load", str(ck), "--out", str(back), "--no-progress"]) == 0
    assert "-> OK" in capsys.readouterr().out
    assert json.loads((back / "config.json").read_text())["model_type"] == kind
    again = AutoModelForCausalLM.from_pretrained(str(back), local_files_only=True).eval()
    prompts, steps = fixed_prompts(VOCAB, 64, 32)
    with torch.no_grad():
        cmp = compare_logits(
            hf_logits_fn(hf), hf_logits_fn(again), prompts, steps, vocab_size=VOCAB
        )
    assert cmp.max_abs_dlogit <= TOL and cmp.greedy_agreement == 1.0, cmp
    print(f"{kind} TP=2 PP=2: HF -> Trident -> HF max |dlogit| {cmp.max_abs_dlogit:.2e}")

    ids = [5, 17, 42, 99, 3, 64, 8, 23, 71]
    with torch.no_grad():
        seq = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0)
        logp = torch.log_softmax(hf(seq).logits, dim=-1)[0]  # [n, V]
    ref = seq[0].tolist()
    ref_lp = [float(logp[i - 1, ref[i]]) for i in range(len(ids), len(ref))]
    prompt = " ".join(map(str, ids))
    tokens, log_probs = run_distributed(_generate_at, 4, str(ck), 2, 2, prompt, 16, timeout=300)[0]
    assert tokens == ref[len(ids) :], (tokens, ref)
    assert max(abs(a - b) for a, b in zip(log_probs, ref_lp, strict=True)) <= TOL


@pytest.mark.slow  # ~19 s (suite time): every family's round trip runs in-process above; the tools at TP 2 in
# test_ckpt_convert.py's llama GQA test and test_lora_export.py
def test_qwen3_tp2_pp2_round_trip_and_greedy_generation(models, tmp_path: Path, capsys) -> None:
    _round_trip_and_generate("qwen3", models["qwen3"], tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_family_tp2_pp2_round_trip_and_greedy_generation(
    models, kind: str, tmp_path: Path, capsys
) -> None:
    _round_trip_and_generate(kind, models[kind], tmp_path, capsys)
