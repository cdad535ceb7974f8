"""GPTModelPipe under a real DeepSpeed PipelineEngine (gloo, CPU, ZeRO-1, torch SGD) against single-process
GPTModel: initial weights (exact, through pipe_to_megatron_name), the train_batch loss over 2 micro-batches, and
every parameter's gradient (recovered from one SGD step: grad = (before - after) / lr), including the tied word
embeddings that live on the first and the last stage."""

from __future__ import annotations

import importlib

import pytest
import torch

from megatron.config import ModelConfig
from megatron.layout.tensor_parallel import param_layout
from megatron.model import GPTModel, loss_func
from megatron.mpu.context import ParallelContext
from megatron.testing import run_distributed

V = 100
SEED = 21
LR = 1000.0  # large, so (w - w') / lr recovers the gradient to ~1e-7 relative in fp32
MBS, GAS, S = 2, 2, 16

GPT2 = ModelConfig(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=S,
    vocab_size=V,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)
LLAMA = ModelConfig(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=8,
    num_key_value_heads=2,
    ffn_hidden_size=96,
    seq_length=S,
    vocab_size=V,
    make_vocab_size_divisible_by=8,
    normalization="rmsnorm",
    swiglu=True,
    use_rotary_position_embeddings=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


def _micro_batches() -> list[
    tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
]:
    g = torch.Generator().manual_seed(9)
    out = []
    for _ in range(GAS):
        tokens = torch.randint(0, V, (MBS, S + 1), generator=g)
        pos = torch.arange(S).expand(MBS, S).contiguous()
        mask = (torch.rand(MBS, S, generator=g) > 0.25).float()
        out.append(((tokens[:, :-1].contiguous(), pos), (tokens[:, 1:].contiguous(), mask)))
    return out


def _one_case(cfg: ModelConfig, tp: int, pp: int, sp: bool, interval: int) -> dict:
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from megatron.layout.names import pipe_to_megatron_name
    from megatron.model.gpt_model_pipe import GPTModelPipe
    from megatron.mpu import parallel_state
    from megatron.mpu.layers import gather_full_parameter
    from megatron.mpu.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(SEED)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=1)
    parallel = ParallelContext.from_parallel_state(seed=SEED, sequence_parallel=sp)
    model = GPTModelPipe(cfg, parallel, topology=topo, activation_checkpoint_interval=interval)

    def full_params() -> dict[str, torch.Tensor]:
        return {
            pipe_to_megatron_name(n, cfg.num_layers): gather_full_parameter(p)
            for n, p in model.named_parameters()
        }

    before = full_params()
    pipe_names = [n for n, _ in model.named_parameters()]
    layouts = {
        n: (True, p.partition_dim, p.partition_stride)
        if getattr(p, "tensor_model_parallel", False)
        else (False, -1, 1)
        for n, p in model.named_parameters()
    }
    config = {
        "train_batch_size": MBS * GAS,
        "train_micro_batch_size_per_gpu": MBS,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        # sequence-parallel activations differ per TP rank: they must not be partitioned over TP
        "pipeline": {"pipe_partitioned": not sp, "grad_partitioned": not sp},
    }
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config,
    )
    loss = engine.train_batch(data_iter=iter(_micro_batches()))
    after = full_params()
    grads = {n: ((before[n] - after[n]) / LR).numpy() for n in before}
    result = {
        "loss": float(loss),
        "init": {n: t.numpy() for n, t in before.items()},
        "grads": grads,
        "pipe_names": pipe_names,
        "layouts": layouts,
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
    }
    parallel_state.destroy_model_parallel()
    return result


def _pipe_worker(cases: list[tuple]) -> list[dict]:
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    # one spawn (DeepSpeed imports dominate the cost), one engine per case
    return [_one_case(*case[1:]) for case in cases]


