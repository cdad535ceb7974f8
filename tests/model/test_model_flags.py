"""Megatron-DeepSpeed's model-shape flags: --rotary-percent, --apply-layernorm-1p, --no-position-embedding,
--normalization, and the async TP all-reduce (--no-async-tensor-model-parallel-allreduce).

Each against a hand-written reference, the flag checks of ``validate()``, the converters' refusals, and real
``pretrain`` runs at TP = 2: the flags train (the loss falls, the parameters are what they say), and the async
all-reduce gives exactly the losses and gradients of the synchronous one.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron.config import ModelConfig, parse_args, validate
from megatron.model import GPTModel
from megatron.model.norms import LayerNorm, RMSNorm, norm_class
from megatron.model.rotary import apply_rotary_pos_emb, rotary_cos_sin, rotary_dim
from megatron.mpu.context import ParallelContext
from megatron.testing import run_distributed

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "6",
    "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "linear",
    "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234",
    "--mock-data", "--vocab-size", "299", "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
    "--eval-iters", "0", "--log-interval", "1", "--log-level", "WARNING",
]  # fmt: skip


# --- rotary ---------------------------------------------------------------------------------------------------


def _rope_reference(x: torch.Tensor, pos: torch.Tensor, d: int, theta: float) -> torch.Tensor:
    """Pair (i, i + d/2) of the first ``d`` channels rotated by pos * theta^(-2i/d), element by element."""
    out = x.clone()
    s, b, heads, _ = x.shape
    for si in range(s):
        for bi in range(b):
            p = float(pos[bi, si])
            for h in range(heads):
                for i in range(d // 2):
                    a = p * theta ** (-2.0 * i / d)
                    x1, x2 = float(x[si, bi, h, i]), float(x[si, bi, h, i + d // 2])
                    out[si, bi, h, i] = x1 * math.cos(a) - x2 * math.sin(a)
                    out[si, bi, h, i + d // 2] = x2 * math.cos(a) + x1 * math.sin(a)
    return out


@pytest.mark.parametrize(("hn", "percent"), [(8, 1.0), (8, 0.5), (16, 0.25)])
def test_partial_rotary_matches_reference(hn: int, percent: float) -> None:
    d = rotary_dim(hn, percent)
    assert d == int(hn * percent)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 3, hn, generator=g, dtype=torch.float64)  # [s, b, np, hn]
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 3, 9, 0, 11]])
    cos, sin = rotary_cos_sin(pos, d, 500.0, torch.float64)
    assert cos.shape == (5, 2, 1, d)
    got = apply_rotary_pos_emb(x, cos, sin)
    torch.testing.assert_close(got, _rope_reference(x, pos, d, 500.0), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[..., d:], x[..., d:])  # the unrotated channels pass through untouched


def _model(**kw) -> GPTModel:
    base = {
        "num_layers": 1,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "seq_length": 8,
        "vocab_size": 50,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
    }
    return GPTModel(ModelConfig(**{**base, **kw}), ParallelContext(seed=1)).eval()


def test_rotary_percent_changes_only_what_it_should() -> None:
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8).expand(2, 8)
    rope = {"use_rotary_position_embeddings": True}
    full, half = _model(**rope), _model(**rope, rotary_percent=0.5)
    half.load_state_dict(full.state_dict())  # same parameters: only the rotation differs
    with torch.no_grad():
        a, b = full(ids, pos), half(ids, pos)
    assert not torch.allclose(a, b)
    # Position 0 is rotated by angle 0 in both: a one-token prompt gives the same logits.
    with torch.no_grad():
        torch.testing.assert_close(full(ids[:, :1], pos[:, :1]), half(ids[:, :1], pos[:, :1]))


# --- norms ------------------------------------------------------------------------------------------------------


def test_layernorm_1p_is_one_plus_weight() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 16, generator=g)
    for kind in ("layernorm", "rmsnorm"):
        norm = norm_class(kind)(16, eps=1e-5, apply_layernorm_1p=True)
        assert torch.equal(norm.weight, torch.zeros(16))  # init: gamma = 1 + 0
        with torch.no_grad():
            norm.weight.normal_(0.0, 0.1, generator=g)
        gamma = 1.0 + norm.weight.detach()
        if kind == "layernorm":
            assert isinstance(norm, LayerNorm)
            ref = F.layer_norm(x, (16,), gamma, norm.bias.detach(), 1e-5)
        else:
            assert isinstance(norm, RMSNorm)
            ref = gamma * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        torch.testing.assert_close(norm(x), ref, rtol=1e-6, atol=1e-6)
        # The stored weight gets the same gradient as gamma would.
        norm(x).sum().backward()
        assert norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0


def test_model_1p_equals_plain_model_with_shifted_weights() -> None:
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8).expand(2, 8)
    for kind in ("layernorm", "rmsnorm"):
        plain, onep = (
            _model(normalization=kind),
            _model(normalization=kind, apply_layernorm_1p=True),
        )
        state = plain.state_dict()
        for name, p in onep.named_parameters():
            if "norm" in name and name.endswith("weight"):
                assert torch.equal(p, torch.zeros_like(p)), name
        shifted = {
            k: (v - 1.0 if "norm" in k and k.endswith("weight") else v) for k, v in state.items()
        }
        onep.load_state_dict(shifted)
        with torch.no_grad():
            torch.testing.assert_close(onep(ids, pos), plain(ids, pos), rtol=1e-6, atol=1e-6)


def test_normalization_choices_match_megatron_deepspeed() -> None:
    assert parse_args(["--normalization", "rmsnorm"]).model.normalization == "rmsnorm"
    with pytest.raises(ValueError, match=r"--normalization: invalid choice: 'scalenorm'"):
        parse_args(["--normalization", "scalenorm"])


# --- position embeddings -----------------------------------------------------------------------------------------


def test_no_position_embedding() -> None:
    cfg = parse_args(["--no-position-embedding"]).model
    assert cfg.add_position_embedding is False
    model = _model(add_position_embedding=False)
    names = [n for n, _ in model.named_parameters()]
    assert not any("position_embeddings" in n for n in names)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8).expand(2, 8)
    with torch.no_grad():  # no position signal but the causal mask: the position ids change nothing
        torch.testing.assert_close(model(ids, pos), model(ids, pos + 5))
        learned = _model()
        assert not torch.allclose(learned(ids, pos), learned(ids, (pos + 1) % 8))
    # --seq-length may exceed --max-position-embeddings without a table (as with rotary).
    validate(
        parse_args(
            ["--no-position-embedding", "--seq-length", "64", "--max-position-embeddings", "16"]
        ),
        world_size=1,
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rotary-percent", "0.5"], "--rotary-percent (0.5) sets how much of each head"),
        (
            ["--rotary-percent", "0", "--use-rotary-position-embeddings"],
            "--rotary-percent (0.0) must be in (0, 1]",
        ),
        (["--rotary-percent", "1.5", "--use-rotary-position-embeddings"], "must be in (0, 1]"),
        (
            ["--rotary-percent", "0.3", "--use-rotary-position-embeddings"],
            "x head dim (8) rotates 2 channels",
        ),
        (
            ["--rotary-percent", "0.2", "--use-rotary-position-embeddings"],
            "rotates 1 channels; rotary needs an even number",
        ),
    ],
)
def test_validate_model_flags(flags: list[str], message: str) -> None:
    cfg = parse_args([*TINY, *flags])
    if "0.3" in flags:  # int(8 * 0.3) = 2: even, accepted
        validate(cfg, world_size=1)
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(cfg, world_size=1)


# --- async TP all-reduce ----------------------------------------------------------------------------------------


def _async_linear_worker() -> dict:
    from megatron.mpu import parallel_state
    from megatron.mpu.context import TPSettings
    from megatron.mpu.layers import ColumnParallelLinear, WeightInit

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for mode in (True, False):
        layer = ColumnParallelLinear(
            24,
            16,
            init=WeightInit(seed=7),
            tp=TPSettings(group=group, async_tensor_model_parallel_allreduce=mode),
        )
        x = torch.randn(6, 3, 24, generator=torch.Generator().manual_seed(3), requires_grad=True)
        y, _ = layer(x)
        (y * torch.arange(y.numel()).reshape(y.shape).sin()).sum().backward()
        out[mode] = (y.detach(), x.grad, layer.weight.grad, layer.bias.grad)
    return {"equal": [torch.equal(a, b) for a, b in zip(out[True], out[False], strict=True)]}


class _Probe:
    """Checkpoint hooks that save nothing: ``save`` (the final one, after training) looks at the engine's model."""

    seen: dict = {}

    def load(self, engine, scheduler, state) -> None:
        pass

    def restore_rng(self) -> None:
        pass

    def save(self, engine, scheduler, state) -> None:
        params = dict(engine.module.named_parameters())
        norms = [p for n, p in params.items() if "norm" in n and n.endswith("weight")]
        modes = {
            getattr(m, "async_tensor_model_parallel_allreduce", None)
            for m in engine.module.modules()
        }
        _Probe.seen = {
            "positions": any("position_embeddings" in n for n in params),
            "norm_weights": len(norms),
            "max_norm_weight": max(float(p.detach().abs().max()) for p in norms),
            "async": sorted(m for m in modes if m is not None),
        }


