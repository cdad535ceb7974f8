"""What ``megatron/fused_kernels/ops.py`` makes once instead of per call (CPU kernels): the contiguous RoPE tables
(shared by q and k of every layer of a forward) and the mask a batch-broadcast attention mask needs (none)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from megatron import fused_kernels as fk
from megatron.fused_kernels import ops
from megatron.model.rotary import rotary_cos_sin


@pytest.fixture(autouse=True)
def _kernels_present() -> None:
    if os.environ.get("TRIDENT_NO_KERNELS") == "1":
        pytest.skip("TRIDENT_NO_KERNELS=1: the references make no tables")
    assert fk.extension("cpu") is not None, fk.status()


def _saved_tables(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos3, sin3 = y.grad_fn.saved_tensors  # type: ignore[union-attr]
    return cos3, sin3


def test_rope_tables_made_once_for_q_and_k() -> None:
    """q and k with the same tables: one ``[s, b, d]`` pair, saved by both autograd nodes; the results are bitwise
    those of tables made afresh (a cleared cache), and a table changed in place, a new table or another batch
    size gets its own pair."""
    s, b, n, hn = 7, 3, 4, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, n, hn, generator=gen).requires_grad_()
    k = torch.randn(s, b, 2, hn, generator=gen).requires_grad_()
    positions = torch.arange(s).unsqueeze(0).expand(b, s)  # [b, s], as the batch builder gives them
    cos, sin = rotary_cos_sin(positions, hn, 10000.0, torch.float32)  # 2 x [s, b, 1, hn]

    ops._DERIVED.clear()
    yq, yk = fk.rope(q, cos, sin), fk.rope(k, cos, sin)
    tables = _saved_tables(yq)
    assert all(a is c for a, c in zip(tables, _saved_tables(yk), strict=True))
    assert tables[0].shape == (s, b, hn) and tables[0].is_contiguous()
    assert ops.rope_tables(cos, sin, s, b)[0] is tables[0]

    ops._DERIVED.clear()
    assert torch.equal(fk.rope(q, cos, sin), yq) and torch.equal(fk.rope(k, cos, sin), yk)
    assert _saved_tables(fk.rope(q, cos, sin))[0] is not tables[0]  # made afresh after the clear

    made = ops.rope_tables(cos, sin, s, b)
    shared = cos[:, :1].clone(), sin[:, :1].clone()  # [s, 1, 1, hn]: broadcast over the batch
    for_b = ops.rope_tables(*shared, s, b)[0]
    assert for_b.shape == (s, b, hn) and ops.rope_tables(*shared, s, b)[0] is for_b
    assert ops.rope_tables(*shared, s, 2)[0].shape == (s, 2, hn)  # another batch size
    cos2, sin2 = cos.clone(), sin.clone()
    assert ops.rope_tables(cos2, sin2, s, b)[0] is not made[0]  # equal values, other tensors
    before = ops.rope_tables(cos2, sin2, s, b)[0]
    with torch.no_grad():
        cos2.mul_(2.0)
    after = ops.rope_tables(cos2, sin2, s, b)[0]
    assert after is not before and torch.equal(after, 2.0 * before)

    # the entry goes with its tables (weak references): nothing outlives the forward that made it
    del cos2, sin2, before, after
    gc.collect()
    assert ("rope", torch.device("cpu")) not in ops._DERIVED


def test_batch_broadcast_mask_not_copied() -> None:
    """A ``[1, 1, sq, sk]`` mask expanded over the batch reaches the kernel as its first sample (no copy, same
    result); a mask broadcast over the queries is copied once per mask tensor, not per call."""
    b, n, sq, sk = 3, 2, 5, 8
    x = torch.randn(b, n, sq, sk, generator=torch.Generator().manual_seed(1))
    base = torch.rand(1, 1, sq, sk, generator=torch.Generator().manual_seed(2)) < 0.3
    expanded = base.expand(b, 1, sq, sk)
    kernel_mask = ops._kernel_mask(expanded)
    assert kernel_mask.shape == (1, 1, sq, sk) and kernel_mask.data_ptr() == base.data_ptr()
    want = fk.scaled_masked_softmax(x, base.expand(b, 1, sq, sk).contiguous(), 0.5)
    assert torch.equal(fk.scaled_masked_softmax(x, expanded, 0.5), want)

    rows = torch.rand(1, 1, 1, sk, generator=torch.Generator().manual_seed(3)) < 0.3
    over_queries = rows.expand(1, 1, sq, sk)  # stride 0 over sq: the kernel needs a copy
    first = ops._kernel_mask(over_queries)
    assert first.is_contiguous() and torch.equal(first, over_queries)
    assert ops._kernel_mask(over_queries) is first
    assert torch.equal(
        fk.scaled_masked_softmax(x, over_queries, 0.5),
        fk.scaled_masked_softmax(x, over_queries.contiguous(), 0.5),
    )
