"""The logits matmul (``megatron/model/output_logits.py``): the same values and gradients as
``F.linear(...).masked_fill(padded, -inf)``, and the recycled CPU buffer handed out only while nothing can read it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron import fused_kernels as fk
from megatron.model.output_logits import LogitsBuffer, local_logits
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy

S, B, H, VP = 5, 3, 16, 40


def _inputs(seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(VP, H, generator=gen).to(dtype).requires_grad_()
    return hidden, weight


def _reference(hidden: torch.Tensor, weight: torch.Tensor, pad_from: int) -> torch.Tensor:
    padded = torch.arange(VP) >= pad_from
    return F.linear(hidden, weight).masked_fill(padded, float("-inf"))  # [s, b, vp]


def _loss(
    logits: torch.Tensor, target: torch.Tensor, fused: bool, smoothing: float
) -> torch.Tensor:
    kernels = fk.cross_entropy_kernels(logits) if fused else None
    per_token = vocab_parallel_cross_entropy(logits, target, smoothing, local_kernels=kernels)
    return per_token.mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad_from", [VP, 33, 0])
def test_values_and_gradients_match_linear_then_masked_fill(
    dtype: torch.dtype, pad_from: int
) -> None:
    hidden, weight = _inputs(1, dtype)
    upstream = torch.randn(S, B, VP).to(dtype)
    got = local_logits(hidden, weight, pad_from)
    got.backward(upstream)
    h_ref, w_ref = (
        hidden.detach().clone().requires_grad_(),
        weight.detach().clone().requires_grad_(),
    )
    ref = _reference(h_ref, w_ref, pad_from)
    ref.backward(upstream)
    assert torch.equal(got, ref)
    assert torch.equal(hidden.grad, h_ref.grad)
    assert torch.equal(weight.grad, w_ref.grad)
    assert not weight.grad[pad_from:].any()  # padded rows learn nothing


@pytest.mark.parametrize("fused", [True, False])
def test_with_cross_entropy_and_padded_rows_get_no_gradient(fused: bool) -> None:
    """Through either cross-entropy the gradients equal the reference's; a loss that puts gradient on padded
    columns (as label smoothing over the padded vocabulary does) does not reach the padded weight rows."""
    if fused and fk.cross_entropy_kernels(torch.empty(1, 1)) is None:
        pytest.skip(f"no fused cross-entropy here: {fk.status()}")
    target = torch.randint(0, 30, (S, B), generator=torch.Generator().manual_seed(3))
    hidden, weight = _inputs(2)
    buffer = LogitsBuffer(enabled=True)
    _loss(local_logits(hidden, weight, 33, buffer), target, fused, 0.0).backward()
    h_ref, w_ref = (
        hidden.detach().clone().requires_grad_(),
        weight.detach().clone().requires_grad_(),
    )
    _loss(_reference(h_ref, w_ref, 33), target, False, 0.0).backward()
    torch.testing.assert_close(hidden.grad, h_ref.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(weight.grad, w_ref.grad, rtol=1e-6, atol=1e-7)
    # label smoothing over the padded vocabulary: a gradient the padded columns must not pass on
    unmasked = F.linear(hidden.detach(), weight.detach()).requires_grad_()
    _loss(unmasked, target, False, 0.1).backward()
    assert unmasked.grad[..., 33:].abs().sum() > 0
    hidden.grad = weight.grad = None
    logits = local_logits(hidden, weight, 33, buffer)
    logits.backward(torch.ones_like(logits) / logits.numel())  # gradient on every column
    assert not weight.grad[33:].any() and weight.grad[:33].any()


def test_buffer_is_reused_only_after_the_fused_loss_consumed_it() -> None:
    if fk.cross_entropy_kernels(torch.empty(1, 1)) is None:
        pytest.skip(f"no fused cross-entropy here: {fk.status()}")
    target = torch.randint(0, 30, (S, B), generator=torch.Generator().manual_seed(4))
    hidden, weight = _inputs(3)
    buffer = LogitsBuffer(enabled=True)

    first = local_logits(hidden, weight, 33, buffer)
    ptr = first.data_ptr()
    _loss(first, target, True, 0.0).backward()
    assert buffer._spare is not None and buffer._spare.data_ptr() == ptr
    assert buffer._spare.grad_fn is None  # no graph kept alive through the spare

    # two forwards in flight (pipeline micro-batches): the second gets new memory, both backwards are right
    grads = []
    for _ in range(2):
        hidden.grad = weight.grad = None
        a = local_logits(hidden, weight, 33, buffer)
        b = local_logits(hidden, weight, 33, buffer)
        assert a.data_ptr() == ptr and b.data_ptr() != ptr
        (_loss(a, target, True, 0.0) + _loss(b, target, True, 0.0)).backward()
        grads.append((hidden.grad.clone(), weight.grad.clone()))
    h_ref, w_ref = (
        hidden.detach().clone().requires_grad_(),
        weight.detach().clone().requires_grad_(),
    )
    (2 * _loss(_reference(h_ref, w_ref, 33), target, False, 0.0)).backward()
    for dh, dw in grads:
        torch.testing.assert_close(dh, h_ref.grad, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(dw, w_ref.grad, rtol=1e-6, atol=1e-7)

    # the unfused loss hands back a gradient of its own: the logits memory is not reused after it
    buffer.clear()
    c = local_logits(hidden, weight, 33, buffer)
    _loss(c, target, False, 0.0).backward()
    assert buffer._spare is None
    # no backward to come (evaluation): the spare is neither taken nor refilled
    buffer.give_back(torch.empty(S, B, VP))
    spare = buffer._spare
    with torch.no_grad():
        d = local_logits(hidden, weight, 33, buffer)
    assert buffer._spare is spare and d.data_ptr() != spare.data_ptr()
    torch.testing.assert_close(d, _reference(hidden.detach(), weight.detach(), 33))


def test_disabled_buffer_keeps_nothing() -> None:
    buffer = LogitsBuffer(enabled=False)
    buffer.give_back(torch.empty(2, 2))
    assert buffer._spare is None
    taken = buffer.take((2, 2), torch.float32, torch.device("cpu"))
    assert taken.shape == (2, 2)