def _pretrain_worker(tmp: str) -> dict:
    from megatron.training import pretrain

    llama = ["--use-rotary-position-embeddings", "--rotary-percent", "0.5", "--normalization", "rmsnorm",
             "--apply-layernorm-1p", "--swiglu", "--disable-bias-linear"]  # fmt: skip
    gpt = ["--no-position-embedding", "--apply-layernorm-1p"]
    runs = {
        "llama_async": llama,
        "llama_sync": [*llama, "--no-async-tensor-model-parallel-allreduce"],
        "gpt_async": gpt,  # biases and LayerNorm: async == sync is the unit test's above
    }
    out = {}
    for name, flags in runs.items():
        save = ["--save", f"{tmp}/{name}", "--save-interval", "1000"]
        cfg = parse_args([*TINY, "--tensor-model-parallel-size", "2", *save, *flags])
        result = pretrain(cfg, checkpoint_hooks=_Probe())
        out[name] = {"losses": result.losses, **_Probe.seen}
    return out


def test_async_allreduce_equals_sync_and_flags_train(tmp_path: Path) -> None:
    assert all(run_distributed(_async_linear_worker, 2, timeout=120)[0]["equal"])
    r = run_distributed(_pretrain_worker, 2, str(tmp_path), timeout=400)[0]
    a, s = r["llama_async"], r["llama_sync"]
    assert a["async"] == [True] and s["async"] == [False]
    assert a["losses"] == s["losses"]  # exactly: the same sums, only overlapped
    for run in (a, r["gpt_async"]):
        assert len(run["losses"]) == 6 and run["losses"][-1] < run["losses"][0]
        # 1p: weights start at 0 and stay small (gamma = 1 + w), while a plain norm's would be near 1.
        assert 0.0 < run["max_norm_weight"] < 0.1
    assert r["llama_async"]["positions"] is False and r["gpt_async"]["positions"] is False
    assert (
        r["gpt_async"]["norm_weights"] == r["llama_async"]["norm_weights"] == 5
    )  # 2 per layer + final


