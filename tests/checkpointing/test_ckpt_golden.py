"""Golden: HF models converted by megatron.checkpointing run in our GPTModel with the same logits and decodes.

Single process at TP=1 (both directions: HF -> Megatron and Megatron -> HF), and one 2-rank run at TP=2 that
loads ``shard_state_dict`` shards into the tensor-parallel model, plus a check that the shards of a TP=2 model's
own (layout-invariant) init merge into the TP=1 model's weights, so our shard rules are the mpu layers' layout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_models import VOCAB, make_gpt2, make_llama
from safetensors.torch import save_file

from megatron.checkpointing.safe_load import load_state_dict_file
from megatron.conversion.hf_gpt2 import gpt2_hf_to_megatron, megatron_to_gpt2_hf
from megatron.conversion.hf_llama import llama_hf_to_megatron, megatron_to_llama_hf
from megatron.conversion.verify import compare_logits
from megatron.layout.tensor_parallel import merge_tp_shards, shard_state_dict
from megatron.layout.vocab import pad_vocab_for_tp
from megatron.model import GPTModel
from megatron.mpu.context import ParallelContext
from megatron.testing import run_distributed

PROMPTS = [[1, 2, 3, 4], [50, 7, 99, 13, 0, 42, 8], [77]]
STEPS = 32  # prompt + 32 <= 64 positions
TOL = 1e-5  # fp32; both sides do the same math in a different order (fused QKV, SDPA vs eager)


def _hf_fn(model):
    return lambda tokens: model(input_ids=tokens).logits  # [1, s] -> [1, s, V]


def _ours_fn(model: GPTModel):
    def fn(tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1]).unsqueeze(0)  # [1, s]
        return model(tokens, pos)  # [1, s, v] (padded columns -inf, ignored by compare_logits)

    return fn


def _check_import(hf_model, convert) -> float:
    full, cfg = convert(hf_model.state_dict(), hf_model.config)
    ours = GPTModel(cfg, ParallelContext(seed=11)).eval()
    result = ours.load_state_dict(pad_vocab_for_tp(full, cfg, 1), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    cmp = compare_logits(_hf_fn(hf_model), _ours_fn(ours), PROMPTS, steps=STEPS, vocab_size=VOCAB)
    assert cmp.max_abs_dlogit <= TOL, cmp
    assert cmp.greedy_agreement == 1.0, cmp
    return cmp.max_abs_dlogit


def _check_export(hf_model, convert, export) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    _, cfg = convert(hf_model.state_dict(), hf_model.config)
    ours = GPTModel(cfg, ParallelContext(seed=23)).eval()  # our own init, never seen by HF
    with torch.no_grad():  # perturb norms/biases (init 1/0) so their mapping matters
        g = torch.Generator().manual_seed(3)
        for p in ours.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    hf_sd, hf_cfg = export(ours.state_dict(), cfg, VOCAB)
    hf_config = AutoConfig.for_model(**hf_cfg)
    rebuilt = AutoModelForCausalLM.from_config(hf_config).eval()
    result = rebuilt.load_state_dict(hf_sd, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    cmp = compare_logits(_ours_fn(ours), _hf_fn(rebuilt), PROMPTS, steps=STEPS, vocab_size=VOCAB)
    assert cmp.max_abs_dlogit <= TOL, cmp
    assert cmp.greedy_agreement == 1.0, cmp
    return cmp.max_abs_dlogit


@torch.no_grad()
def test_gpt2_golden_against_hugging_face() -> None:
    hf = make_gpt2()
    _check_import(hf, gpt2_hf_to_megatron)
    _check_export(hf, gpt2_hf_to_megatron, megatron_to_gpt2_hf)

    # The test can fail: our GeLU is the tanh form, so an HF model with erf "gelu" is visibly off (~1e-3).
    erf = make_gpt2(activation="gelu")
    full, cfg = gpt2_hf_to_megatron(erf.state_dict(), erf.config)
    ours = GPTModel(cfg, ParallelContext(seed=11)).eval()
    ours.load_state_dict(full, strict=True)
    cmp = compare_logits(_hf_fn(erf), _ours_fn(ours), PROMPTS, steps=4, vocab_size=VOCAB)
    assert cmp.max_abs_dlogit > 100 * TOL, cmp


@torch.no_grad()
def test_llama_gqa_golden_against_hugging_face() -> None:
    hf = make_llama(heads=4, kv_heads=2)
    _check_import(hf, llama_hf_to_megatron)
    _check_export(hf, llama_hf_to_megatron, megatron_to_llama_hf)


def _tp_worker(cases: dict) -> dict:
    from megatron.mpu import parallel_state
    from megatron.mpu.mappings import gather_from_tensor_model_parallel_region

    parallel_state.initialize_model_parallel(2, 1)
    rank = parallel_state.get_tensor_model_parallel_rank()
    out = {}
    for name, (path, cfg, token_list) in cases.items():
        full = load_state_dict_file(path)
        model = GPTModel(cfg, ParallelContext.from_parallel_state(seed=11)).eval()
        model.load_state_dict(shard_state_dict(full, cfg, 2, rank), strict=True)
        tokens = torch.tensor(token_list)
        with torch.no_grad():
            logits = model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0))  # [1, s, vp]
            logits = gather_from_tensor_model_parallel_region(logits)  # [1, s, v]
        init = GPTModel(
            cfg, ParallelContext.from_parallel_state(seed=5)
        )  # the model's own TP=2 init, to be merged in the parent
        out[name] = {
            "logits": logits.numpy(),
            "init": {k: v.detach().numpy() for k, v in init.state_dict().items()},
        }
    parallel_state.destroy_model_parallel()
    return out


def test_tp2_shards_load_into_tensor_parallel_model(tmp_path: Path) -> None:
    tokens = torch.tensor([[5, 17, 3, 99, 42, 0, 64, 8, 23]])
    cases, refs = {}, {}
    for name, hf, convert in (
        ("gpt2", make_gpt2(), gpt2_hf_to_megatron),
        ("llama", make_llama(heads=4, kv_heads=2), llama_hf_to_megatron),
    ):
        full, cfg = convert(hf.state_dict(), hf.config)
        # weights travel through a file: spawn arguments must stay small (a rank that fails to start
        # while the parent still writes > 64 KiB of arguments hangs multiprocessing's spawn forever)
        path = tmp_path / f"{name}.safetensors"
        save_file(pad_vocab_for_tp(full, cfg, 2), path)
        cases[name] = (str(path), cfg, tokens.tolist())
        with torch.no_grad():
            refs[name] = (hf(input_ids=tokens).logits, cfg)
    results = run_distributed(_tp_worker, 2, cases, timeout=180)
    for name, (ref, cfg) in refs.items():
        logits = torch.from_numpy(results[0][name]["logits"])
        assert np.array_equal(results[0][name]["logits"], results[1][name]["logits"])
        torch.testing.assert_close(logits[..., :VOCAB], ref, rtol=0, atol=TOL)
        # Shards of the TP=2 model's own init merge into the TP=1 model's init (layout-invariant init).
        shards = [
            {k: torch.from_numpy(v) for k, v in results[r][name]["init"].items()} for r in range(2)
        ]
        merged = pad_vocab_for_tp(merge_tp_shards(shards, cfg), cfg, 1)
        single = GPTModel(cfg, ParallelContext(seed=5)).state_dict()
        assert sorted(merged) == sorted(single)
        for k, v in single.items():
            assert torch.equal(merged[k], v), (name, k)


def test_compare_logits_reports_divergence() -> None:
    """Toy models: B equals A except that it prefers token 3 once the sequence is 6 tokens long."""
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0))

    def model_a(tokens: torch.Tensor) -> torch.Tensor:
        return table[tokens]  # [1, s] -> [1, s, V]

    def model_b(tokens: torch.Tensor) -> torch.Tensor:
        out = table[tokens].clone()
        if tokens.shape[1] >= 6:
            out[0, -1, 3] += 100.0
        return torch.cat([out, torch.full((*out.shape[:2], 27), -1e9)], dim=-1)  # padded columns

    same = compare_logits(model_a, model_a, [[1, 2]], steps=8)
    assert same == (0.0, 1.0)
    diff = compare_logits(model_a, model_b, [[1, 2]], steps=8)
    assert diff.greedy_agreement == 4 / 8  # tokens 3..6 agree; the 5th generated token differs
    assert diff.max_abs_dlogit == pytest.approx(100.0)
    with pytest.raises(ValueError, match="exceeds a model's logit width"):
        compare_logits(model_a, model_b, [[1]], steps=1, vocab_size=VOCAB + 1)
