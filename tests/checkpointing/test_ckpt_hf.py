"""HF GPT-2 / LLaMA <-> Megatron full state dict: exact round trips, layout checked row by row, bad inputs."""

from __future__ import annotations

import logging

import pytest
import torch
from ckpt_models import VOCAB, make_gpt2, make_llama

from megatron.conversion.hf_gpt2 import gpt2_hf_to_megatron, megatron_to_gpt2_hf
from megatron.conversion.hf_llama import llama_hf_to_megatron, megatron_to_llama_hf

L0 = "language_model.encoder.layers.0."
L1 = "language_model.encoder.layers.1."
EMB = "language_model.embedding.word_embeddings.weight"
OUT = "language_model.output_layer.weight"


@pytest.fixture(scope="module")
def gpt2_model():
    return make_gpt2()


@pytest.fixture(scope="module")
def llama_model():
    return make_llama()


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))


def test_gpt2_round_trip_layout_and_reload(gpt2_model) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    sd = gpt2_model.state_dict()
    mg, cfg = gpt2_hf_to_megatron(sd, gpt2_model.config)

    # Flags that rebuild the architecture.
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_size) == (
        2,
        32,
        4,
        128,
    )
    assert cfg.vocab_size == VOCAB and cfg.max_positions == 64 and not cfg.swiglu
    assert cfg.normalization == "layernorm" and not cfg.untie_embeddings_and_output_weights
    assert OUT not in mg

    # Vocab padded with zero rows to Megatron's multiple of 128.
    emb = mg[EMB]
    assert emb.shape == (128, 32)
    assert torch.equal(emb[:VOCAB], sd["transformer.wte.weight"]) and not emb[VOCAB:].any()

    # Per-head [q_h; k_h; v_h] interleave, checked against HF's Conv1D [h, 3h] = [q | k | v] columns.
    hn = 8
    c_attn = sd["transformer.h.1.attn.c_attn.weight"]  # [in, out]
    qkv = mg[L1 + "self_attention.query_key_value.weight"]
    bias = mg[L1 + "self_attention.query_key_value.bias"]
    c_bias = sd["transformer.h.1.attn.c_attn.bias"]
    for head in range(4):
        for part in range(3):  # q, k, v
            rows = slice((3 * head + part) * hn, (3 * head + part + 1) * hn)
            cols = slice(part * 32 + head * hn, part * 32 + (head + 1) * hn)
            assert torch.equal(qkv[rows], c_attn[:, cols].t())
            assert torch.equal(bias[rows], c_bias[cols])
    assert torch.equal(
        mg[L0 + "mlp.dense_4h_to_h.weight"], sd["transformer.h.0.mlp.c_proj.weight"].t()
    )

    back, hf_cfg = megatron_to_gpt2_hf(mg, cfg, VOCAB)
    assert torch.equal(
        sd["lm_head.weight"], sd["transformer.wte.weight"]
    )  # tied: HF re-ties on load
    _assert_same(back, {k: v for k, v in sd.items() if k != "lm_head.weight"})
    assert all(t.is_contiguous() for t in back.values())

    # The exported config.json rebuilds a model that computes the same logits.
    rebuilt = GPT2LMHeadModel(GPT2Config.from_dict(hf_cfg)).eval()
    missing, unexpected = rebuilt.load_state_dict(back, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(rebuilt(tokens).logits, gpt2_model(tokens).logits)


def test_gpt2_untied_and_custom_padding() -> None:
    model = make_gpt2(tied=False, seed=3)
    sd = model.state_dict()
    mg, cfg = gpt2_hf_to_megatron(sd, model.config, padded_vocab=256)
    assert cfg.untie_embeddings_and_output_weights
    assert mg[EMB].shape == (256, 32) and mg[OUT].shape == (256, 32)
    assert torch.equal(mg[OUT][:VOCAB], sd["lm_head.weight"]) and not mg[OUT][VOCAB:].any()
    back, hf_cfg = megatron_to_gpt2_hf(mg, cfg, VOCAB)
    assert hf_cfg["tie_word_embeddings"] is False
    _assert_same(back, dict(sd))


def test_llama_gqa_round_trip_layout_and_reload(llama_model) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    sd = llama_model.state_dict()
    mg, cfg = llama_hf_to_megatron(sd, llama_model.config)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim, cfg.ffn_size) == (
        4,
        2,
        8,
        48,
    )
    assert cfg.swiglu and cfg.normalization == "rmsnorm" and cfg.use_rotary_position_embeddings
    assert cfg.layernorm_epsilon == 1e-5 and cfg.rotary_position_embeddings_theta == 10000.0
    assert not cfg.add_bias_linear and cfg.untie_embeddings_and_output_weights
    assert not any(k.endswith("bias") for k in mg)
    assert mg[EMB].shape == (128, 32) and mg[OUT].shape == (128, 32)

    # Per-group [q heads of g | k_g | v_g]: query heads 2g, 2g+1 share K/V head g (HF repeat_kv).
    hn, r = 8, 2
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    k = sd["model.layers.0.self_attn.k_proj.weight"]
    v = sd["model.layers.0.self_attn.v_proj.weight"]
    qkv = mg[L0 + "self_attention.query_key_value.weight"]
    assert qkv.shape == ((4 + 2 * 2) * hn, 32)
    for g in range(2):
        base = g * (r + 2) * hn
        assert torch.equal(qkv[base : base + r * hn], q[g * r * hn : (g + 1) * r * hn])
        assert torch.equal(qkv[base + r * hn : base + (r + 1) * hn], k[g * hn : (g + 1) * hn])
        assert torch.equal(qkv[base + (r + 1) * hn : base + (r + 2) * hn], v[g * hn : (g + 1) * hn])
    h_to_4h = mg[L0 + "mlp.dense_h_to_4h.weight"]
    assert torch.equal(h_to_4h[:48], sd["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(h_to_4h[48:], sd["model.layers.0.mlp.up_proj.weight"])

    back, hf_cfg = megatron_to_llama_hf(mg, cfg, VOCAB)
    _assert_same(back, dict(sd))
    rebuilt = LlamaForCausalLM(LlamaConfig.from_dict(hf_cfg)).eval()
    rebuilt.load_state_dict(back, strict=True)
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(rebuilt(tokens).logits, llama_model(tokens).logits)


def test_llama_tied_round_trip_and_bare_model_keys() -> None:
    model = make_llama(tied=True, seed=5)
    sd = model.state_dict()
    mg, cfg = llama_hf_to_megatron(sd, model.config.to_dict())
    assert not cfg.untie_embeddings_and_output_weights and OUT not in mg
    back, hf_cfg = megatron_to_llama_hf(mg, cfg, VOCAB)
    assert hf_cfg["tie_word_embeddings"] is True
    _assert_same(back, {k: v for k, v in sd.items() if k != "lm_head.weight"})
    # A bare LlamaModel state dict (no "model." prefix, no lm_head) converts to the same thing.
    bare = {k.removeprefix("model."): v for k, v in sd.items() if k != "lm_head.weight"}
    _assert_same(llama_hf_to_megatron(bare, hf_cfg)[0], mg)


def test_import_rejects_unsupported_variants(gpt2_model, llama_model, caplog) -> None:
    gsd, gcfg = gpt2_model.state_dict(), gpt2_model.config.to_dict()
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        gpt2_hf_to_megatron(gsd, {**gcfg, "scale_attn_by_inverse_layer_idx": True})
    with pytest.raises(ValueError, match="model_type is 'llama'"):
        gpt2_hf_to_megatron(gsd, {**gcfg, "model_type": "llama"})
    with pytest.raises(ValueError, match="does not map"):
        gpt2_hf_to_megatron({**gsd, "transformer.h.0.attn.extra": torch.zeros(1)}, gcfg)
    with pytest.raises(ValueError, match=r"no 'h\.1\.ln_1\.weight'"):
        gpt2_hf_to_megatron(
            {k: v for k, v in gsd.items() if k != "transformer.h.1.ln_1.weight"}, gcfg
        )
    with caplog.at_level(logging.WARNING):
        gpt2_hf_to_megatron(gsd, {**gcfg, "activation_function": "gelu"})
    assert "activation_function is 'gelu'" in caplog.text

    lsd, lcfg = llama_model.state_dict(), llama_model.config.to_dict()
    with pytest.raises(ValueError, match="rope_type 'llama3'"):
        llama_hf_to_megatron(lsd, {**lcfg, "rope_parameters": {"rope_type": "llama3"}})
    with pytest.raises(ValueError, match="attention_bias"):
        llama_hf_to_megatron(lsd, {**lcfg, "attention_bias": True})
    with pytest.raises(ValueError, match="lm_head.weight is missing"):
        llama_hf_to_megatron({k: v for k, v in lsd.items() if k != "lm_head.weight"}, lcfg)


def test_export_rejects_mismatched_config(gpt2_model, llama_model) -> None:
    gmg, gcfg = gpt2_hf_to_megatron(gpt2_model.state_dict(), gpt2_model.config)
    lmg, lcfg = llama_hf_to_megatron(llama_model.state_dict(), llama_model.config)
    with pytest.raises(ValueError, match="cannot be exported as HF LLaMA.*--swiglu"):
        megatron_to_llama_hf(gmg, gcfg, VOCAB)
    with pytest.raises(ValueError, match="cannot be exported as HF GPT-2.*must be layernorm"):
        megatron_to_gpt2_hf(lmg, lcfg, VOCAB)
    with pytest.raises(ValueError, match="does not account for"):
        megatron_to_gpt2_hf({**gmg, OUT: gmg[EMB]}, gcfg, VOCAB)
    with pytest.raises(ValueError, match="has no 'language_model.encoder.layers.1"):
        megatron_to_gpt2_hf({k: v for k, v in gmg.items() if not k.startswith(L1)}, gcfg, VOCAB)