def _reference(cfg: ModelConfig) -> tuple[GPTModel, float]:
    model = GPTModel(cfg, ParallelContext(seed=SEED))
    total = 0.0
    for (ids, pos), (labels, mask) in _micro_batches():
        loss = loss_func(model(ids, pos, labels=labels), mask) / GAS
        loss.backward()
        total += loss.item()
    return model, total


CASES = [
    # name, config, tp, pp, sequence_parallel, activation_checkpoint_interval
    ("gpt2-tied-tp2-pp2", GPT2, 2, 2, False, 0),
    ("llama-gqa-untied-tp2-pp2-sp-ckpt", LLAMA, 2, 2, True, 1),
]


SLOW_CASES = [
    ("gpt2-tied-pp4", GPT2, 1, 4, False, 0),
    ("llama-gqa-untied-pp4-ckpt2", LLAMA, 1, 4, False, 2),
    ("gpt2-tied-tp4-pp1-sp", GPT2, 4, 1, True, 0),
]


@pytest.mark.slow  # ~15 s (suite time): PipelineEngine training equals one rank in test_train_parity.py's default
# subset and the other default PP runs
def test_pipe_train_batch_matches_gpt_model() -> None:
    per_rank = run_distributed(_pipe_worker, 4, CASES, timeout=300)
    for i, case in enumerate(CASES):
        _check_case(*case, [r[i] for r in per_rank])


@pytest.mark.slow
def test_pipe_more_layouts_match_gpt_model() -> None:
    per_rank = run_distributed(_pipe_worker, 4, SLOW_CASES, timeout=400)
    for i, case in enumerate(SLOW_CASES):
        _check_case(*case, [r[i] for r in per_rank])


def _check_case(name, cfg, tp, pp, sp, interval, results) -> None:
    ref_model, ref_loss = _reference(cfg)
    ref_params = dict(ref_model.named_parameters())
    seen: dict[str, int] = {}
    worst = {"loss": 0.0, "grad": 0.0}
    for res in results:
        worst["loss"] = max(worst["loss"], abs(res["loss"] - ref_loss) / abs(ref_loss))
        # DeepSpeed averages the micro-batch losses and broadcasts the result to every stage
        assert abs(res["loss"] - ref_loss) <= 1e-6 * abs(ref_loss), (name, res["loss"], ref_loss)
        if pp > 1 and res["stage"] == pp - 1 and not cfg.untie_embeddings_and_output_weights:
            # the tied copy on the last stage holds only the word embeddings
            assert "tied_modules.embed.position_embeddings.weight" not in res["pipe_names"]
        for pipe_name, layout in res["layouts"].items():
            # universal-checkpoint patterns classify the pipeline names like the layers' TP attributes
            assert param_layout(pipe_name, cfg) == layout, (name, pipe_name)
        for n, init in res["init"].items():
            seen[n] = seen.get(n, 0) + 1
            want = ref_params[n]
            init = torch.from_numpy(init)
            grad = torch.from_numpy(res["grads"][n])
            w, g = want.detach(), want.grad
            if n.endswith(("word_embeddings.weight", "output_layer.weight")):
                assert not init[V:].any() and not grad[V:].any(), f"{name}: {n} padding touched"
                init, grad, w, g = init[:V], grad[:V], w[:V], g[:V]
            assert torch.equal(init, w), f"{name}: init of {n} differs from GPTModel"
            err = ((grad - g).abs().max() / g.abs().max()).item()
            worst["grad"] = max(worst["grad"], err)
            # fp32 reductions reordered over stages/TP (~1e-7) + recovery through one SGD step (~1e-7)
            assert err <= 2e-6, f"{name}: grad of {n} rel err {err:.2e}"
    assert set(seen) == set(ref_params), set(ref_params) ^ set(seen)
    print(f"{name}: worst relative errors vs GPTModel {worst}")
    if not cfg.untie_embeddings_and_output_weights:
        # the word embeddings exist on both end stages (x TP ranks): both carry the all-reduced tied grad
        copies = 2 if pp > 1 else 1
        assert seen["language_model.embedding.word_embeddings.weight"] == copies * tp
