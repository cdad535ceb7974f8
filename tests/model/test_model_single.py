"""Single-process tests of megatron.model: Hugging Face goldens (GPT-2, LLaMA/GQA), attention paths, RoPE,
recomputation, names, helpers and error messages. No torch.distributed (a single process is TP = 1)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.config import ModelConfig, parse_args
from megatron.config.rules import padded_vocab_size
from megatron.model import GPTModel, loss_func, num_parameters, presets
from megatron.model.attention import reference_attention, sdpa_attention
from megatron.model.rotary import apply_rotary_pos_emb, rotary_cos_sin
from megatron.mpu.context import ParallelContext
from megatron.mpu.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

V = 100  # true vocab; padded to 128 at TP=1 with the default --make-vocab-size-divisible-by


def _cfg(**kw) -> ModelConfig:
    base = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 16,
        "vocab_size": V,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
    }
    base.update(kw)
    return ModelConfig(**base)


LLAMA_KW = {
    "normalization": "rmsnorm",
    "swiglu": True,
    "use_rotary_position_embeddings": True,
    "add_bias_linear": False,
    "untie_embeddings_and_output_weights": True,
    "num_key_value_heads": 2,
    "ffn_hidden_size": 96,
    "rotary_position_embeddings_theta": 5000.0,
}


def _batch(b: int = 2, s: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, s), generator=g)
    return ids, torch.arange(s).expand(b, s).contiguous()


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros(rows, w.shape[1], dtype=w.dtype)
    out[: w.shape[0]] = w
    return out


# --------------------------------------------------------------------------------------------------------------
# Hugging Face goldens: the mapping HF -> Megatron names is written out here on purpose (QKV interleave, gate/up).


def _gpt2_state_dict(hf, cfg: ModelConfig, padded: int) -> dict[str, torch.Tensor]:
    h, n = cfg.hidden_size, cfg.num_attention_heads
    hn = h // n
    sd = hf.state_dict()
    out = {
        "language_model.embedding.word_embeddings.weight": _pad_rows(
            sd["transformer.wte.weight"], padded
        ),
        "language_model.embedding.position_embeddings.weight": sd["transformer.wpe.weight"],
        "language_model.encoder.final_layernorm.weight": sd["transformer.ln_f.weight"],
        "language_model.encoder.final_layernorm.bias": sd["transformer.ln_f.bias"],
    }
    for i in range(cfg.num_layers):
        src, dst = f"transformer.h.{i}.", f"language_model.encoder.layers.{i}."
        w = sd[src + "attn.c_attn.weight"].t()  # Conv1D [h, 3h] -> [3h, h] = [q; k; v]
        b = sd[src + "attn.c_attn.bias"]
        # [3, n, hn, h] -> per head [q_j; k_j; v_j]: [n, 3, hn, h]
        out[dst + "self_attention.query_key_value.weight"] = (
            w.reshape(3, n, hn, h).transpose(0, 1).reshape(3 * h, h)
        )
        out[dst + "self_attention.query_key_value.bias"] = (
            b.reshape(3, n, hn).transpose(0, 1).reshape(3 * h)
        )
        out[dst + "self_attention.dense.weight"] = sd[src + "attn.c_proj.weight"].t()
        out[dst + "self_attention.dense.bias"] = sd[src + "attn.c_proj.bias"]
        out[dst + "mlp.dense_h_to_4h.weight"] = sd[src + "mlp.c_fc.weight"].t()
        out[dst + "mlp.dense_h_to_4h.bias"] = sd[src + "mlp.c_fc.bias"]
        out[dst + "mlp.dense_4h_to_h.weight"] = sd[src + "mlp.c_proj.weight"].t()
        out[dst + "mlp.dense_4h_to_h.bias"] = sd[src + "mlp.c_proj.bias"]
        for a, m in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            out[dst + m + ".weight"] = sd[src + a + ".weight"]
            out[dst + m + ".bias"] = sd[src + a + ".bias"]
    return out


def _llama_state_dict(hf, cfg: ModelConfig, padded: int) -> dict[str, torch.Tensor]:
    h, n, g, hn = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim
    r = n // g
    sd = hf.state_dict()
    out = {
        "language_model.embedding.word_embeddings.weight": _pad_rows(
            sd["model.embed_tokens.weight"], padded
        ),
        "language_model.output_layer.weight": _pad_rows(sd["lm_head.weight"], padded),
        "language_model.encoder.final_layernorm.weight": sd["model.norm.weight"],
    }
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"language_model.encoder.layers.{i}."
        q = sd[src + "self_attn.q_proj.weight"].reshape(g, r * hn, h)  # query heads of group j
        k = sd[src + "self_attn.k_proj.weight"].reshape(g, hn, h)
        v = sd[src + "self_attn.v_proj.weight"].reshape(g, hn, h)
        out[dst + "self_attention.query_key_value.weight"] = torch.cat([q, k, v], dim=1).reshape(
            (n + 2 * g) * hn, h
        )
        out[dst + "self_attention.dense.weight"] = sd[src + "self_attn.o_proj.weight"]
        out[dst + "mlp.dense_h_to_4h.weight"] = torch.cat(
            [sd[src + "mlp.gate_proj.weight"], sd[src + "mlp.up_proj.weight"]]
        )
        out[dst + "mlp.dense_4h_to_h.weight"] = sd[src + "mlp.down_proj.weight"]
        out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = sd[src + "post_attention_layernorm.weight"]
    return out


def _randomize_(module: torch.nn.Module, seed: int) -> None:
    # HF initializes norms to 1 and biases to 0; perturb everything so the mapping of each tensor is tested.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("use_flash_attn", [True, False])
def test_gpt2_matches_hugging_face(use_flash_attn: bool) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = _cfg(max_position_embeddings=32, use_flash_attn=use_flash_attn)
    hf_cfg = GPT2Config(
        vocab_size=V,
        n_positions=32,
        n_embd=64,
        n_layer=2,
        n_head=4,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
    )
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(hf_cfg).eval()
    _randomize_(hf, 1)
    model = GPTModel(cfg, ParallelContext(seed=7)).eval()
    missing = model.load_state_dict(_gpt2_state_dict(hf, cfg, model.padded_vocab_size), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    ids, pos = _batch()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits  # [b, s, V]
        logits = model(ids, pos)  # [b, s, 128]
        per_token = model(ids, pos, labels=ids)
    assert logits.shape == (2, 16, 128)
    torch.testing.assert_close(logits[..., :V], ref, rtol=0, atol=1e-5)
    assert torch.isneginf(logits[..., V:]).all()
    assert torch.equal(logits[..., :V].argmax(-1), ref.argmax(-1))  # greedy next tokens agree
    ce = torch.nn.functional.cross_entropy(ref.reshape(-1, V), ids.reshape(-1), reduction="none")
    torch.testing.assert_close(per_token, ce.view(2, 16), rtol=0, atol=1e-5)


def test_llama_gqa_matches_hugging_face() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = _cfg(**LLAMA_KW)
    hf_cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_cfg).eval()
    _randomize_(hf, 2)
    model = GPTModel(cfg, ParallelContext(seed=7)).eval()
    model.load_state_dict(_llama_state_dict(hf, cfg, model.padded_vocab_size), strict=True)
    ids, _ = _batch()
    # non-trivial positions (as with --reset-position-ids): RoPE must follow position_ids
    pos = torch.tensor([list(range(16)), list(range(5)) + list(range(11))])
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=pos).logits
        logits = model(ids, pos)
    torch.testing.assert_close(logits[..., :V], ref, rtol=0, atol=1e-5)
    assert torch.isneginf(logits[..., V:]).all()


# --------------------------------------------------------------------------------------------------------------


def test_sdpa_and_reference_attention_agree_and_are_causal() -> None:
    g = torch.Generator().manual_seed(3)
    s, b, n, gq, hn = 12, 2, 4, 2, 8
    q = torch.randn(s, b, n, hn, generator=g, requires_grad=True)
    k = torch.randn(s, b, gq, hn, generator=g, requires_grad=True)
    v = torch.randn(s, b, gq, hn, generator=g, requires_grad=True)
    a = sdpa_attention(q, k, v)
    ga = torch.autograd.grad(a.square().sum(), (q, k, v))
    r = reference_attention(q, k, v)
    gr = torch.autograd.grad(r.square().sum(), (q, k, v))
    assert a.shape == (s, b, n * hn)
    torch.testing.assert_close(a, r, rtol=0, atol=1e-6)
    for x, y in zip(ga, gr):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    # explicit Megatron mask (True = masked) equals the implicit causal one
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    torch.testing.assert_close(sdpa_attention(q, k, v, attention_mask=mask), a, rtol=0, atol=1e-6)
    # causality: changing the last token changes nothing before it
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[-1] += 1.0
    v2[-1] -= 1.0
    out2 = sdpa_attention(q.detach(), k2, v2)
    torch.testing.assert_close(out2[:-1], a.detach()[:-1], rtol=0, atol=0)
    # GQA: query head i uses K/V group i // (n / g)
    k_full = k.detach().repeat_interleave(n // gq, dim=2)
    v_full = v.detach().repeat_interleave(n // gq, dim=2)
    torch.testing.assert_close(
        sdpa_attention(q.detach(), k_full, v_full), a.detach(), rtol=0, atol=1e-6
    )


def test_rope_matches_hugging_face_half_split() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as ml

    hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=500.0)
    rope = ml.LlamaRotaryEmbedding(hf_cfg)
    g = torch.Generator().manual_seed(4)
    b, s, n, hn = 2, 10, 4, 16
    pos = torch.stack([torch.arange(s), torch.arange(3, 3 + s)])
    q = torch.randn(b, n, s, hn, generator=g)  # HF layout [b, n, s, hn]
    k = torch.randn(b, n, s, hn, generator=g)
    cos_hf, sin_hf = rope(q, pos)
    q_hf, k_hf = ml.apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    cos, sin = rotary_cos_sin(pos, hn, 500.0, torch.float32)  # [s, b, 1, hn]
    torch.testing.assert_close(cos[:, :, 0].transpose(0, 1), cos_hf, rtol=0, atol=1e-6)
    ours = apply_rotary_pos_emb(q.permute(2, 0, 1, 3), cos, sin).permute(1, 2, 0, 3)
    torch.testing.assert_close(ours, q_hf, rtol=0, atol=1e-6)
    ours_k = apply_rotary_pos_emb(k.permute(2, 0, 1, 3), cos, sin).permute(1, 2, 0, 3)
    torch.testing.assert_close(ours_k, k_hf, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kw", [{}, LLAMA_KW], ids=["gpt2", "llama"])
def test_whole_model_is_causal(kw: dict) -> None:
    """Changing token k changes the logits at positions >= k only."""
    model = GPTModel(_cfg(**kw), ParallelContext(seed=2)).eval()
    ids, pos = _batch()
    ids2 = ids.clone()
    ids2[:, 9] = (ids2[:, 9] + 1) % V
    with torch.no_grad():
        a, b = model(ids, pos), model(ids2, pos)
    assert torch.equal(a[:, :9], b[:, :9])
    assert (a[:, 9:, :V] - b[:, 9:, :V]).abs().amax(-1).min() > 0


def test_recompute_and_dropout_rng() -> None:
    """Full (uniform and block) and selective recomputation give the same loss and grads as none, with dropout
    on."""
    results = []
    for recompute, method in ((None, None), ("full", None), ("full", "block"), ("selective", None)):
        cfg = _cfg(
            num_layers=3,
            attention_dropout=0.2,
            hidden_dropout=0.2,
            recompute_granularity=recompute,
            recompute_method=method,
            recompute_num_layers=2,
            **{k: v for k, v in LLAMA_KW.items() if k != "untie_embeddings_and_output_weights"},
        )
        model = GPTModel(cfg, ParallelContext(seed=3))
        model_parallel_cuda_manual_seed(123)
        ids, pos = _batch()
        loss = loss_func(model(ids, pos, labels=ids), torch.ones(2, 16))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((loss.detach(), grads))
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=0, atol=0)
        for n, g in grads.items():
            torch.testing.assert_close(g, results[0][1][n], rtol=0, atol=1e-7, msg=n)
    # dropout is really active (else the comparison above proves nothing): eval mode gives another loss
    with torch.no_grad():
        ids, pos = _batch()
        eval_loss = loss_func(model.eval()(ids, pos, labels=ids), torch.ones(2, 16))
    assert abs(eval_loss.item() - results[0][0].item()) > 1e-3
    get_cuda_rng_tracker().reset()


def test_names_init_and_padding() -> None:
    cfg = _cfg(untie_embeddings_and_output_weights=True)
    a, b = GPTModel(cfg, ParallelContext(seed=5)), GPTModel(cfg, ParallelContext(seed=5))
    sd_a, sd_b = a.state_dict(), b.state_dict()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)  # f(seed, name) only
    c = GPTModel(cfg, ParallelContext(seed=6)).state_dict()
    assert not torch.equal(
        sd_a["language_model.output_layer.weight"], c["language_model.output_layer.weight"]
    )
    expected = {
        "language_model.embedding.word_embeddings.weight",
        "language_model.embedding.position_embeddings.weight",
        "language_model.encoder.final_layernorm.weight",
        "language_model.encoder.final_layernorm.bias",
        "language_model.output_layer.weight",
    } | {
        f"language_model.encoder.layers.{i}.{m}.{t}"
        for i in range(2)
        for m in (
            "input_layernorm",
            "self_attention.query_key_value",
            "self_attention.dense",
            "post_attention_layernorm",
            "mlp.dense_h_to_4h",
            "mlp.dense_4h_to_h",
        )
        for t in ("weight", "bias")
    }
    assert set(sd_a) == expected
    # padded rows are zero, norms ones, biases zero; output layers use std / sqrt(2L)
    for name in (
        "language_model.embedding.word_embeddings.weight",
        "language_model.output_layer.weight",
    ):
        assert sd_a[name].shape == (128, 64) and not sd_a[name][V:].any() and sd_a[name][:V].all()
    assert torch.equal(
        sd_a["language_model.encoder.layers.0.input_layernorm.weight"], torch.ones(64)
    )
    assert not sd_a["language_model.encoder.layers.1.mlp.dense_4h_to_h.bias"].any()
    std_out = sd_a["language_model.encoder.layers.0.mlp.dense_4h_to_h.weight"].std().item()
    std_in = sd_a["language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"].std().item()
    assert abs(std_in - 0.02) < 0.002 and abs(std_out - 0.02 / 2.0) < 0.001
    # the padding never matters: a larger padded vocab gives the same loss
    ids, pos = _batch()
    d = GPTModel(
        dataclasses.replace(cfg, make_vocab_size_divisible_by=256), ParallelContext(seed=5)
    )
    assert d.padded_vocab_size == 256
    torch.testing.assert_close(d(ids, pos, labels=ids), a(ids, pos, labels=ids), rtol=0, atol=0)


def _attr_layout(p: torch.Tensor) -> tuple[bool, int, int]:
    if not getattr(p, "tensor_model_parallel", False):
        return False, -1, 1
    return True, p.partition_dim, p.partition_stride


@pytest.mark.parametrize("kw", [{}, LLAMA_KW], ids=["gpt2", "llama"])
def test_checkpoint_layout_patterns_match_the_layers(kw: dict) -> None:
    """The name patterns for universal checkpoints agree with the TP attributes the layers set."""
    from megatron.layout.tensor_parallel import param_layout
    from megatron.layout.universal_info import universal_checkpoint_info

    cfg = _cfg(**kw)
    model = GPTModel(cfg, ParallelContext(seed=1))
    for name, p in model.named_parameters():
        assert param_layout(name, cfg) == _attr_layout(p), name
    info = universal_checkpoint_info(cfg, model.padded_vocab_size)
    assert info["original_vocab_size"] == V and info["padded_vocab_size"] == 128
    assert ("parameter_with_2_sub_params_cat_dim_0" in info) == cfg.swiglu


def test_helpers_presets_and_errors() -> None:
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 2) == 50432
    assert padded_vocab_size(50257, 128, 4) == 50688
    with pytest.raises(ValueError, match="make-vocab-size-divisible-by"):
        padded_vocab_size(100, 0, 1)
    loss = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert loss_func(loss, torch.tensor([[1, 0], [1, 1]])).item() == pytest.approx(8.0 / 3.0)
    assert loss_func(loss, torch.zeros(2, 2)).item() == 0.0
    with pytest.raises(ValueError, match="same"):
        loss_func(loss, torch.ones(2, 3))
    # parameter counts equal the model's, minus vocab padding
    for kw in ({}, LLAMA_KW):
        cfg = _cfg(**kw)
        counts = num_parameters(cfg)
        model = GPTModel(cfg, ParallelContext(seed=1))
        padding = (128 - V) * 64 * (2 if cfg.untie_embeddings_and_output_weights else 1)
        assert counts["total"] == sum(p.numel() for p in model.parameters()) - padding
        assert counts["total"] == counts["embedding"] + counts["non_embedding"]
    # presets are plain flags
    for name in presets.PRESETS:
        flags = presets.preset_flags(name) + ["--num-layers", "2"]
        parse_args(flags)
    llama = parse_args(presets.TINY_LLAMA_FLAGS).model
    assert llama.swiglu and llama.normalization == "rmsnorm" and llama.num_query_groups == 2
    assert llama.untie_embeddings_and_output_weights and not llama.add_bias_linear
    with pytest.raises(ValueError, match="unknown model preset"):
        presets.preset_flags("bert")
    # errors name the problem
    with pytest.raises(ValueError, match="vocab_size"):
        GPTModel(_cfg(vocab_size=0), ParallelContext(seed=1))
    model = GPTModel(_cfg(max_position_embeddings=16), ParallelContext(seed=1))
    ids, pos = _batch()
    with pytest.raises(ValueError, match="max-position-embeddings"):
        model(ids, pos + 1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(ids + V, pos)
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, pos[:, :8])


@pytest.mark.parametrize("arch", ["gpt2", "llama_gqa"])
@pytest.mark.parametrize("flash", [True, False])
def test_kv_cache_matches_full_recompute(arch: str, flash: bool) -> None:
    """Prefill + one token at a time through InferenceParams == the whole sequence at once (every position)."""
    from megatron.model import InferenceParams

    shape = {
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "seq_length": 24,
        "vocab_size": 97,
    }
    extra = (
        {"max_position_embeddings": 24}
        if arch == "gpt2"
        else {
            "num_key_value_heads": 2, "normalization": "rmsnorm", "swiglu": True,
            "use_rotary_position_embeddings": True, "add_bias_linear": False,
        }
    )  # fmt: skip
    cfg = ModelConfig(
        **shape, **extra, use_flash_attn=flash, attention_dropout=0.0, hidden_dropout=0.0
    )
    model = GPTModel(cfg, ParallelContext(seed=3)).eval()
    tokens = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens, torch.arange(20).expand(2, 20))  # [b, s, v]
        cache = InferenceParams(max_batch_size=2, max_sequence_length=24)
        pieces = []
        for start, end in [(0, 7), (7, 8), (8, 12), *((i, i + 1) for i in range(12, 20))]:
            cache.sequence_len_offset = start
            pos = torch.arange(start, end).expand(2, end - start)
            pieces.append(model(tokens[:, start:end], pos, inference_params=cache))
    cached = torch.cat(pieces, dim=1)
    assert torch.allclose(cached, full, atol=1e-5, rtol=0), (cached - full).abs().max()
    cache.sequence_len_offset = 20
    with pytest.raises(ValueError, match="KV cache overflow|learned position table has 24 rows"):
        model(tokens[:, :5], torch.arange(20, 25).expand(2, 5), inference_params=cache)
