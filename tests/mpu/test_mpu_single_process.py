"""mpu in one process (no torch.distributed): TP=1 parity, init, validation messages, RNG tracker, checkpoint."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as F

from megatron import mpu
from megatron.mpu.context import TPSettings
from megatron.mpu.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightInit,
    init_method_normal,
    scaled_init_method_normal,
)
from megatron.testing import mpu_oracle
from tools import mpu_selfcheck


@pytest.fixture(autouse=True)
def _fresh_rng_tracker():
    mpu.get_cuda_rng_tracker().reset()
    yield
    mpu.get_cuda_rng_tracker().reset()


def test_tp1_layers_and_mappings_equal_the_pytorch_reference_bit_for_bit() -> None:
    # Without torch.distributed the layers run on a world of 1: nothing is reduced, so every pair
    # (forward, input grad, weight/bias grad, init) must be identical, except the cross-entropy, which
    # computes log-sum-exp in another order than PyTorch's kernel (checked within RTOL).
    comps = mpu_oracle.all_comparisons(None)
    assert len(comps) > 60
    for c in comps:
        if c.check.startswith("vocab_parallel_cross_entropy"):
            assert c.error() <= mpu_oracle.RTOL, (c.check, c.quantity, c.error())
        else:
            assert torch.equal(c.actual, c.expected), (c.check, c.quantity, c.error())


def test_comparison_detects_a_difference() -> None:
    a = torch.ones(3)
    assert not mpu_oracle.Comparison("x", "y", a + 1e-7, a, True).passed()
    assert mpu_oracle.Comparison("x", "y", a + 1e-7, a, False).passed()
    assert not mpu_oracle.Comparison("x", "y", a + 1e-5, a, False).passed()
    assert not mpu_oracle.Comparison("x", "y", torch.ones(4), a, False).passed()


def test_layout_invariant_init_is_the_seeded_master_and_independent_of_dtype_and_padding() -> None:
    col = ColumnParallelLinear(8, 12, init=WeightInit(method=init_method_normal(0.5), seed=5))
    expected = torch.empty(12, 8).normal_(0.0, 0.5, generator=torch.Generator().manual_seed(5))
    assert torch.equal(col.weight.detach(), expected)
    assert torch.equal(col.bias.detach(), torch.zeros(12))
    row = RowParallelLinear(
        12, 8, bias=False, init=WeightInit(method=init_method_normal(0.5), seed=5)
    )
    assert torch.equal(
        row.weight.detach(), expected.view(8, 12)
    )  # same numbers, drawn for the full shape
    assert row.bias is None
    bf16 = ColumnParallelLinear(
        8,
        12,
        init=WeightInit(method=init_method_normal(0.5), seed=5),
        tp=TPSettings(params_dtype=torch.bfloat16),
    )
    assert bf16.weight.dtype == torch.bfloat16
    assert torch.equal(bf16.weight.detach(), expected.to(torch.bfloat16))
    # the true rows of an embedding do not depend on how much padding follows them
    small = VocabParallelEmbedding(10, 4, true_vocab_size=10, init=WeightInit(seed=9))
    padded = VocabParallelEmbedding(16, 4, true_vocab_size=10, init=WeightInit(seed=9))
    assert torch.equal(padded.weight[:10], small.weight)
    assert torch.equal(padded.weight[10:], torch.zeros(6, 4))
    # a different seed gives a different weight
    assert not torch.equal(
        ColumnParallelLinear(8, 12, init=WeightInit(seed=6)).weight,
        ColumnParallelLinear(8, 12, init=WeightInit(seed=5)).weight,
    )


def test_tp_attributes_and_duplicate_rule() -> None:
    col, row = (
        ColumnParallelLinear(8, 12, stride=2, init=WeightInit(seed=1)),
        RowParallelLinear(8, 12, init=WeightInit(seed=1)),
    )
    emb = VocabParallelEmbedding(16, 4, init=WeightInit(seed=1))
    assert (
        col.weight.tensor_model_parallel,
        col.weight.partition_dim,
        col.weight.partition_stride,
    ) == (True, 0, 2)
    assert (col.bias.tensor_model_parallel, col.bias.partition_dim, col.bias.partition_stride) == (
        True,
        0,
        2,
    )
    assert (row.weight.tensor_model_parallel, row.weight.partition_dim) == (True, 1)
    assert (row.bias.tensor_model_parallel, row.bias.partition_dim, row.bias.partition_stride) == (
        False,
        -1,
        1,
    )
    assert (emb.weight.tensor_model_parallel, emb.weight.partition_dim) == (True, 0)
    plain = torch.nn.Parameter(torch.zeros(2))
    mpu.set_defaults_if_not_set_tensor_model_parallel_attributes(plain)
    assert (plain.tensor_model_parallel, plain.partition_dim, plain.partition_stride) == (
        False,
        -1,
        1,
    )
    assert mpu.param_is_not_tensor_parallel_duplicate(plain)  # TP rank 0 of a world of 1
    copy = torch.zeros(2)
    mpu.copy_tensor_model_parallel_attributes(copy, col.weight)
    assert (copy.tensor_model_parallel, copy.partition_dim, copy.partition_stride) == (True, 0, 2)


def test_init_methods() -> None:
    t = torch.empty(20000)
    init_method_normal(0.02)(t, torch.Generator().manual_seed(0))
    assert abs(float(t.std()) - 0.02) < 0.001
    scaled_init_method_normal(0.02, 8)(t, torch.Generator().manual_seed(0))
    assert abs(float(t.std()) - 0.02 / 4.0) < 0.0003
    with pytest.raises(ValueError, match=r"std \(-1\) must be >= 0"):
        init_method_normal(-1)
    with pytest.raises(ValueError, match=r"num_layers \(0\) must be >= 1"):
        scaled_init_method_normal(0.02, 0)


def test_param_seed_is_stable_and_name_dependent() -> None:
    name = "language_model.encoder.layers.3.self_attention.query_key_value.weight"
    # Pinned: changing it changes every initial weight of every run (and the golden loss files).
    assert mpu.param_seed(1234, name) == 2586658123177799245
    digest = hashlib.sha256(f"1234:{name}".encode()).digest()
    assert mpu.param_seed(1234, name) == int.from_bytes(digest[:8], "big") & (2**63 - 1)
    assert mpu.param_seed(1234, name) != mpu.param_seed(1235, name)
    assert mpu.param_seed(1234, name) != mpu.param_seed(1234, name.replace("3", "4"))
    with pytest.raises(ValueError, match="seed must be an int"):
        mpu.param_seed("1234", name)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty parameter name"):
        mpu.param_seed(1, "")


def test_layer_validation_messages() -> None:
    with pytest.raises(
        ValueError,
        match=r"output_size \(5\) must be a positive multiple of the tensor-model-parallel size \(1\) x stride \(2\)",
    ):
        ColumnParallelLinear(4, 5, stride=2, init=WeightInit(seed=1))
    with pytest.raises(
        ValueError, match="gather_output=True cannot be combined with sequence_parallel=True"
    ):
        ColumnParallelLinear(
            4, 4, gather_output=True, init=WeightInit(seed=1), tp=TPSettings(sequence_parallel=True)
        )
    with pytest.raises(ValueError, match=r"input_size \(0\) must be >= 1"):
        ColumnParallelLinear(0, 4, init=WeightInit(seed=1))
    with pytest.raises(ValueError, match="sequence_parallel=True needs input_is_parallel=True"):
        RowParallelLinear(4, 4, init=WeightInit(seed=1), tp=TPSettings(sequence_parallel=True))
    with pytest.raises(
        ValueError, match=r"true_vocab_size \(20\) must be in \[1, num_embeddings \(16\)\]"
    ):
        VocabParallelEmbedding(16, 4, true_vocab_size=20, init=WeightInit(seed=1))
    with pytest.raises(ValueError, match=r"embedding_dim \(0\) must be >= 1"):
        VocabParallelEmbedding(16, 0, init=WeightInit(seed=1))


def test_embedding_rejects_ids_outside_the_true_vocabulary() -> None:
    emb = VocabParallelEmbedding(16, 4, true_vocab_size=13, init=WeightInit(seed=1))
    ok = emb(torch.tensor([[0, 12], [5, 7]]))
    assert ok.shape == (2, 2, 4)
    with pytest.raises(
        ValueError, match=r"token id 13 at index \[1, 0\] is outside the vocabulary \[0, 13\)"
    ):
        emb(torch.tensor([[0, 12], [13, 7]]))  # a padding row: still not a real token
    with pytest.raises(ValueError, match=r"token id -1 .* outside the vocabulary"):
        emb(torch.tensor([-1]))
    with pytest.raises(ValueError, match="token ids must be integers"):
        emb(torch.tensor([1.0]))


def test_per_shard_init_needs_the_tracker_and_uses_it() -> None:
    with pytest.raises(RuntimeError, match="model_parallel_cuda_manual_seed"):
        ColumnParallelLinear(4, 4)  # init.seed=None: per-shard init under the model-parallel stream
    mpu.model_parallel_cuda_manual_seed(7)
    a = ColumnParallelLinear(4, 4).weight.detach()
    expected = torch.empty(4, 4).normal_(
        0.0, 0.02, generator=torch.Generator().manual_seed(7 + 2718 + 0)
    )
    assert torch.equal(a, expected)
    mpu.model_parallel_cuda_manual_seed(7)
    emb = VocabParallelEmbedding(8, 2, true_vocab_size=5).weight.detach()
    assert torch.equal(emb[5:], torch.zeros(3, 2)) and bool((emb[:5] != 0).all())


def test_rng_tracker_fork_add_and_states() -> None:
    tracker = mpu.get_cuda_rng_tracker()
    with pytest.raises(RuntimeError, match="does not exist"), tracker.fork():
        pass
    mpu.model_parallel_cuda_manual_seed(11)
    with tracker.fork():
        forked = torch.rand(4)
    after = torch.rand(4)
    assert torch.equal(forked, torch.rand(4, generator=torch.Generator().manual_seed(11 + 2718)))
    # the default stream is untouched by the fork: it continues as if the block were not there
    assert torch.equal(after, torch.rand(4, generator=torch.Generator().manual_seed(11)))
    saved = tracker.get_states()
    with tracker.fork():
        first = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(3), first)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("model-parallel-rng", 99)
    with pytest.raises(ValueError, match="seed 2729 is already used"):
        tracker.add("other", 11 + 2718)
    assert mpu.CudaRNGStatesTracker is mpu.RNGStatesTracker


def _block(x: torch.Tensor, col: ColumnParallelLinear, row: RowParallelLinear) -> torch.Tensor:
    with mpu.get_cuda_rng_tracker().fork():
        h = F.dropout(col(x)[0], p=0.5)  # TP-sharded activation: forked stream
    return F.dropout(row(h)[0], p=0.5)  # replicated activation: default stream


def test_checkpoint_replays_dropout_exactly() -> None:
    col = ColumnParallelLinear(8, 16, init=WeightInit(seed=1))
    row = RowParallelLinear(16, 8, input_is_parallel=True, init=WeightInit(seed=2))
    x0 = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(3))
    results = []
    for use_checkpoint in (False, True):
        mpu.model_parallel_cuda_manual_seed(5)
        for p in (*col.parameters(), *row.parameters()):
            p.grad = None
        x = x0.clone().requires_grad_()
        if use_checkpoint:
            y = mpu.checkpoint(_block, False, x, col, row)
        else:
            y = _block(x, col, row)
        # a random op after the block: the recomputation in backward must not shift the streams
        with mpu.get_cuda_rng_tracker().fork():
            tail = torch.rand(3)
        (y * torch.arange(y.numel()).view_as(y)).sum().backward()
        results.append(
            (
                y.detach(),
                x.grad,
                col.weight.grad.clone(),
                row.weight.grad.clone(),
                tail,
                torch.rand(3),
            )
        )
    for plain, ckpt in zip(*results):
        assert torch.equal(plain, ckpt)
    assert (results[0][0] == 0).any()  # dropout really ran


def test_checkpoint_validation() -> None:
    with pytest.raises(ValueError, match="needs a tensor as first argument"):
        mpu.checkpoint(lambda a: a, True, 3)


def test_cross_entropy_messages() -> None:
    logits, target = torch.zeros(2, 3, 8), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(
        ValueError,
        match=r"target shape \(3, 2\) must equal the logits shape without its last \(vocab\) dim, \(2, 3\)",
    ):
        mpu.vocab_parallel_cross_entropy(logits, target.t())
    with pytest.raises(ValueError, match=r"label_smoothing \(1.0\) must be in \[0, 1\)"):
        mpu.vocab_parallel_cross_entropy(logits, target, label_smoothing=1.0)
    with pytest.raises(ValueError, match=r"target id 8 is outside the vocabulary \[0, 8\)"):
        mpu.vocab_parallel_cross_entropy(logits, target + 8)


def test_cross_entropy_keeps_bf16_grads_and_leaves_logits_untouched() -> None:
    logits = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    before = logits.clone()
    logits.requires_grad_()
    target = torch.tensor([[1, 2], [3, 4], [5, 7]])
    loss = mpu.vocab_parallel_cross_entropy(logits, target)
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    assert torch.equal(logits.detach(), before)
    ref = F.cross_entropy(before.float().view(-1, 8), target.view(-1), reduction="none").view(3, 2)
    assert torch.allclose(loss, ref, rtol=1e-6, atol=0)


def test_utils() -> None:
    assert mpu.divide(12, 4) == 3
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        mpu.divide(10, 4)
    t = torch.arange(24.0).view(2, 12)
    parts = mpu.split_tensor_along_last_dim(t, 3)
    assert [p.shape for p in parts] == [(2, 4)] * 3 and torch.equal(torch.cat(parts, -1), t)
    assert all(
        p.is_contiguous()
        for p in mpu.split_tensor_along_last_dim(t, 3, contiguous_split_chunks=True)
    )
    assert torch.equal(mpu.split_tensor_into_1d_equal_chunks(t, 1, 4), torch.arange(6.0, 12.0))
    assert mpu.VocabUtility.vocab_range_from_global_vocab_size(64, 2, 4) == (32, 48)
    assert mpu.VocabUtility.vocab_range_from_per_partition_vocab_size(16, 3, 4) == (48, 64)
    with pytest.raises(ValueError, match="not divisible by 4"):
        mpu.VocabUtility.vocab_range_from_global_vocab_size(50, 0, 4)
    with pytest.raises(ValueError, match="rank 4 is outside a world of 4"):
        mpu.VocabUtility.vocab_range_from_per_partition_vocab_size(16, 4, 4)


def test_broadcast_data_world_of_one() -> None:
    data = {"text": torch.arange(6).view(2, 3), "mask": torch.ones(4, dtype=torch.long)}
    out = mpu.broadcast_data(["text", "mask"], data, torch.long)
    assert torch.equal(out["text"], data["text"]) and torch.equal(out["mask"], data["mask"])
    with pytest.raises(
        ValueError, match=r"data\['mask'\] has dtype torch.int64, expected torch.float32"
    ):
        mpu.broadcast_data(["mask"], data, torch.float32)
    with pytest.raises(ValueError, match="key 'labels' is missing from data"):
        mpu.broadcast_data(["labels"], data, torch.long)


def test_selfcheck_cli_rejects_impossible_degrees(caplog: pytest.LogCaptureFixture) -> None:
    assert mpu_selfcheck.main(["--world-size", "4", "--tp", "3", "--pp", "1"]) == 2
    assert "world size must be divisible by tensor x pipeline = 3" in caplog.text


@pytest.mark.gpu
def test_cuda_tp1_parity_and_checkpoint_replays_cuda_dropout() -> None:
    # Same as the CPU tests, on the CUDA generator and cuBLAS kernels (a world of 1: no reduction anywhere,
    # and the layer and the reference run the same kernels on the same numbers).
    for c in mpu_oracle.all_comparisons(None, device="cuda"):
        if not c.check.startswith("vocab_parallel_cross_entropy"):
            assert torch.equal(c.actual, c.expected), (c.check, c.quantity, c.error())
    col = ColumnParallelLinear(8, 16, init=WeightInit(seed=1), tp=TPSettings(device="cuda"))
    row = RowParallelLinear(
        16, 8, input_is_parallel=True, init=WeightInit(seed=2), tp=TPSettings(device="cuda")
    )
    x0 = torch.randn(4, 2, 8, device="cuda")
    results = []
    for use_checkpoint in (False, True):
        mpu.model_parallel_cuda_manual_seed(5, device_type="cuda")  # the run's device
        for p in (*col.parameters(), *row.parameters()):
            p.grad = None
        x = x0.clone().requires_grad_()
        y = mpu.checkpoint(_block, False, x, col, row) if use_checkpoint else _block(x, col, row)
        y.sum().backward()
        results.append((y.detach(), x.grad, col.weight.grad.clone(), torch.rand(3, device="cuda")))
    for plain, ckpt in zip(*results):
        assert torch.equal(plain, ckpt)
    assert (results[0][0] == 0).any()
