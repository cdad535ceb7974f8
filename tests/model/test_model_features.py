"""The model features of issue #31 against the real ``transformers`` (single process, TP = 1): scaled RoPE tables,
the sliding-window mask, and the logits of tiny Mistral / Qwen2 / Qwen3 / Llama 3 models built locally from
configs (GQA, head dim != hidden / heads, QKV bias, QK-norm, a window shorter than the sequence, llama3 and linear
RoPE scaling), both attention paths. The HF -> Megatron mapping is written out here on purpose, as in
``test_model_single.py``; the TP split of the new tensors is checked on the layout rule.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.config import ModelConfig
from megatron.layout.qkv import fuse_qkv
from megatron.layout.tensor_parallel import shard_state_dict, tp_partition
from megatron.model import GPTModel
from megatron.model.attention import window_mask
from megatron.model.rotary import (
    model_rotary,
    rope_scaling,
    rotary_dim,
    rotary_inv_freq,
    scaled_inv_freq,
)
from megatron.mpu.context import ParallelContext

V = 100
H, N, G, HN, FFN, S = 48, 6, 2, 12, 64, 16  # head dim 12 != 48 / 6


def _cfg(**kw) -> ModelConfig:
    base = {
        "num_layers": 2, "hidden_size": H, "num_attention_heads": N, "num_key_value_heads": G, "kv_channels": HN,
        "ffn_hidden_size": FFN, "seq_length": S, "vocab_size": V, "attention_dropout": 0.0, "hidden_dropout": 0.0,
        "normalization": "rmsnorm", "layernorm_epsilon": 1e-6, "swiglu": True, "use_rotary_position_embeddings": True,
        "rotary_position_embeddings_theta": 10000.0, "add_bias_linear": False,
        "untie_embeddings_and_output_weights": True,
    }  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)


LLAMA3 = {
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
OURS_LLAMA3 = {
    "use_rope_scaling": True, "rope_scaling_factor": 4.0, "rope_scaling_low_freq_factor": 1.0,
    "rope_scaling_high_freq_factor": 4.0, "rope_scaling_original_max_position_embeddings": 32,
}  # fmt: skip


def _hf_rope(kind: str, **extra) -> dict:
    return {"rope_type": kind, "rope_theta": 10000.0, **extra}


# ------------------------------------------------------------------------------------------- RoPE tables


@pytest.mark.parametrize(
    ("hf_rope", "ours"),
    [
        (_hf_rope("llama3", **LLAMA3), OURS_LLAMA3),
        (_hf_rope("llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=16.0,
                  original_max_position_embeddings=1024), {
            "use_rope_scaling": True, "rope_scaling_factor": 8.0, "rope_scaling_low_freq_factor": 2.0,
            "rope_scaling_high_freq_factor": 16.0, "rope_scaling_original_max_position_embeddings": 1024}),
        (_hf_rope("linear", factor=2.5), {"rotary_seq_len_interpolation_factor": 2.5}),
        (_hf_rope("default"), {}),
    ],
    ids=["llama3", "llama3-wide", "linear", "none"],
)  # fmt: skip
def test_rope_tables_equal_transformers(hf_rope: dict, ours: dict) -> None:
    """inv_freq bit for bit, and the cos/sin tables of the model at awkward positions, from transformers' own
    ``ROPE_INIT_FUNCTIONS`` / ``LlamaRotaryEmbedding`` (head dim 128 so every frequency regime is populated)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = LlamaConfig(
        hidden_size=1024, num_attention_heads=8, head_dim=128, rope_parameters=hf_rope
    )
    cfg = _cfg(
        hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, kv_channels=128, **ours
    )
    mine = scaled_inv_freq(rotary_inv_freq(128, 10000.0), rope_scaling(cfg))
    if hf_rope["rope_type"] != "default":
        theirs, attention_factor = ROPE_INIT_FUNCTIONS[hf_rope["rope_type"]](hf_cfg, None)
        assert attention_factor == 1.0 and torch.equal(mine, theirs)
        assert not torch.equal(mine, rotary_inv_freq(128, 10000.0))  # the scaling changed something
    pos = torch.tensor([[0, 1, 7, 31, 32, 100, 2047, 70000]])
    cos, sin = model_rotary(cfg, pos, torch.float32)  # [s, 1, 1, d]
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_cfg)(
        torch.zeros(1, dtype=torch.float32), pos
    )  # [1, s, d]
    torch.testing.assert_close(cos[:, :, 0].transpose(0, 1), hf_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, :, 0].transpose(0, 1), hf_sin, rtol=0, atol=1e-6)
    assert rotary_dim(128, 1.0) == cos.shape[-1]