# --- Hugging Face export ------------------------------------------------------------------------------------------


def test_hf_export_folds_1p_and_refuses_what_hf_cannot_hold() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron.conversion.hf_gpt2 import megatron_to_gpt2_hf
    from megatron.conversion.hf_llama import megatron_to_llama_hf

    model = _model(apply_layernorm_1p=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    sd, cfg = megatron_to_gpt2_hf(model.state_dict(), model.config, 50)
    hf = GPT2LMHeadModel(GPT2Config.from_dict(cfg)).eval()
    hf.load_state_dict(sd, strict=False)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, torch.arange(8).expand(2, 8))[..., :50]  # [b, s, v]
        torch.testing.assert_close(hf(ids).logits, ours, rtol=1e-4, atol=1e-4)
    nope = _model(add_position_embedding=False)
    with pytest.raises(
        ValueError, match=r"--no-position-embedding must be off \(GPT-2 has learned positions\)"
    ):
        megatron_to_gpt2_hf(nope.state_dict(), nope.config, 50)
    llama = {
        "normalization": "rmsnorm",
        "swiglu": True,
        "use_rotary_position_embeddings": True,
        "add_bias_linear": False,
    }
    partial = _model(**llama, rotary_percent=0.5)
    with pytest.raises(
        ValueError, match=r"--rotary-percent must be 1 \(HF LLaMA rotates every channel; got 0.5\)"
    ):
        megatron_to_llama_hf(partial.state_dict(), partial.config, 50)


