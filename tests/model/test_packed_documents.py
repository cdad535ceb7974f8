"""PACKED DOCUMENTS (``--reset-attention-mask --reset-position-ids``) without a dense mask: a batch of packed
documents gives the same per-token losses and the same gradients as each document run alone.

The batch goes through the training path (``BatchRecipe``: ``document_ids [b, S]``, no ``[b, 1, s, s]`` mask) and
the model gets ``PackedDocuments(ids)``. The reference runs every document of every sample alone through a
single-process ``GPTModel`` built from the same seed (identical weights), positions ``0 .. len-1``. With the loss a
masked mean over the packed tokens, the packed gradient equals the sum of the per-document gradients of
``sum(per-token loss x mask) / (mask count of the packed batch)``, so gradients are compared, not just losses.

PP 1: ``GPTModel`` in this process (GPT-2 learned positions + tied embeddings; LLaMA RoPE + GQA); the same batch
with the dense mask of ``get_ltor_masks_and_position_ids`` gives the same losses (the old path, kept for attention
dropout). CP 2: ``GPTModel`` with a context-parallel group of 2 spawned gloo ranks, each fed its load-balanced
quarter-chunks (documents cross the chunk boundaries), the whole sequence's ids on both ranks; per-token losses
put back in order, gradients summed over the two ranks. PP 2: ``GPTModelPipe`` under DeepSpeed's real ``PipelineEngine`` (gloo, 2 ranks, ZeRO-1), the document ids
carried in the pipe tuple; per-token losses read from the last stage's logits, gradients from one SGD step
(``grad = (w - w') / lr``, as ``test_model_pipe.py``).

Tolerance 1e-5 relative: the packed and per-document runs differ only in the length of the reductions (fp32
matmuls over 16 vs a few keys; masked keys add exact zeros), about 1e-7 here.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from megatron.config import DataConfig, ModelConfig
from megatron.data.batch import get_ltor_masks_and_position_ids
from megatron.model import GPTModel, loss_func
from megatron.model.token_layout import PackedDocuments
from megatron.mpu.context import ParallelContext
from megatron.testing import run_distributed
from megatron.training.data_iterators import BatchRecipe, SequenceSplit, _micro_batches
from megatron.training.step import model_attention_mask

V, EOD, S, SEED = 64, 0, 16, 5
TOL = 1e-5
LR = 1000.0  # (w - w') / lr recovers the gradient to ~1e-7 relative in fp32
# Document lengths of each sample of each micro-batch (S tokens + 1 for the labels; the last document of a sample
# is cut by the sample's end, as the GPT dataset's samples are). A one-token document and an EOD at position 0 too.
DOCS = [
    [[5, 7, 5], [1, 10, 6]],
    [[17], [3, 3, 4, 7]],
]

BASE = {
    "num_layers": 4,
    "hidden_size": 32,
    "seq_length": S,
    "max_position_embeddings": S,
    "vocab_size": V,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
}
GPT2 = ModelConfig(**BASE, num_attention_heads=4)
LLAMA = ModelConfig(
    **BASE,
    num_attention_heads=4,
    num_key_value_heads=2,
    ffn_hidden_size=48,
    make_vocab_size_divisible_by=8,
    normalization="rmsnorm",
    swiglu=True,
    use_rotary_position_embeddings=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)
RECIPE = BatchRecipe(DataConfig(reset_position_ids=True, reset_attention_mask=True), EOD)


def _text(lengths: list[list[int]], g: torch.Generator) -> torch.Tensor:
    """``[b, S + 1]`` token ids: documents of random non-EOD tokens, each closed by an EOD (Megatron's cut)."""
    rows = []
    for sample in lengths:
        assert sum(sample) == S + 1
        row = [torch.randint(1, V, (n,), generator=g) for n in sample]
        for doc in row:
            doc[-1] = EOD
        rows.append(torch.cat(row))
    return torch.stack(rows)


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for lengths in DOCS:
        batch = RECIPE.make(_text(lengths, g))
        batch["loss_mask"] = (torch.rand(batch["tokens"].shape, generator=g) > 0.2).float()
        out.append(batch)
    return out


def _spans(ids: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each document of one sample's ``[S]`` document ids."""
    bounds = [0, *(torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist(), ids.numel()]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _per_document(model: GPTModel, batch: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """Per-token losses ``[b, S]`` of every document run alone; backward of ``sum(loss x mask) x scale``."""
    out = torch.zeros(batch["tokens"].shape)
    for i in range(batch["tokens"].shape[0]):
        for a, e in _spans(batch["document_ids"][i]):
            tokens, labels = batch["tokens"][i : i + 1, a:e], batch["labels"][i : i + 1, a:e]
            per_token = model(tokens, torch.arange(e - a).unsqueeze(0), labels=labels)  # [1, e - a]
            (per_token * batch["loss_mask"][i : i + 1, a:e]).sum().mul(scale).backward()
            out[i, a:e] = per_token.detach()[0]
    return out


def _reference(cfg: ModelConfig, gas: int) -> tuple[GPTModel, list[torch.Tensor]]:
    """The per-document model (its .grad: the gradient of the mean over micro-batches) and per-token losses."""
    model = GPTModel(cfg, ParallelContext(seed=SEED))
    losses = [
        _per_document(model, b, 1.0 / (gas * float(b["loss_mask"].sum()))) for b in _batches()[:gas]
    ]
    return model, losses


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama-gqa"])
def test_packed_batch_equals_documents_alone_pp1(cfg: ModelConfig) -> None:
    batch = _batches()[0]
    assert "attention_mask" not in batch  # no [b, 1, s, s] tensor on the training path
    assert batch["document_ids"].tolist() == [
        [0] * 5 + [1] * 7 + [2] * 4,
        [0] + [1] * 10 + [2] * 5,
    ]  # an EOD closes its document; position ids restart after it
    assert batch["position_ids"][1].tolist() == [0, *range(10), *range(5)]
    mask = model_attention_mask(batch)
    assert isinstance(mask, PackedDocuments) and mask.ids is batch["document_ids"]
    # the training iterator under DeepSpeed-Ulysses (rank 1 of 2): tokens sliced, the ids of the whole sequence
    text = _text(DOCS[0], torch.Generator().manual_seed(3))
    ulysses = SequenceSplit(sp_rank=1, sp_size=2)
    (sliced,) = _micro_batches([{"text": text}], RECIPE, device=torch.device("cpu"), split=ulysses)
    assert sorted(sliced) == ["document_ids", "labels", "loss_mask", "position_ids", "tokens"]
    assert sliced["tokens"].shape == (2, S // 2) and sliced["document_ids"].shape == (2, S)

    ref, ref_losses = _reference(cfg, gas=1)
    model = GPTModel(cfg, ParallelContext(seed=SEED))
    per_token = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
    loss_func(per_token, batch["loss_mask"]).backward()
    assert _rel(per_token.detach(), ref_losses[0]) <= TOL
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None and _rel(p.grad, ref_params[name].grad) <= TOL, name

    # the dense-mask path (kept for --attention-dropout > 0) agrees with the document ids
    dense, _, _ = get_ltor_masks_and_position_ids(batch["tokens"], EOD, True, True, False)
    with torch.no_grad():
        dense_loss = model(batch["tokens"], batch["position_ids"], dense, labels=batch["labels"])
    assert _rel(dense_loss, per_token.detach()) <= TOL


def test_attention_dropout_keeps_the_dense_mask_at_pp1() -> None:
    """The document-id attention has no dropout: --attention-dropout > 0 (the default 0.1) keeps the dense mask."""
    from megatron.config import parse_args, validate
    from megatron.training.data_iterators import dense_document_mask
    from tests.badinput.cases import TINY_FLAGS

    packed = [*TINY_FLAGS, "--reset-attention-mask"]
    assert dense_document_mask(parse_args(packed))
    assert not dense_document_mask(parse_args([*packed, "--attention-dropout", "0"]))
    batch = BatchRecipe(RECIPE.data, EOD, dense_mask=True).make(_text(DOCS[0], torch.Generator()))
    assert "document_ids" not in batch and batch["attention_mask"].shape == (2, 1, S, S)
    pp2 = [*packed, "--pipeline-model-parallel-size", "2"]
    with pytest.raises(ValueError, match=r"needs --attention-dropout 0 \(got 0.1\)"):
        validate(parse_args(pp2), world_size=2)
    validate(parse_args([*pp2, "--attention-dropout", "0"]), world_size=2)


# ---------------------------------------------------------------- PP 2: DeepSpeed's PipelineEngine


def _pipe_case(cfg: ModelConfig, interval: int) -> dict:
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from megatron.layout.names import pipe_to_megatron_name
    from megatron.model.gpt_model_pipe import GPTModelPipe
    from megatron.mpu import parallel_state
    from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
    from megatron.mpu.random import model_parallel_cuda_manual_seed
    from megatron.training.data_iterators import _pipe_batches

    parallel_state.initialize_model_parallel(1, 2)
    model_parallel_cuda_manual_seed(SEED)
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=1)
    model = GPTModelPipe(
        cfg,
        ParallelContext.from_parallel_state(seed=SEED),
        topology=topo,
        activation_checkpoint_interval=interval,
    )
    per_token: list[torch.Tensor] = []
    loss_fn = model.loss_fn

    def recording_loss(logits: torch.Tensor, labels_and_mask: tuple) -> torch.Tensor:
        # the last stage's logits [s, b, vp] -> per-token loss [b, s] (TP 1: the whole vocabulary here)
        labels = labels_and_mask[0].transpose(0, 1).contiguous()
        per_token.append(vocab_parallel_cross_entropy(logits.detach(), labels).transpose(0, 1))
        return loss_fn(logits, labels_and_mask)

    model.loss_fn = recording_loss
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config={
            "train_batch_size": 2 * len(DOCS),
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": len(DOCS),
            "zero_optimization": {"stage": 1},
            "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        },
    )
    pipe = list(_pipe_batches(iter(_batches())))
    assert all(len(inputs) == 3 for inputs, _ in pipe)  # (tokens, position_ids, document_ids)
    loss = float(engine.train_batch(data_iter=iter(pipe)))
    grads = {
        pipe_to_megatron_name(n, cfg.num_layers): ((before[n] - p.detach()) / LR).numpy()
        for n, p in model.named_parameters()
    }
    parallel_state.destroy_model_parallel()
    # numpy, not tensors: torch's shared-memory pickling of tensors does not outlive the rank's process
    return {"loss": loss, "per_token": [t.numpy() for t in per_token], "grads": grads}


def _pipe_worker(cases: list[tuple[ModelConfig, int]]) -> list[dict]:
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    return [_pipe_case(*case) for case in cases]


def _check_pipe(cfg: ModelConfig, results: list[dict]) -> None:
    ref, ref_losses = _reference(cfg, gas=len(DOCS))
    ref_loss = sum(
        float(loss_func(t, b["loss_mask"])) for t, b in zip(ref_losses, _batches(), strict=True)
    ) / len(DOCS)
    ref_params = dict(ref.named_parameters())
    seen = set()
    for res in results:
        assert abs(res["loss"] - ref_loss) <= TOL * ref_loss, (res["loss"], ref_loss)
        for got, want in zip(res["per_token"], ref_losses, strict=False):
            assert _rel(torch.from_numpy(got), want) <= TOL
        for name, array in res["grads"].items():
            seen.add(name)
            grad, want = torch.from_numpy(array), ref_params[name].grad
            if name.endswith(("word_embeddings.weight", "output_layer.weight")):
                grad, want = grad[:V], want[:V]
            assert _rel(grad, want) <= TOL, name
    assert len(results[1]["per_token"]) == len(DOCS)  # the last stage saw every micro-batch
    assert seen == set(ref_params)  # every parameter lives on a stage and was checked


def test_packed_batch_equals_documents_alone_pp2() -> None:
    # LLaMA (RoPE, GQA, untied) with activation checkpointing: the ids pass through the checkpointed chunks
    results = run_distributed(_pipe_worker, 2, [(LLAMA, 1)], timeout=300)
    _check_pipe(LLAMA, [r[0] for r in results])


@pytest.mark.slow
def test_packed_batch_equals_documents_alone_pp2_gpt2() -> None:
    # GPT-2: learned positions and the word embeddings tied across the first and the last stage
    results = run_distributed(_pipe_worker, 2, [(GPT2, 0)], timeout=300)
    _check_pipe(GPT2, [r[0] for r in results])


def _cp_worker(cfg: ModelConfig) -> dict:
    import torch.distributed as dist

    from megatron.mpu import parallel_state

    state = parallel_state.initialize_model_parallel(context_parallel_size=2)
    rank = state.get_context_parallel_rank()
    groups = {
        "tp_group": state.get_tensor_model_parallel_group(),
        "cp_group": state.get_context_parallel_group(),
    }
    model = GPTModel(cfg, ParallelContext(seed=SEED, **groups))
    batch = _batches()[0]
    split = SequenceSplit(cp_rank=rank, cp_size=2)
    mine = split.apply(batch)  # [b, S/2] of every per-token tensor; document_ids stay [b, S]
    per_token = model(
        mine["tokens"], mine["position_ids"], model_attention_mask(mine), labels=mine["labels"]
    )
    # this rank's share of the packed batch's masked mean; the gradient is the sum of the shares
    (per_token * mine["loss_mask"]).sum().div(batch["loss_mask"].sum()).backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        dist.all_reduce(p.grad)
        grads[name] = p.grad.numpy()
    parallel_state.destroy_model_parallel()
    return {
        "positions": split.positions(S).tolist(),
        "per_token": per_token.detach().numpy(),
        "grads": grads,
    }


def test_packed_batch_equals_documents_alone_cp2() -> None:
    results = run_distributed(_cp_worker, 2, LLAMA, timeout=120)
    ref, (ref_losses,) = _reference(LLAMA, gas=1)
    per_token = torch.zeros_like(ref_losses)
    for res in results:
        per_token[:, res["positions"]] = torch.from_numpy(res["per_token"])
    assert sorted(results[0]["positions"] + results[1]["positions"]) == list(range(S))
    assert _rel(per_token, ref_losses) <= TOL
    for name, want in ref.named_parameters():
        assert _rel(torch.from_numpy(results[0]["grads"][name]), want.grad) <= TOL, name