# ------------------------------------------------------------------------------------------- window mask


@pytest.mark.parametrize("window", [1, 2, 5, 16, 40])
def test_window_mask_equals_mistral_semantics(window: int) -> None:
    """Our mask for --window-size window_from_hf(W) is transformers' sliding-window causal mask function for
    ``sliding_window = W``: whole sequence, and the last queries after a KV cache (absolute positions)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    from megatron.config.model import window_from_hf

    allowed = sliding_window_causal_mask_function(window)
    left, right = window_from_hf(window)
    assert right == 0
    total = 20
    for s in (total, 3, 1):  # training; a chunk of 3 and one token after the cache
        mine = ~window_mask(s, total, left, torch.device("cpu"))[0, 0]  # [s, S], True = sees
        zero = torch.tensor(0)
        queries = torch.arange(total - s, total).view(s, 1)  # absolute positions
        theirs = allowed(zero, zero, queries, torch.arange(total).view(1, total))  # [s, S]
        assert torch.equal(mine, theirs), (window, s)


# ------------------------------------------------------------------------------------------- goldens


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


def _state_dict(hf: torch.nn.Module, cfg: ModelConfig, padded: int) -> dict[str, torch.Tensor]:
    """HF Llama-family names -> Megatron's (fused per-group QKV, [gate; up], optional QKV bias and QK-norm)."""
    sd = hf.state_dict()
    grouping = {
        "num_heads": cfg.num_attention_heads,
        "num_groups": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
    }
    out = {
        "language_model.embedding.word_embeddings.weight": _pad_rows(
            sd["model.embed_tokens.weight"], padded
        ),
        "language_model.output_layer.weight": _pad_rows(sd["lm_head.weight"], padded),
        "language_model.encoder.final_layernorm.weight": sd["model.norm.weight"],
    }
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"language_model.encoder.layers.{i}."
        attn = src + "self_attn."
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            q, k, v = (sd[f"{attn}{p}_proj.{kind}"] for p in "qkv")
            out[f"{dst}self_attention.query_key_value.{kind}"] = fuse_qkv(q, k, v, **grouping)
        if cfg.qk_layernorm:
            out[dst + "self_attention.q_layernorm.weight"] = sd[attn + "q_norm.weight"]
            out[dst + "self_attention.k_layernorm.weight"] = sd[attn + "k_norm.weight"]
        out[dst + "self_attention.dense.weight"] = sd[attn + "o_proj.weight"]
        gate_up = [sd[src + "mlp.gate_proj.weight"], sd[src + "mlp.up_proj.weight"]]
        out[dst + "mlp.dense_h_to_4h.weight"] = torch.cat(gate_up)
        out[dst + "mlp.dense_4h_to_h.weight"] = sd[src + "mlp.down_proj.weight"]
        out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = sd[src + "post_attention_layernorm.weight"]
    return out