def test_megatron_deepspeed_import_maps_the_flags(tmp_path: Path) -> None:
    from megatron.conversion.megatron_ds import mds_model_config

    base = {
        "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
        "max_position_embeddings": 16, "openai_gelu": True,
    }  # fmt: skip
    rope = {**base, "use_rotary_position_embeddings": True, "rotary_percent": 0.5}
    m = mds_model_config(
        {**rope, "normalization": "rmsnorm", "apply_layernorm_1p": True}, 50, tmp_path
    )
    assert (m.rotary_percent, m.add_position_embedding, m.apply_layernorm_1p) == (0.5, False, False)
    m = mds_model_config(
        {**base, "add_position_embedding": False, "apply_layernorm_1p": True}, 50, tmp_path
    )
    assert (m.rotary_percent, m.add_position_embedding, m.apply_layernorm_1p) == (1.0, False, True)


def test_checkpoint_position_table_compared_not_the_raw_flag() -> None:
    """With rotary there is no position table whatever --no-position-embedding says: an imported LLaMA-style
    checkpoint (saved with add_position_embedding False) resumes with the plain rotary flags; without rotary the
    flag is a real shape difference."""
    from megatron.checkpointing.meta import model_mismatches
    from megatron.config import ModelConfig

    base = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
    rope = dataclasses.replace(base, use_rotary_position_embeddings=True)
    saved = dataclasses.asdict(dataclasses.replace(rope, add_position_embedding=False))
    assert model_mismatches(saved, rope) == []
    saved = dataclasses.asdict(dataclasses.replace(base, add_position_embedding=False))
    assert model_mismatches(saved, base) == ["add_position_embedding: checkpoint False, flags True"]


def test_megatron_deepspeed_pipeline_final_norm_is_not_1p(tmp_path: Path) -> None:
    """Megatron-DeepSpeed's GPTModelPipe builds its final LayerNorm without apply_layernorm_1p (its layers' norms
    have it), so a pipeline-format checkpoint stores that scale plainly; the import stores it as scale - 1 like
    every other norm of a 1p model, and leaves the layers' norms as they are."""
    from megatron.conversion.megatron_ds import _ds_format_shard
    from megatron.layout.names import FINAL_NORM

    one_p = ModelConfig(
        num_layers=1, hidden_size=4, num_attention_heads=1, seq_length=8, apply_layernorm_1p=True
    )
    files = {
        1: {"word_embeddings.weight": torch.zeros(8, 4)},
        2: {"input_layernorm.weight": torch.full((4,), 0.25)},
        3: {"weight": torch.full((4,), 1.5), "bias": torch.zeros(4)},
    }
    for idx, sd in files.items():
        torch.save(sd, tmp_path / f"layer_{idx:02d}-model_00-model_states.pt")
    shard = _ds_format_shard(tmp_path, 0, one_p, 1, 1)
    assert torch.equal(shard[f"{FINAL_NORM}.weight"], torch.full((4,), 0.5))
    assert torch.equal(
        shard["language_model.encoder.layers.0.input_layernorm.weight"],
        files[2]["input_layernorm.weight"],
    )
    plain = _ds_format_shard(
        tmp_path, 0, dataclasses.replace(one_p, apply_layernorm_1p=False), 1, 1
    )
    assert torch.equal(plain[f"{FINAL_NORM}.weight"], torch.full((4,), 1.5))
