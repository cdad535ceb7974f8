"""Block attention (tiles, online softmax) and the context-parallel ring against the dense layout oracle.

Tolerances: fp32 inputs agree with ``reference_layout_attention`` (also fp32 math) within 1e-5 absolute (outputs
and gradients are O(1); the tiles sum the same terms in another order, so differences are a few fp32 ulps). bf16
inputs are compared with the oracle run on the same bf16 values in fp32: results differ by their bf16 rounding
(relative 2^-8 each, a few roundings deep), so 1e-2 relative to the largest value. The ring runs gloo world 2
(default) and world 4 (slow), one spawn each, every case checked inside: output, dq, dk, dv of each rank's
load-balanced shard against the oracle over the whole sequence at that rank's positions, and the bytes each rank
sends (the K/V heads only).
"""

from __future__ import annotations

import pytest
import torch

from megatron.model.block_attention import (
    block_attention,
    block_forward,
    merge_blocks,
    plan_tiles,
)
from megatron.model.token_layout import (
    PackedDocuments,
    TokenLayout,
    load_balanced_positions,
    rank_layout,
    reference_layout_attention,
)
from megatron.testing import run_distributed

FP32_TOL = 1e-5


def _qkv(
    s: int, s_k: int, heads: int, groups: int, *, b: int = 2, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hn = 8
    q = torch.randn(s, b, heads, hn, generator=g)
    k = torch.randn(s_k, b, groups, hn, generator=g)
    v = torch.randn(s_k, b, groups, hn, generator=g)
    grad_out = torch.randn(s, b, heads * hn, generator=g)
    return q, k, v, grad_out


def _grads(fn, q, k, v, grad_out) -> list[torch.Tensor]:  # noqa: ANN001
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad_out)
    return [out.detach(), *(x.grad for x in leaves)]


def _max_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    return [(a.float() - b.float()).abs().max().item() for a, b in zip(got, want, strict=True)]


# documents of the two samples, cutting tiles of 5 and 8 tokens in their middles (s = 37)
DOCS = torch.tensor([[0] * 11 + [1] * 14 + [2] * 12, [0] * 3 + [1] * 21 + [2] * 13])

