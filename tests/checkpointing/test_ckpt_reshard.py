"""TP shard/merge round trips, the meaning of each shard, vocab re-padding, and DeepSpeed's PP layer split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ckpt_models import VOCAB, make_gpt2, make_llama

from megatron.conversion.hf_gpt2 import gpt2_hf_to_megatron
from megatron.conversion.hf_llama import llama_hf_to_megatron
from megatron.layout.pipeline import split_layers_for_pp
from megatron.layout.tensor_parallel import merge_tp_shards, shard_state_dict, tp_partition
from megatron.layout.vocab import pad_vocab_for_tp

L0 = "language_model.encoder.layers.0."
EMB = "language_model.embedding.word_embeddings.weight"


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _round_trips(full: dict[str, torch.Tensor], cfg, tps: tuple[int, ...]) -> None:
    for tp in tps:
        padded = pad_vocab_for_tp(full, cfg, tp)
        assert padded[EMB].shape[0] == 128 * tp  # Megatron pads to 128 * tp
        shards = [shard_state_dict(padded, cfg, tp, r) for r in range(tp)]
        for key, t in padded.items():
            part = tp_partition(key, cfg)
            if part is not None:
                assert shards[0][key].shape[part[0]] * tp == t.shape[part[0]], key
            for shard in shards:  # fresh storage: saving a shard never writes the full tensor
                assert shard[key].untyped_storage().nbytes() == shard[key].nbytes
        merged = merge_tp_shards(shards, cfg)
        _assert_same(merged, padded)
        _assert_same(pad_vocab_for_tp(merged, cfg, 1), full)


def test_gpt2_tp_round_trip() -> None:
    model = make_gpt2()
    full, cfg = gpt2_hf_to_megatron(model.state_dict(), model.config)
    _round_trips(full, cfg, (1, 2, 4))


def test_llama_tp_round_trip_and_gqa_limit() -> None:
    model = make_llama(heads=8, kv_heads=4, hidden=64, tied=False)
    full, cfg = llama_hf_to_megatron(model.state_dict(), model.config)
    _round_trips(full, cfg, (1, 2, 4))

    model = make_llama(heads=4, kv_heads=2)
    full, cfg = llama_hf_to_megatron(model.state_dict(), model.config)
    _round_trips(full, cfg, (1, 2))
    with pytest.raises(
        ValueError, match=r"--num-key-value-heads \(2\) must be divisible by .*\(4\)"
    ):
        shard_state_dict(pad_vocab_for_tp(full, cfg, 4), cfg, 4, 0)


def test_shards_mean_what_megatron_layers_compute() -> None:
    """Each TP shard, used the way the TP layers use it, reproduces the full computation."""
    model = make_llama(heads=8, kv_heads=4, hidden=64)
    sd = model.state_dict()
    full, cfg = llama_hf_to_megatron(sd, model.config)
    tp, hn, r_q = 2, 8, 2  # 4 groups of 2 query heads, 2 groups per rank
    shards = [shard_state_dict(pad_vocab_for_tp(full, cfg, tp), cfg, tp, r) for r in range(tp)]

    # QKV: rank r holds K/V groups [2r, 2r+2) with their query heads, in [q | k | v] per group.
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    k = sd["model.layers.0.self_attn.k_proj.weight"]
    for rank, shard in enumerate(shards):
        local = shard[L0 + "self_attention.query_key_value.weight"].view(2, r_q + 2, hn, 64)
        for j in range(2):
            g = 2 * rank + j
            assert torch.equal(local[j, :r_q].reshape(-1, 64), q[g * r_q * hn : (g + 1) * r_q * hn])
            assert torch.equal(local[j, r_q], k[g * hn : (g + 1) * hn])

    # SwiGLU MLP: sum over ranks of [silu(gate_r) * up_r] @ down_r^T == the full MLP (stride-2 layout).
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    gate = sd["model.layers.0.mlp.gate_proj.weight"]
    up = sd["model.layers.0.mlp.up_proj.weight"]
    down = sd["model.layers.0.mlp.down_proj.weight"]
    ref = (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()
    out = torch.zeros_like(ref)
    for shard in shards:
        a, b = (x @ shard[L0 + "mlp.dense_h_to_4h.weight"].t()).chunk(2, dim=-1)
        out += (F.silu(a) * b) @ shard[L0 + "mlp.dense_4h_to_h.weight"].t()
    # fp32 and the sum over ranks reorders the reduction over ffn: ~1e-6 of values up to ~10 (init std 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    # Vocab: rank r holds rows [r*vp, (r+1)*vp) of the padded (256-row) embedding.
    assert torch.equal(shards[0][EMB][:VOCAB], sd["model.embed_tokens.weight"])
    assert not shards[1][EMB].any()  # rows 128..255 are all padding


def test_reshard_errors() -> None:
    model = make_gpt2()
    full, cfg = gpt2_hf_to_megatron(model.state_dict(), model.config)
    unpadded, _ = gpt2_hf_to_megatron(model.state_dict(), model.config, padded_vocab=VOCAB)
    with pytest.raises(
        ValueError, match=r"padded vocab rows \(101\) is not divisible by 2 .*repad_vocab"
    ):
        shard_state_dict(unpadded, cfg, 2, 0)
    with pytest.raises(
        ValueError, match=r"--num-attention-heads \(4\) must be divisible by .*\(8\)"
    ):
        shard_state_dict(full, cfg, 8, 0)
    with pytest.raises(ValueError, match=r"tp_rank \(2\) must be in \[0, 2\)"):
        shard_state_dict(full, cfg, 2, 2)
    with pytest.raises(ValueError, match="don't know how 'foo.weight'"):
        shard_state_dict({**full, "foo.weight": torch.zeros(2)}, cfg, 1, 0)
    shards = [shard_state_dict(full, cfg, 2, r) for r in range(2)]
    shards[1][L0 + "input_layernorm.weight"] += 1.0
    with pytest.raises(ValueError, match="differs between TP rank 0 and rank 1"):
        merge_tp_shards(shards, cfg)
    merged = merge_tp_shards(shards, cfg, check_replicated=False)
    assert torch.equal(merged[L0 + "input_layernorm.weight"], full[L0 + "input_layernorm.weight"])
    del shards[1][EMB]
    with pytest.raises(ValueError, match="TP shard 1 has different keys"):
        merge_tp_shards(shards, cfg)
    with pytest.raises(ValueError, match="vocab_size is not set"):
        pad_vocab_for_tp(full, type(cfg)(), 2)


def test_pp_split_matches_deepspeed_type_transformer() -> None:
    from deepspeed.runtime.utils import partition_balanced

    assert split_layers_for_pp(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    for num_layers in range(1, 25):
        for pp in range(1, min(num_layers, 8) + 1):
            ours = split_layers_for_pp(num_layers, pp)
            # GPTModelPipe's specs: 2 before the layers (input check, embedding), 3 after (norm, head, cast).
            for lead, trail in ((2, 3), (1, 1), (2, 2)):
                weights = [0] * lead + [1] * num_layers + [0] * trail
                parts = partition_balanced(weights, pp)
                counts = [sum(weights[parts[i] : parts[i + 1]]) for i in range(pp)]
                assert [stop - start for start, stop in ours] == counts, (num_layers, pp, lead)
    with pytest.raises(
        ValueError, match=r"--num-layers \(2\) must be >= --pipeline-model-parallel-size \(4\)"
    ):
        split_layers_for_pp(2, 4)


def test_pipe_layer_files_match_gpt_model_pipe_names() -> None:
    from megatron.layout.names import pipe_layer_file_name, pipe_layer_key, pipe_to_megatron_name
    from megatron.layout.pipeline import megatron_to_pipe_layers, pipe_layers_to_megatron

    for model, convert in (
        (make_gpt2(), gpt2_hf_to_megatron),
        (make_llama(), llama_hf_to_megatron),
    ):
        full, cfg = convert(model.state_dict(), model.config)
        layers = megatron_to_pipe_layers(full, cfg.num_layers)
        expected = {1, 2, 3, 4} | ({5} if cfg.untie_embeddings_and_output_weights else set())
        assert set(layers) == expected
        for idx, sd in layers.items():
            for local, t in sd.items():
                # the model's own GPTModelPipe -> Megatron name mapping agrees with ours
                mg = pipe_to_megatron_name(f"{idx}.{local}", cfg.num_layers)
                assert full[mg] is t
        _assert_same(pipe_layers_to_megatron(layers, cfg.num_layers), full)
    assert pipe_layer_file_name(3, 1) == "layer_03-model_01-model_states.pt"
    with pytest.raises(ValueError, match="not a parameter of a 2-layer GPT model"):
        pipe_layer_key("language_model.encoder.layers.2.input_layernorm.weight", 2)


def test_padded_vocab_size_is_megatrons_rule() -> None:
    from megatron.config.rules import padded_vocab_size
    from megatron.config.rules import padded_vocab_size as model_padded_vocab_size

    assert [padded_vocab_size(50257, 128, tp) for tp in (1, 2, 4)] == [50304, 50432, 50688]
    for vocab in (1, 101, 128, 129, 32000, 50257):
        for tp in (1, 2, 4, 8):
            assert padded_vocab_size(vocab, 128, tp) == model_padded_vocab_size(vocab, 128, tp)