def _hf_model(family: str) -> tuple[torch.nn.Module, ModelConfig]:
    import transformers

    common = {
        "vocab_size": V, "hidden_size": H, "intermediate_size": FFN, "num_hidden_layers": 2, "num_attention_heads": N,
        "num_key_value_heads": G, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "hidden_act": "silu", "attn_implementation": "eager",
    }  # fmt: skip
    if family == "mistral":  # sliding window 5 < 16, llama3 scaling
        hf_cfg = transformers.MistralConfig(
            **common, head_dim=HN, sliding_window=5, rope_parameters=_hf_rope("llama3", **LLAMA3)
        )
        ours = _cfg(window_size=(4, 0), **OURS_LLAMA3)
        cls = transformers.MistralForCausalLM
    elif (
        family == "qwen2"
    ):  # QKV bias only, all layers sliding, linear scaling (head dim = h / n in Qwen2)
        common.update(num_attention_heads=4)
        hf_cfg = transformers.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=6, max_window_layers=0,
            rope_parameters=_hf_rope("linear", factor=2.0),
        )  # fmt: skip
        ours = _cfg(num_attention_heads=4, kv_channels=None, add_qkv_bias=True, window_size=(5, 0),
                    rotary_seq_len_interpolation_factor=2.0)  # fmt: skip
        cls = transformers.Qwen2ForCausalLM
    else:  # qwen3: QK-norm, head dim 12, llama3 scaling
        hf_cfg = transformers.Qwen3Config(
            **common,
            head_dim=HN,
            attention_bias=False,
            rope_parameters=_hf_rope("llama3", **LLAMA3),
        )
        ours = _cfg(qk_layernorm=True, **OURS_LLAMA3)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    hf = cls(hf_cfg).eval()
    g = torch.Generator().manual_seed(1)
    with (
        torch.no_grad()
    ):  # HF starts norms at 1 and biases at 0: perturb all so every mapping is tested
        for p in hf.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return hf, ours


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_families_match_hugging_face(family: str) -> None:
    """Logits within 1e-5 of transformers' on 2 x 16 tokens, SDPA and reference paths, fused kernels on and off."""
    hf, cfg = _hf_model(family)
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(S).expand(2, S)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits  # [b, s, V]
    for flash, fused in ((True, True), (False, True), (False, False)):
        knobs = {"use_flash_attn": flash, "persist_layer_norm": fused, "apply_rope_fusion": fused,
                     "masked_softmax_fusion": fused, "bias_swiglu_fusion": fused}  # fmt: skip
        model = GPTModel(dataclasses.replace(cfg, **knobs), ParallelContext(seed=7)).eval()
        model.load_state_dict(_state_dict(hf, cfg, model.padded_vocab_size), strict=True)
        with torch.no_grad():
            logits = model(ids, pos)[..., :V]
        torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5, msg=f"{family} {knobs}")


# ------------------------------------------------------------------------------------------- TP layout


def test_qkv_bias_and_qk_norm_split_over_tp_with_gqa() -> None:
    """The QKV bias is split like the weight rows (rank r holds its K/V groups' [q..., k, v] entries); the QK-norm
    weights are replicated, one [kv_channels] vector each."""
    cfg = _cfg(add_qkv_bias=True, qk_layernorm=True, num_attention_heads=8, num_key_value_heads=4)
    model = GPTModel(cfg, ParallelContext(seed=3))
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    name = "language_model.encoder.layers.1.self_attention."
    assert sd[name + "query_key_value.bias"].shape == ((8 + 2 * 4) * HN,)
    assert sd[name + "q_layernorm.weight"].shape == sd[name + "k_layernorm.weight"].shape == (HN,)
    assert tp_partition(name + "query_key_value.bias", cfg) == (0, 1)
    assert tp_partition(name + "q_layernorm.weight", cfg) is None
    assert tp_partition(name + "k_layernorm.weight", cfg) is None
    q, k, v = (torch.arange(rows, dtype=torch.float32) for rows in (8 * HN, 4 * HN, 4 * HN))
    full = fuse_qkv(q, k + 1000, v + 2000, num_heads=8, num_groups=4, head_dim=HN)
    for rank in range(2):
        shard = shard_state_dict({name + "query_key_value.bias": full}, cfg, 2, rank)
        # rank r: query heads 4r .. 4r+3 and K/V groups 2r, 2r+1, in the per-group order
        mine = fuse_qkv(q[4 * rank * HN : 4 * (rank + 1) * HN], k[2 * rank * HN : 2 * (rank + 1) * HN] + 1000,
                        v[2 * rank * HN : 2 * (rank + 1) * HN] + 2000, num_heads=4, num_groups=2, head_dim=HN)  # fmt: skip
        assert torch.equal(shard[name + "query_key_value.bias"], mine)
