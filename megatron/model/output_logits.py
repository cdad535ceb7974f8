"""The local logits matmul ``[s, b, h] x [vp, h] -> [s, b, vp]`` with the padded columns masked in place, and the
recycled CPU buffer it can write into.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``vp`` this TP rank's (padded) vocabulary columns.

Why a function of its own instead of ``F.linear`` then ``masked_fill``:

- ``masked_fill`` is out of place, so a padded vocabulary (GPT-2's 50257 -> 50304) cost a second logits-sized
  tensor in forward and a third in backward (its gradient). Here the ``-inf`` is written into the matmul's output
  and the padded columns of the gradient are zeroed in place when that gradient is the logits buffer itself (the
  fused cross-entropy writes its gradient there), out of place otherwise.
- On CPU every fresh logits tensor is ``mmap``-ed and page-faulted in again each step (glibc serves blocks above
  its 32 MiB mmap threshold that way): measured on the 2-core box, ``[2048, 256] x [256, 8192]`` takes 43 ms into a
  fresh tensor and 27 ms into a warm one. :class:`LogitsBuffer` keeps the last step's logits memory for the next
  one (CUDA's caching allocator already does; the buffer is off there).

When a buffer may be reused: it is handed back only by this function's backward, and only when the gradient that
arrives is that very memory, i.e. the fused cross-entropy consumed the logits in place (their values are already
the gradient; nothing can expect logits there). A forward without a backward (evaluation, generation, a failed
step) never hands it back, and the next forward then allocates a fresh one; two forwards in flight (pipeline
micro-batches) get two tensors. So a buffer is never written while anything can still read it as logits.
"""

from __future__ import annotations

from typing import Any

import torch


class LogitsBuffer:
    """At most one spare logits tensor, kept between a backward and the next forward (CPU only).

    Args:
        enabled: False (the default on CUDA) makes :meth:`take` always allocate and :meth:`give_back` drop.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._spare: torch.Tensor | None = None

    @property
    def spare(self) -> torch.Tensor | None:
        """The tensor kept for the next :meth:`take`, None when none is (read-only: memory accounting)."""
        return self._spare

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The spare tensor when it fits (``shape``, ``dtype``, ``device``), else a new empty one; the spare is
        given up either way (it is the caller's now, or no longer the right size)."""
        spare, self._spare = self._spare, None
        if (
            spare is not None
            and tuple(spare.shape) == tuple(shape)
            and spare.dtype == dtype
            and spare.device == device
        ):
            return spare
        return torch.empty(shape, dtype=dtype, device=device)

    def give_back(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor``'s memory for the next :meth:`take` (detached: no graph is kept alive through it)."""
        if self.enabled:
            self._spare = tensor.detach()

    def clear(self) -> None:
        """Drop the spare tensor (its memory goes back to the allocator)."""
        self._spare = None


class _LocalLogits(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        pad_from: int,
        buffer: LogitsBuffer | None,
    ) -> torch.Tensor:
        s, b, h = hidden.shape
        vp = weight.shape[0]
        out = (
            buffer.take((s, b, vp), hidden.dtype, hidden.device)
            if buffer is not None
            else torch.empty((s, b, vp), dtype=hidden.dtype, device=hidden.device)
        )
        torch.mm(
            hidden.reshape(-1, h), weight.t(), out=out.view(-1, vp)
        )  # [s*b, h] x [h, vp] -> [s*b, vp]
        if pad_from < vp:
            out[..., pad_from:] = float("-inf")
        ctx.save_for_backward(hidden, weight)
        ctx.pad_from, ctx.out_ptr = pad_from, out.data_ptr()
        ctx.buffer = buffer
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight = ctx.saved_tensors
        s, b, h = hidden.shape
        vp = weight.shape[0]
        # the logits memory itself came back (the fused cross-entropy wrote its gradient over it)
        own = grad.data_ptr() == ctx.out_ptr and grad.is_contiguous() and grad.shape == (s, b, vp)
        if ctx.pad_from < vp:
            if not own:
                grad = grad.clone(memory_format=torch.contiguous_format)
            # padded columns pass no gradient back, whatever the loss did there
            grad[..., ctx.pad_from :] = 0.0
        flat = grad.reshape(-1, vp)  # [s, b, vp] -> [s*b, vp]
        d_hidden = d_weight = None
        if ctx.needs_input_grad[0]:
            d_hidden = torch.mm(flat, weight).view(s, b, h)  # [s*b, vp] x [vp, h] -> [s, b, h]
        if ctx.needs_input_grad[1]:
            d_weight = torch.mm(flat.t(), hidden.reshape(-1, h))  # [vp, s*b] x [s*b, h] -> [vp, h]
        if own and ctx.buffer is not None:
            ctx.buffer.give_back(grad)
        return d_hidden, d_weight, None, None


def local_logits(
    hidden: torch.Tensor, weight: torch.Tensor, pad_from: int, buffer: LogitsBuffer | None = None
) -> torch.Tensor:
    """``hidden [s, b, h] x weight [vp, h]^T -> [s, b, vp]``, columns ``>= pad_from`` set to ``-inf``.

    Same values as ``F.linear(hidden, weight).masked_fill(cols >= pad_from, -inf)`` and the same gradients (padded
    columns pass none back). ``buffer``: where the logits may live when a backward will follow (grad mode on and
    an input that requires grad; see the module docstring); ignored otherwise.
    """
    training = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LocalLogits.apply(hidden, weight, pad_from, buffer if training else None)