CASES = {
    # name: (query heads, KV groups, window, documents, tile size)
    "mha-causal-tile8": (4, 4, None, None, 8),
    "gqa-window-tile5": (4, 2, 6, None, 5),
    "gqa-documents-tile8": (6, 2, None, DOCS, 8),
    "mqa-documents-window-tile5": (4, 1, 9, DOCS, 5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_block_attention_matches_the_dense_oracle(name: str) -> None:
    heads, groups, window, docs, tile = CASES[name]
    q, k, v, grad_out = _qkv(37, 37, heads, groups)
    layout = TokenLayout.contiguous(37, q.device, docs)

    def ours(q, k, v):  # noqa: ANN001, ANN202
        return block_attention(q, k, v, layout, layout, window_left=window, tile_size=tile)

    def oracle(q, k, v):  # noqa: ANN001, ANN202
        return reference_layout_attention(q, k, v, layout, layout, window_left=window)[0]

    errors = _max_errors(_grads(ours, q, k, v, grad_out), _grads(oracle, q, k, v, grad_out))
    assert max(errors) < FP32_TOL, dict(zip(("out", "dq", "dk", "dv"), errors, strict=True))
    plan = plan_tiles(layout, layout, window_left=window, tile_size=tile)
    _, lse = block_forward(q, k, v, plan)
    assert torch.allclose(lse, oracle_lse(q, k, v, layout, layout, window), atol=FP32_TOL)


def oracle_lse(q, k, v, q_layout, kv_layout, window):  # noqa: ANN001, ANN201
    return reference_layout_attention(q, k, v, q_layout, kv_layout, window_left=window)[1]


def test_queries_that_see_nothing_and_the_merge_of_blocks() -> None:
    # queries of CP rank 0 of 2 (positions 0..7, 24..31) over keys of rank 1 (8..23): the first 8 see nothing
    q_layout, kv_layout = (rank_layout(32, 2, r, None, torch.device("cpu")) for r in (0, 1))
    q, k, v, grad_out = _qkv(16, 16, 4, 2)
    plan = plan_tiles(q_layout, kv_layout, tile_size=3)
    out, lse = block_forward(q, k, v, plan)
    want_out, want_lse = reference_layout_attention(q, k, v, q_layout, kv_layout)
    assert torch.isneginf(lse[:, :, :8]).all() and torch.isfinite(lse[:, :, 8:]).all()
    assert out[:8].abs().max().item() == 0.0
    assert torch.allclose(out.reshape(16, 2, -1), want_out, atol=FP32_TOL)
    assert torch.allclose(lse[:, :, 8:], want_lse[:, :, 8:], atol=FP32_TOL)
    grads = _grads(
        lambda q, k, v: block_attention(q, k, v, q_layout, kv_layout, tile_size=3),
        q,
        k,
        v,
        grad_out,
    )
    assert all(torch.isfinite(x).all() for x in grads)
    assert grads[1][:8].abs().max().item() == 0.0  # no key seen: no query gradient
    # the keys split into two blocks (the second's first half seen by nobody), merged = all the keys at once
    first, second = torch.arange(0, 6), torch.arange(6, 16)
    merged_out = torch.zeros(16, 2, 4, 8)
    merged_lse = torch.full((2, 4, 16), float("-inf"))
    for part in (first, second):
        block = plan_tiles(q_layout, kv_layout.take(part), tile_size=4)
        block_out, block_lse = block_forward(q, k[part], v[part], block)
        merged_out, merged_lse = merge_blocks(merged_out, merged_lse, block_out, block_lse)
    assert torch.allclose(merged_out, out, atol=FP32_TOL)
    assert torch.equal(torch.isneginf(merged_lse), torch.isneginf(lse))
    assert torch.allclose(merged_lse[:, :, 8:], lse[:, :, 8:], atol=FP32_TOL)


def test_bf16_inputs_give_bf16_outputs_close_to_the_oracle() -> None:
    q, k, v, grad_out = (x.bfloat16() for x in _qkv(37, 37, 4, 2))
    layout = TokenLayout.contiguous(37, q.device, DOCS)
    got = _grads(
        lambda q, k, v: block_attention(q, k, v, layout, layout, tile_size=8), q, k, v, grad_out
    )
    assert all(x.dtype == torch.bfloat16 for x in got)
    want = _grads(
        lambda q, k, v: reference_layout_attention(q, k, v, layout, layout)[0],
        *(x.float() for x in (q, k, v, grad_out)),
    )
    scale = [x.abs().max().item() for x in want]
    relative = [err / top for err, top in zip(_max_errors(got, want), scale, strict=True)]
    assert max(relative) < 1e-2, relative  # seen: 3e-3 (bf16 roundings)


def test_tile_plan_skips_what_nobody_sees_and_masks_only_partial_tiles() -> None:
    cpu = torch.device("cpu")

    def kinds(plan) -> list[list[tuple[int, bool]]]:  # noqa: ANN001
        return plan.pairs

    causal = TokenLayout.contiguous(64, cpu)
    assert kinds(plan_tiles(causal, causal, tile_size=16)) == [
        [(0, False)],
        [(0, True), (1, False)],
        [(0, True), (1, True), (2, False)],
        [(0, True), (1, True), (2, True), (3, False)],
    ]
    two_docs = TokenLayout.contiguous(64, cpu, torch.tensor([[0] * 32 + [1] * 32]))
    assert kinds(plan_tiles(two_docs, two_docs, tile_size=16, window_left=20)) == [
        [(0, False)],
        [(0, False), (1, False)],  # the window reaches back 20: tile 0 only partly
        [(2, False)],  # document 1 sees nothing of document 0
        [(2, False), (3, False)],
    ]
    # CP 2: rank 0 holds 0..15 and 48..63, rank 1's block 16..47: tiles never straddle the two chunks, so
    # the first chunk's tiles skip the block and the last chunk's see it whole
    rank0, rank1 = (rank_layout(64, 2, r, None, cpu) for r in (0, 1))
    plan = plan_tiles(rank0, rank1, tile_size=16)
    assert plan.q_tiles == [(0, 16), (16, 32)] and kinds(plan) == [[], [(0, True), (1, True)]]
    # CP 4 with a window of 4: rank 0 (0..7, 56..63) sees nothing of rank 2's block (16..23, 40..47)
    far = plan_tiles(
        rank_layout(64, 4, 0, None, cpu),
        rank_layout(64, 4, 2, None, cpu),
        window_left=4,
        tile_size=3,
    )
    assert far.empty


def test_block_attention_saves_only_its_inputs_output_and_lse() -> None:
    q, k, v, _ = _qkv(64, 64, 4, 2)
    q.requires_grad_()
    layout = TokenLayout.contiguous(64, q.device)
    saved: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x.numel() * x.element_size())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = block_attention(q, k, v, layout, layout, tile_size=16)
    lse_bytes = 2 * 4 * 64 * 4  # [b, np, s] fp32
    assert sum(saved) == 2 * q.nbytes + 2 * k.nbytes + lse_bytes  # q, k, v, out (q's size), lse
    assert out.shape == (64, 2, 32)


# --- the ring ------------------------------------------------------------------------------------------------


def _documents(kind: str | None, seq_length: int, world: int) -> PackedDocuments | None:
    if kind is None:
        return None
    if (
        kind == "random"
    ):  # sorted random ids: documents of random lengths across chunk and tile boundaries
        ids = torch.randint(0, 6, (2, seq_length), generator=torch.Generator().manual_seed(1))
        return PackedDocuments(torch.sort(ids, dim=1).values)
    # "per-chunk": one document per load-balanced chunk, so a rank sees nothing of another rank's block (every
    # block but its own is skipped, forward and backward, and the accumulators still travel)
    chunk = torch.arange(seq_length) // (seq_length // (2 * world))
    return PackedDocuments(torch.minimum(chunk, 2 * world - 1 - chunk).expand(2, -1).contiguous())


def _ring_case(seq_length: int, heads: int, groups: int, window, docs_kind, tile) -> dict:  # noqa: ANN001
    import torch.distributed as dist

    from megatron.model.context_parallel import context_attention, ring_attention
    from megatron.mpu.mappings import observe_collectives

    n, r = dist.get_world_size(), dist.get_rank()
    q, k, v, grad_out = _qkv(seq_length, seq_length, heads, groups, seed=7)
    docs = _documents(docs_kind, seq_length, n)
    whole = rank_layout(seq_length, 1, 0, docs, q.device)
    want = _grads(
        lambda q, k, v: reference_layout_attention(q, k, v, whole, whole, window_left=window)[0],
        q,
        k,
        v,
        grad_out,
    )
    mine = load_balanced_positions(seq_length, n, r)
    sent: list[int] = []

    def count(op: str, nbytes: int, group: object) -> None:
        sent.extend([nbytes] if op == "send" else [])

    with observe_collectives(count):
        if tile is None:  # the public entry point, default tiles
            got = _grads(
                lambda q, k, v: context_attention(
                    q, k, v, documents=docs, group=dist.group.WORLD, window_left=window
                ),
                *(x[mine] for x in (q, k, v, grad_out)),
            )
        else:
            got = _grads(
                lambda q, k, v: ring_attention(
                    q,
                    k,
                    v,
                    documents=docs,
                    group=dist.group.WORLD,
                    window_left=window,
                    tile_size=tile,
                ),
                *(x[mine] for x in (q, k, v, grad_out)),
            )
    kv_bytes = k[mine].nbytes  # one rank's K (or V): gp heads, fp32
    return {
        "errors": _max_errors(got, [x[mine] for x in want]),
        "sent": sum(sent),
        # forward: N-1 hops of K and V; backward: N-1 hops of K and V and N hops of the fp32 dK, dV
        "expected_sent": (n - 1) * 2 * kv_bytes * 2 + n * 2 * kv_bytes,
    }


RING_CASES = {
    "mha-causal": (4, 4, None, None, 5),
    "gqa-documents-window": (4, 2, 7, "random", 5),
    "gqa-documents-default-tiles": (6, 2, None, "random", None),
    "gqa-one-document-per-rank": (4, 2, None, "per-chunk", 5),
}


def _ring_worker(seq_length: int) -> dict:
    return {name: _ring_case(seq_length, *case) for name, case in RING_CASES.items()}


def _check_ring(world: int, seq_length: int) -> None:
    results = run_distributed(_ring_worker, world, seq_length, timeout=240)
    for rank, per_case in enumerate(results):
        for name, got in per_case.items():
            assert max(got["errors"]) < FP32_TOL, (rank, name, got["errors"])
            assert got["sent"] == got["expected_sent"], (rank, name, got)


def test_ring_attention_world2_matches_the_dense_oracle() -> None:
    _check_ring(2, 48)


@pytest.mark.slow
def test_ring_attention_world4_matches_the_dense_oracle() -> None:
    _check_ring(4, 64)
