"""LoRA adapters on the TP linears (``megatron/model/lora.py``, ``megatron/mpu/lora.py``) and their flags.

Single process: no key and no change with --lora-rank 0; a fresh adapter (B = 0) leaves the output unchanged; with
B != 0 the model equals the base model with merged weights ``W + alpha/r B A`` (the full layout loraexport writes);
the TP name patterns agree with the adapters' TP attributes; the base freezes. TP = 2 (gloo, one spawn): the
gathered adapters equal the TP = 1 ones (layout-invariant init), and the loss and every gathered adapter gradient
match TP = 1, with and without sequence parallelism, for a GPT-2- and a LLaMA-style (SwiGLU, GQA) model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.config import ModelConfig, parse_args, validate
from megatron.config.lora import LoraConfig
from megatron.model import GPTModel, loss_func
from megatron.model.lora import freeze_base, is_lora_parameter
from megatron.mpu.context import ParallelContext
from megatron.mpu.random import model_parallel_cuda_manual_seed, param_seed
from megatron.testing import run_distributed

V, SEED = 100, 11
LORA = LoraConfig(lora_rank=4, lora_alpha=8.0)
GPT2 = ModelConfig(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=V,
    make_vocab_size_divisible_by=64,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    lora=LORA,
)
LLAMA = dataclasses.replace(
    GPT2,
    num_attention_heads=8,
    num_key_value_heads=4,
    ffn_hidden_size=96,
    normalization="rmsnorm",
    swiglu=True,
    use_rotary_position_embeddings=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)
CONFIGS = {"gpt2": GPT2, "llama": LLAMA}


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (2, 16), generator=g)
    pos = torch.arange(16).expand(2, 16).contiguous()
    mask = (torch.rand(2, 16, generator=g) > 0.2).float()
    return ids, pos, mask


def _full_b(name: str, shape: tuple[int, int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(param_seed(3, name))
    return torch.randn(shape, generator=g) * 0.05


def _set_b(model: torch.nn.Module, tp_rank: int = 0, tp: int = 1) -> None:
    """Give every lora_b a nonzero value, the same full value on every layout (sharded like the parameter)."""
    from megatron.mpu.layers import shard_master_weight

    for name, p in model.named_parameters():
        if not name.endswith("lora_b"):
            continue
        split = getattr(p, "tensor_model_parallel", False)
        full_shape = (p.shape[0] * (tp if split else 1), p.shape[1])
        full = _full_b(name, full_shape)
        if split:
            full = shard_master_weight(full, 0, p.partition_stride, tp_rank, tp)
        with torch.no_grad():
            p.copy_(full)


def _attr_layout(p: torch.Tensor) -> tuple[bool, int, int]:
    if not getattr(p, "tensor_model_parallel", False):
        return (False, -1, 1)
    return (True, p.partition_dim, p.partition_stride)


def test_lora_single_process_contract() -> None:
    from megatron.layout.tensor_parallel import param_layout

    ids, pos, _ = _batch()
    for key, cfg in CONFIGS.items():
        base_cfg = dataclasses.replace(cfg, lora=LoraConfig())
        base = GPTModel(base_cfg, ParallelContext(seed=SEED)).eval()
        model = GPTModel(cfg, ParallelContext(seed=SEED)).eval()
        keys, base_keys = set(model.state_dict()), set(base.state_dict())
        lora_keys = {k for k in keys if is_lora_parameter(k)}
        assert keys - lora_keys == base_keys, key  # rank 0: not one key more
        assert len(lora_keys) == 2 * 4 * cfg.num_layers, key
        sd = model.state_dict()
        assert sd[
            "language_model.encoder.layers.0.self_attention.query_key_value.lora_a"
        ].shape == (4, 64)
        ffn_out = 2 * 96 if cfg.swiglu else 256
        assert sd["language_model.encoder.layers.1.mlp.dense_h_to_4h.lora_b"].shape == (ffn_out, 4)
        assert sd["language_model.encoder.layers.1.mlp.dense_4h_to_h.lora_a"].shape == (
            4,
            ffn_out // (2 if cfg.swiglu else 1),
        )
        for name, p in model.named_parameters():
            assert param_layout(name, cfg) == _attr_layout(p), name
        with torch.no_grad():
            # the same base weights, B = 0: the output is the base model's, bit for bit
            assert torch.equal(model(ids, pos), base(ids, pos)), key
            _set_b(model)
            merged = {k: v.clone() for k, v in base.state_dict().items()}
            for name in lora_keys:
                if name.endswith("lora_a"):
                    linear = name[: -len(".lora_a")]
                    delta = (
                        LORA.scaling * sd[f"{linear}.lora_b"] @ sd[name]
                    )  # [o, r] @ [r, h] -> [o, h]
                    merged[f"{linear}.weight"] += delta
            base.load_state_dict(merged)
            err = (model(ids, pos) - base(ids, pos))[..., :V].abs().max().item()
            assert err < 1e-5, f"{key}: merged-weight model differs by {err}"
        trainable, frozen = freeze_base(model)
        assert trainable == sum(
            p.numel() for n, p in model.named_parameters() if is_lora_parameter(n)
        )
        assert {n for n, p in model.named_parameters() if p.requires_grad} == lora_keys
        assert frozen > trainable > 0
    with pytest.raises(ValueError, match="no LoRA adapter"):
        freeze_base(
            GPTModel(dataclasses.replace(GPT2, lora=LoraConfig()), ParallelContext(seed=SEED))
        )
    # dropout acts on the adapter input in training only
    model_parallel_cuda_manual_seed(SEED, device_type="cpu")
    drop = GPTModel(
        dataclasses.replace(GPT2, lora=dataclasses.replace(LORA, lora_dropout=0.5)),
        ParallelContext(seed=SEED),
    )
    _set_b(drop)
    plain = GPTModel(GPT2, ParallelContext(seed=SEED))
    _set_b(plain)
    with torch.no_grad():
        assert torch.equal(drop.eval()(ids, pos), plain.eval()(ids, pos))
        assert not torch.equal(drop.train()(ids, pos), plain.train()(ids, pos))


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (
            ["--lora-target-modules", "qkv", "proj"],
            r"unknown name\(s\) \['proj'\]; valid: qkv dense fc1 fc2",
        ),
        (["--lora-target-modules"], "is empty"),
        (["--lora-target-modules", "qkv", "qkv"], "names a module twice"),
        (
            ["--num-experts", "2", "--expert-interval", "1", "--create-moe-param-group"],
            "MoE experts",
        ),
        (["--zero-stage", "3"], "zero-stage 3"),
        (["--lora-dropout", "1.0"], r"--lora-dropout \(1.0\) must be in \[0, 1\)"),
        (["--lora-alpha", "0"], r"--lora-alpha \(0.0\) must be > 0"),
        (["--universal-checkpoint"], "drop --universal-checkpoint"),
    ],
)
def test_lora_flags_refused(flags: list[str], match: str) -> None:
    args = [
        "--micro-batch-size",
        "1",
        "--lora-rank",
        "4",
        "--pretrained-checkpoint",
        "base",
        *flags,
    ]
    with pytest.raises(ValueError, match=match):
        validate(parse_args(args), world_size=1)


def test_lora_flags_accepted() -> None:
    cfg = parse_args(
        ["--micro-batch-size", "1", "--lora-rank", "8", "--lora-target-modules", "qkv", "fc2"]
        + ["--pretrained-checkpoint", "base"]
    )
    validate(cfg, world_size=1)
    lora = cfg.model.lora
    assert (lora.lora_rank, lora.lora_alpha, lora.scaling, lora.lora_target_modules) == (
        8,
        32.0,
        4.0,
        ("qkv", "fc2"),
    )
    assert lora.targets("fc2") and not lora.targets("fc1")
    # the meta form (dataclasses.asdict, JSON lists) is a LoraConfig again
    again = ModelConfig(**json_round_trip(dataclasses.asdict(cfg.model)))
    assert again.lora == lora
    with pytest.raises(ValueError, match=r"--lora-rank \(-1\) must be >= 0"):
        validate(parse_args(["--micro-batch-size", "1", "--lora-rank", "-1"]), world_size=1)


def json_round_trip(d: dict) -> dict:
    import json

    return json.loads(json.dumps(d))


def _tp_worker(keys: list[str]) -> dict | None:
    from megatron.mpu import parallel_state
    from megatron.mpu.layers import copy_tensor_model_parallel_attributes, gather_full_parameter

    tp_rank = torch.distributed.get_rank()
    parallel_state.initialize_model_parallel(2, 1)
    out: dict = {}
    for key, cfg in CONFIGS.items():
        for sp in (False, True):
            model = GPTModel(
                cfg, ParallelContext.from_parallel_state(seed=SEED, sequence_parallel=sp)
            )
            init = {
                n: gather_full_parameter(p)
                for n, p in model.named_parameters()
                if is_lora_parameter(n)
            }
            _set_b(model, tp_rank, 2)
            freeze_base(model)
            ids, pos, mask = _batch()
            per_token = model(ids, pos, labels=ids)
            loss_func(per_token, mask).backward()
            grads = {}
            for name, p in model.named_parameters():
                assert (p.grad is not None) == is_lora_parameter(name), name
                if p.grad is not None:
                    g = p.grad.detach().clone()
                    copy_tensor_model_parallel_attributes(g, p)
                    grads[name] = gather_full_parameter(g).numpy()
            out[(key, sp)] = {
                "init": {n: t.numpy() for n, t in init.items()},
                "per_token": per_token.detach().numpy(),
                "grads": grads,
            }
    parallel_state.destroy_model_parallel()
    return out if tp_rank == 0 else None


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize(
    "key", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)]
)  # LLaMA: SwiGLU (stride 2), GQA, no biases; GPT-2: biases, GeLU
def test_lora_tensor_parallel_matches_single_process(key: str) -> None:
    results = run_distributed(_tp_worker, 2, [key], timeout=180)[0]
    ids, pos, mask = _batch()
    model = GPTModel(CONFIGS[key], ParallelContext(seed=SEED))
    init = {n: p.detach().clone() for n, p in model.named_parameters() if is_lora_parameter(n)}
    _set_b(model)
    freeze_base(model)
    per_token = model(ids, pos, labels=ids)
    loss_func(per_token, mask).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for sp in (False, True):
        res, where = results[(key, sp)], f"{key} sp={sp}"
        for (
            name,
            want,
        ) in init.items():  # layout-invariant init: the TP shards are slices of TP = 1's
            assert torch.equal(torch.from_numpy(res["init"][name]), want), f"{where}: {name}"
        # fp32 sums reordered across TP shards: ~1e-7 relative; 1e-6 leaves margin
        assert _rel_err(torch.from_numpy(res["per_token"]), per_token.detach()) <= 1e-6, where
        assert set(res["grads"]) == set(grads) == set(init), where
        for name, want in grads.items():
            err = _rel_err(torch.from_numpy(res["grads"][name]), want)
            assert err <= 1e-6, f"{where}: grad of {name} rel err {err:.2e}"
