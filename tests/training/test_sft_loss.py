"""--sft's loss: the mean over the loss tokens of the WHOLE global batch (``training/token_weights.py``).

Unit: a global batch of 2 DP ranks x 2 micro-batches with 1, 30, 5 and 12 loss tokens. DeepSpeed's own
arithmetic (each micro-batch's loss divided by ``gas``, averaged over DP) applied to ``loss_func(reduction="sum")``
of the weights gives ``sum(loss x mask) / total`` and its gradient ``mask / total`` exactly; the pretraining
mean of micro-batch means is another number (so the check can fail).

PACKED SFT BATCH at TP 2 x PP 2 (4 gloo ranks, one spawn, DeepSpeed's real ``PipelineEngine``): packs of the
``SFTDataset`` (written with our builders), made into batches by the training recipe and weighed by
``GlobalTokenWeights.take``, give per-token losses (read from the last stages' vocab-parallel logits) and
gradients of every parameter (``(w - w') / lr`` of one SGD step, TP shards merged) equal to each conversation run
alone through a single-process ``GPTModel`` with the loss ``sum(loss x mask) / total``, within 1e-5 relative
(the reasoning of ``tests/model/test_packed_documents.py``, whose helpers this reuses). The engine's reported loss
is that global per-token mean.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from megatron.config import DataConfig, ModelConfig
from megatron.model import GPTModel, loss_func
from megatron.mpu.context import ParallelContext
from megatron.testing import run_distributed
from megatron.training.token_weights import weigh
from tests.data.test_sft_dataset import write_sft_dataset
from tests.model.test_packed_documents import LLAMA, LR, SEED, TOL, S, V, _per_document, _rel

GAS, MBS = 2, 2
# conversations (S + 1 = 17 tokens a pack): some whole packs, some several to a pack, one truncated
LENGTHS = [5, 9, 2, 17, 6, 11, 3, 25, 4, 7, 8, 13, 10, 1]


def test_global_per_token_mean_is_exact() -> None:
    g = torch.Generator().manual_seed(0)
    counts = [[1, 30], [5, 12]]  # [dp rank][micro-batch] loss tokens
    gas, dp, total = 2, 2, 48
    losses, masks = [], []
    objective = torch.zeros(())
    for rank in range(dp):
        micro = []
        for n in counts[rank]:
            mask = torch.zeros(2, 32)
            mask.view(-1)[torch.randperm(64, generator=g)[:n]] = 1.0
            loss = (torch.rand(2, 32, generator=g) * 4).requires_grad_()
            losses.append(loss)
            masks.append(mask)
            micro.append({"loss_mask": mask})
        for b, loss in zip(weigh(micro, total=total, gas=gas, data_parallel_size=dp), losses[-2:]):
            # DeepSpeed: backward(loss / gas), gradients averaged over dp
            objective = objective + loss_func(loss, b["loss_mask"], reduction="sum") / gas / dp
    objective.backward()
    want = sum(float((x.detach() * m).sum()) for x, m in zip(losses, masks)) / total
    assert abs(float(objective.detach()) - want) <= 1e-6 * want
    for loss, mask in zip(losses, masks):
        assert torch.allclose(loss.grad, mask / total, rtol=1e-6, atol=0.0)
    mean_of_means = sum(float(loss_func(x.detach(), m)) for x, m in zip(losses, masks)) / 4
    assert abs(mean_of_means - want) > 1e-2 * want  # the pretraining rule is another number here


# ---------------------------------------------------------------- TP 2 x PP 2: DeepSpeed's PipelineEngine


def _packed_batches(prefix: str) -> list[dict[str, torch.Tensor]]:
    """``GAS`` micro-batches of ``MBS`` packs, made by the training recipe (unweighted)."""
    from megatron.data.indexed_dataset import MMapIndexedDataset
    from megatron.data.sft_dataset import SFTDataset, SFTIndexSpec
    from megatron.training.data_iterators import BatchRecipe

    spec = SFTIndexSpec("train", prefix, "100,0,0", GAS * MBS, S, SEED)
    tokens, mask = MMapIndexedDataset(prefix), MMapIndexedDataset(prefix + "_loss_mask")
    ds = SFTDataset(spec, np.arange(len(LENGTHS), dtype=np.int32), tokens, mask)
    recipe = BatchRecipe(DataConfig(sft=True), eod=0)
    out = []
    for i in range(GAS):
        items = [ds[i * MBS + j] for j in range(MBS)]
        raw = {k: torch.from_numpy(np.stack([it[k] for it in items])) for k in items[0]}
        out.append(recipe.make_item(raw))
    return out


def _pipe_case(cfg: ModelConfig, prefix: str) -> dict:
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from megatron.layout.names import pipe_to_megatron_name
    from megatron.model.gpt_model_pipe import GPTModelPipe
    from megatron.mpu import parallel_state
    from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
    from megatron.mpu.random import model_parallel_cuda_manual_seed
    from megatron.training.data_iterators import pipe_batch
    from megatron.training.token_weights import GlobalTokenWeights

    state = parallel_state.initialize_model_parallel(2, 2)
    model_parallel_cuda_manual_seed(SEED)
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    ctx = ParallelContext.from_parallel_state(seed=SEED)
    model = GPTModelPipe(cfg, ctx, topology=topo, loss_reduction="sum")
    per_token: list[torch.Tensor] = []
    loss_fn = model.loss_fn

    def recording_loss(logits: torch.Tensor, labels_and_mask: tuple) -> torch.Tensor:
        # the last stage's vocab-parallel logits [s, b, vp/2] -> per-token loss [b, s] over the TP group
        labels = labels_and_mask[0].transpose(0, 1).contiguous()
        lm = vocab_parallel_cross_entropy(logits.detach(), labels, group=ctx.tp_group)
        per_token.append(lm.transpose(0, 1))
        return loss_fn(logits, labels_and_mask)

    model.loss_fn = recording_loss
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config={
            "train_batch_size": MBS * GAS,
            "train_micro_batch_size_per_gpu": MBS,
            "gradient_accumulation_steps": GAS,
            "zero_optimization": {"stage": 1},
            "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        },
    )
    weights = GlobalTokenWeights.of(state)
    batches, total = weights.take(iter(_packed_batches(prefix)), GAS)
    loss = float(engine.train_batch(data_iter=iter([pipe_batch(b) for b in batches])))
    grads = {
        pipe_to_megatron_name(n, cfg.num_layers): ((before[n] - p.detach()) / LR).numpy()
        for n, p in model.named_parameters()
    }
    out = {
        "loss": loss,
        "total": total,
        "tp_rank": state.get_tensor_model_parallel_rank(),
        "per_token": [t.numpy() for t in per_token],
        "grads": grads,
    }
    parallel_state.destroy_model_parallel()
    return out


def _pipe_worker(cfg: ModelConfig, prefix: str) -> dict:
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    return _pipe_case(cfg, prefix)


@pytest.mark.slow
def test_packed_sft_batch_tp2_pp2_equals_conversations_alone(tmp_path) -> None:
    from megatron.layout.tensor_parallel import merge_tp_shards

    prefix = str(tmp_path / "chat")
    write_sft_dataset(prefix, LENGTHS, vocab=V)
    batches = _packed_batches(prefix)
    counts = [int(b["loss_mask"].sum()) for b in batches]
    total = sum(counts)
    assert len(set(counts)) == GAS  # micro-batches with other loss-token counts: the rule matters
    # a pack of several conversations
    assert max(int(b["document_ids"].max()) for b in batches) >= 2

    results = run_distributed(_pipe_worker, 4, LLAMA, prefix, timeout=300)
    ref = GPTModel(LLAMA, ParallelContext(seed=SEED))
    ref_losses = [_per_document(ref, b, 1.0 / total) for b in batches]
    want = sum(float((t * b["loss_mask"]).sum()) for t, b in zip(ref_losses, batches)) / total
    ref_params = dict(ref.named_parameters())
    seen: set[str] = set()
    for stage in (results[:2], results[2:]):  # ranks (pp, tp): 0, 1 first stage; 2, 3 last
        assert [r["tp_rank"] for r in stage] == [0, 1]
        shards = [{k: torch.from_numpy(v) for k, v in r["grads"].items()} for r in stage]
        for name, grad in merge_tp_shards(shards, LLAMA).items():
            seen.add(name)
            want_grad = ref_params[name].grad
            if name.endswith(("word_embeddings.weight", "output_layer.weight")):
                grad, want_grad = grad[:V], want_grad[:V]
            assert _rel(grad, want_grad) <= TOL, name
    assert seen == set(ref_params)  # every parameter lives on a stage and was checked
    for res in results:
        assert res["total"] == total
        assert abs(res["loss"] - want) <= TOL * want, (res["loss"], want)
    for res in results[2:]:  # the last stage's per-token losses, micro-batch by micro-batch
        assert len(res["per_token"]) == GAS
        for got, expected in zip(res["per_token"], ref_losses, strict=True):
            assert _rel(torch.from_numpy(got), expected) <= TOL


def test_sft_flag_rules() -> None:
    """--sft's validate() rules (one line each) and its dense-mask choice."""
    from megatron.config import parse_args, validate
    from megatron.training.data_iterators import dense_document_mask
    from tests.badinput.cases import TINY_FLAGS

    data = [f for f in TINY_FLAGS if f != "--mock-data"]
    sft = [*data, "--data-path", "chat_text_document", "--sft"]
    # --attention-dropout 0.1 (the default): the dense [b, 1, s, s] mask
    assert dense_document_mask(parse_args(sft))
    assert not dense_document_mask(parse_args([*sft, "--attention-dropout", "0"]))
    validate(parse_args(sft), world_size=1)
    with pytest.raises(
        ValueError, match=r"--sft at --pipeline-model-parallel-size 2 needs --attention-dropout 0"
    ):
        validate(parse_args([*sft, "--pipeline-model-parallel-size", "2"]), world_size=2)
    with pytest.raises(
        ValueError, match=r"--sft trains on conversations and their loss mask, which --mock-data"
    ):
        validate(parse_args([*TINY_FLAGS, "--sft"]), world_size=1)
    with pytest.raises(
        ValueError, match=r"--sft with --reset-attention-mask, --eod-mask-loss: --sft packs"
    ):
        validate(parse_args([*sft, "--reset-attention-mask", "--eod-mask-loss"]), world_size=1)


