"""GPTModel under tensor parallelism (gloo, CPU): TP=2 and TP=4, sequence parallelism on and off, GPT-2- and
LLaMA-style (GQA) models, against the single-process (TP=1) model computed in the test process.

Checked per layout: gathered parameters equal the TP=1 parameters exactly (layout-invariant init), per-token loss,
every gathered parameter gradient, and the gathered logits (padded-vocab columns -inf; the padded vocabulary
differs between TP sizes)."""

from __future__ import annotations

import torch

from megatron.config import ModelConfig
from megatron.model import GPTModel, loss_func
from megatron.mpu.context import ParallelContext
from megatron.testing import run_distributed

V = 100
SEED = 11

CONFIGS = {
    # --make-vocab-size-divisible-by 64: padded 128 at TP=1/2, 256 at TP=4 (ranks 2 and 3 hold only padding)
    "gpt2": ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=V,
        make_vocab_size_divisible_by=64,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    ),
    # --make-vocab-size-divisible-by 8: padded 104 / 112 / 128 at TP=1 / 2 / 4
    "llama": ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=4,
        ffn_hidden_size=96,
        seq_length=16,
        vocab_size=V,
        make_vocab_size_divisible_by=8,
        normalization="rmsnorm",
        swiglu=True,
        use_rotary_position_embeddings=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    ),
}


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (2, 16), generator=g)
    pos = torch.arange(16).expand(2, 16).contiguous()
    mask = (torch.rand(2, 16, generator=g) > 0.2).float()
    return ids, pos, mask


def _run(model: GPTModel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, pos, mask = _batch()
    per_token = model(ids, pos, labels=ids)
    loss_func(per_token, mask).backward()
    with torch.no_grad():
        logits = model(ids, pos)
    return per_token.detach(), logits, mask


def _tp_worker(tp_sizes: list[int]) -> dict | None:
    from megatron.mpu import parallel_state
    from megatron.mpu.layers import copy_tensor_model_parallel_attributes, gather_full_parameter
    from megatron.mpu.mappings import gather_from_tensor_model_parallel_region

    out: dict = {}
    for tp in tp_sizes:
        parallel_state.initialize_model_parallel(tp, 1)
        for key, cfg in CONFIGS.items():
            for sp in (False, True):
                parallel = ParallelContext.from_parallel_state(seed=SEED, sequence_parallel=sp)
                model = GPTModel(cfg, parallel)
                per_token, logits, _ = _run(model)
                params, grads = {}, {}
                for name, p in model.named_parameters():
                    params[name] = gather_full_parameter(p)
                    g = p.grad.detach().clone()
                    copy_tensor_model_parallel_attributes(g, p)
                    grads[name] = gather_full_parameter(g)
                with torch.no_grad():
                    full_logits = gather_from_tensor_model_parallel_region(logits)
                out[(tp, key, sp)] = {
                    "per_token": per_token,
                    "logits": full_logits,
                    "params": params,
                    "grads": grads,
                    "padded": model.padded_vocab_size,
                }
        parallel_state.destroy_model_parallel()
    # A model built for another grid: TP = 1 on a group of this rank alone, inside a TP = 4 job. It must use the
    # group it is given, not the job's TP group (ParallelContext), and a context without a group is refused here.
    world = torch.distributed.get_world_size()
    solo_group = [torch.distributed.new_group([r]) for r in range(world)][
        torch.distributed.get_rank()
    ]
    parallel_state.initialize_model_parallel(tp_sizes[-1], 1)
    try:
        ParallelContext(seed=SEED)
        refused = ""
    except ValueError as err:
        refused = str(err)
    solo = {}
    for key, cfg in CONFIGS.items():
        per_token, logits, _ = _run(GPTModel(cfg, ParallelContext(seed=SEED, tp_group=solo_group)))
        solo[key] = {"per_token": per_token, "logits": logits}
    parallel_state.destroy_model_parallel()
    result = {"layouts": out, "solo": solo, "refused": refused}
    return _to_numpy(result) if torch.distributed.get_rank() == 0 else None


def _to_numpy(tree):
    # torch.multiprocessing shares tensors through file descriptors that die with the rank: send numpy copies
    if isinstance(tree, dict):
        return {k: _to_numpy(v) for k, v in tree.items()}
    return tree.numpy() if torch.is_tensor(tree) else tree


def _to_torch(tree):
    if isinstance(tree, dict):
        return {k: _to_torch(v) for k, v in tree.items()}
    return torch.from_numpy(tree) if hasattr(tree, "dtype") and not torch.is_tensor(tree) else tree


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def test_tensor_parallel_matches_single_process() -> None:
    everything = _to_torch(run_distributed(_tp_worker, 4, [2, 4], timeout=240)[0])
    results = everything["layouts"]
    refs = {}
    for key, cfg in CONFIGS.items():
        model = GPTModel(cfg, ParallelContext(seed=SEED))
        per_token, logits, _ = _run(model)
        refs[key] = (model, per_token, logits)
    worst = {"loss": 0.0, "grad": 0.0, "logits": 0.0}
    for (tp, key, sp), res in results.items():
        where = f"tp={tp} {key} sp={sp}"
        model, per_token, logits = refs[key]
        padded = res["padded"]
        assert padded == {"gpt2": {2: 128, 4: 256}, "llama": {2: 112, 4: 128}}[key][tp], where
        for name, p in model.named_parameters():
            got, want = res["params"][name], p.detach()
            if name.endswith(("word_embeddings.weight", "output_layer.weight")):
                assert got.shape == (padded, 64), where
                assert not got[V:].any(), f"{where}: {name} padding rows not zero"
                got, want = got[:V], want[:V]
            # layout-invariant init: the TP shards are exact slices of the TP=1 weights
            assert torch.equal(got, want), f"{where}: {name} init differs"
            g_got, g_want = res["grads"][name], p.grad
            if g_got.shape[0] == padded and name.endswith("weight") and "embeddings" in name:
                assert not g_got[V:].any(), f"{where}: padding rows got gradient"
                g_got, g_want = g_got[:V], g_want[:V]
            if name.endswith("output_layer.weight"):
                g_got, g_want = g_got[:V], g_want[:V]
            err = _rel_err(g_got, g_want)
            worst["grad"] = max(worst["grad"], err)
            # fp32 sums reordered across TP shards: ~1e-7 relative; 1e-6 leaves margin
            assert err <= 1e-6, f"{where}: grad of {name} rel err {err:.2e}"
        err = _rel_err(res["per_token"], per_token)
        worst["loss"] = max(worst["loss"], err)
        assert err <= 1e-6, f"{where}: per-token loss rel err {err:.2e}"
        got_logits = res["logits"]
        assert got_logits.shape == (2, 16, padded)
        assert torch.isneginf(got_logits[..., V:]).all(), where
        err = _rel_err(got_logits[..., :V], logits[..., :V])
        worst["logits"] = max(worst["logits"], err)
        assert err <= 1e-6, f"{where}: logits rel err {err:.2e}"
    assert len(results) == 8
    for key, (
        _,
        per_token,
        logits,
    ) in refs.items():  # the TP = 1 model on its one-rank group: the TP = 1 model
        assert torch.equal(everything["solo"][key]["per_token"], per_token), key
        assert torch.equal(everything["solo"][key]["logits"], logits), key
    assert "name the tensor-parallel group" in everything["refused"]
    print(f"TP parity worst relative errors: {worst}")