def test_dense_mask_path_equals_document_ids(tmp_path) -> None:
    """--sft with --attention-dropout > 0 at PP 1 keeps the dense [b, 1, s, s] mask: the same attention."""
    from megatron.training.data_iterators import BatchRecipe
    from megatron.training.step import model_attention_mask

    prefix = str(tmp_path / "chat")
    write_sft_dataset(prefix, LENGTHS, vocab=V)
    batch = max(_packed_batches(prefix), key=lambda b: int(b["document_ids"].max()))
    assert (
        int(batch["document_ids"].max()) >= 2
    )  # conversations after others: a causal mask would differ
    raw = {
        "text": torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1),
        "loss_mask": torch.zeros(MBS, S + 1, dtype=torch.int64),
        "document_ids": torch.cat([batch["document_ids"], batch["document_ids"][:, -1:]], dim=1),
    }
    dense = BatchRecipe(DataConfig(sft=True), eod=0, dense_mask=True).make_item(raw)
    assert "document_ids" not in dense and dense["attention_mask"].shape == (MBS, 1, S, S)
    model = GPTModel(LLAMA, ParallelContext(seed=SEED))
    with torch.no_grad():
        want = model(
            batch["tokens"],
            batch["position_ids"],
            model_attention_mask(batch),
            labels=batch["labels"],
        )
        got = model(
            dense["tokens"], dense["position_ids"], dense["attention_mask"], labels=dense["labels"]
        )
    assert _rel(got, want) <= TOL
