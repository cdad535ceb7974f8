"""The fused ops as autograd functions: the compiled kernel when one is built for the device, else the reference.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``n`` heads, ``hn`` head dim, ``d`` rotated dims,
``f`` MLP width, ``N`` tokens, ``vp`` vocabulary columns of this TP rank.

Every public function takes ``fused``: False runs the PyTorch reference (``reference.py``, what the
``--no-*-fusion`` flags select); True runs the kernel when the device type has one built (``loader.extension``)
and the inputs are ones it handles (float32 / bfloat16 / float16, matching dtypes), else the reference as well.
The kernels see contiguous 2-D ``[rows, h]`` views; these wrappers make the views and restore the shapes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from megatron.fused_kernels import reference
from megatron.fused_kernels.arch import check_bf16_device
from megatron.fused_kernels.loader import extension

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernels_for(*tensors: torch.Tensor | None) -> ModuleType | None:
    """The extension that can run on ``tensors`` (same device type, kernel dtypes, one dtype), or None."""
    present = [t for t in tensors if t is not None]
    first = present[0]
    if first.dtype not in KERNEL_DTYPES or any(t.dtype != first.dtype for t in present):
        return None
    if any(t.device != first.device for t in present):
        return None
    if first.dtype == torch.bfloat16:
        check_bf16_device(first.device)  # Volta: no bf16 kernels, refused in one line
    return extension(first.device.type)


class _Unrecorded:
    """A stand-in for autograd's ctx when nothing is recorded (no_grad, e.g. generation): the forward runs alone,
    without an autograd node around it (about 10 us less per call)."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        return None


def _apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)``, or ``fn.forward`` alone when grad mode is off."""
    if torch.is_grad_enabled():
        return fn.apply(*args)
    return fn.forward(_Unrecorded(), *args)


def _empty_bias(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float, ext: Any
    ):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [*, h] -> [rows, h]
        y, mean, rstd = ext.layer_norm_fwd(x2, gamma.contiguous(), beta.contiguous(), eps)
        ctx.ext = ext
        ctx.save_for_backward(x2, mean, rstd, gamma)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        x2, mean, rstd, gamma = ctx.saved_tensors
        dx, dgamma, dbeta = ctx.ext.layer_norm_bwd(
            dy.reshape(x2.shape).contiguous(), x2, mean, rstd, gamma.contiguous()
        )
        return dx.view(dy.shape), dgamma, dbeta, None, None


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gamma: torch.Tensor, eps: float, ext: Any):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [*, h] -> [rows, h]
        y, rstd = ext.rms_norm_fwd(x2, gamma.contiguous(), eps)
        ctx.ext = ext
        ctx.save_for_backward(x2, rstd, gamma)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        x2, rstd, gamma = ctx.saved_tensors
        dx, dgamma = ctx.ext.rms_norm_bwd(
            dy.reshape(x2.shape).contiguous(), x2, rstd, gamma.contiguous()
        )
        return dx.view(dy.shape), dgamma, None, None


def _vectors(h: int, *params: torch.Tensor | None) -> bool:
    """Every given parameter is a vector of ``h`` values (what the kernels take)."""
    return all(p is None or (p.dim() == 1 and p.shape[0] == h) for p in params)


def layer_norm(
    x: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor | None,
    eps: float,
    *,
    fused: bool = True,
) -> torch.Tensor:
    """LayerNorm over the last dim: ``[*, h] -> [*, h]`` (see ``reference.layer_norm``)."""
    ok = beta is not None and _vectors(x.shape[-1], gamma, beta)
    ext = kernels_for(x, gamma, beta) if fused and ok else None
    if ext is None:
        return reference.layer_norm(x, gamma, beta, eps)
    return _apply(_LayerNorm, x, gamma, beta, eps, ext)


def rms_norm(
    x: torch.Tensor, gamma: torch.Tensor, eps: float, *, fused: bool = True
) -> torch.Tensor:
    """RMSNorm over the last dim: ``[*, h] -> [*, h]`` (see ``reference.rms_norm``)."""
    ext = kernels_for(x, gamma) if fused and _vectors(x.shape[-1], gamma) else None
    if ext is None:
        return reference.rms_norm(x, gamma, eps)
    return _apply(_RMSNorm, x, gamma, eps, ext)


@dataclass
class _Derived:
    """Tensors made from ``sources`` (held weakly, with their versions at the time) and ``key``."""

    sources: tuple[weakref.ref[torch.Tensor], ...]
    versions: tuple[int, ...]
    key: tuple[Any, ...]
    tensors: tuple[torch.Tensor, ...]

    def made_from(self, sources: tuple[torch.Tensor, ...], key: tuple[Any, ...]) -> bool:
        return (
            self.key == key
            and len(sources) == len(self.sources)
            and all(r() is t for r, t in zip(self.sources, sources, strict=True))
            and self.versions == tuple(t._version for t in sources)
        )


_DERIVED: dict[tuple[str, torch.device], _Derived] = {}
"""The last tensors each op made from its inputs on each device (see :func:`_derived`)."""


def _derived(
    name: str,
    sources: tuple[torch.Tensor, ...],
    key: tuple[Any, ...],
    make: Callable[[], tuple[torch.Tensor, ...]],
) -> tuple[torch.Tensor, ...]:
    """``make()``, or what it returned last time for the same ``name``, source tensors (the same objects, not
    modified since: their ``_version``) and ``key``.

    The model builds its RoPE tables and attention mask once per forward and hands the same tensors to every
    layer's q and k: the copies the kernels need (contiguous ``[s, b, d]`` tables, a contiguous mask) are made
    once per forward, not per call. One entry per op and device; it is dropped with its sources (weak
    references), so nothing outlives the forward that made it.
    """
    if any(t.is_inference() for t in sources):  # no version counter to check: made every time
        return make()
    slot = (name, sources[0].device)
    hit = _DERIVED.get(slot)
    if hit is not None and hit.made_from(sources, key):
        return hit.tensors
    tensors = make()

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        entry = _DERIVED.get(slot)
        if entry is not None and ref in entry.sources:
            del _DERIVED[slot]

    refs = tuple(weakref.ref(t, forget) for t in sources)
    _DERIVED[slot] = _Derived(refs, tuple(t._version for t in sources), key, tensors)
    return tensors


def _kernel_mask(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` ``[b or 1, 1, sq, sk]`` as the kernels read it: a mask broadcast over the batch (stride 0, what
    ``expand`` gives) is its first sample ``[1, 1, sq, sk]``, a view; any other non-contiguous mask is copied
    once per mask tensor (:func:`_derived`)."""
    if mask.shape[0] > 1 and mask.stride(0) == 0:
        mask = mask[:1]  # [b, 1, sq, sk] (stride 0 over b) -> [1, 1, sq, sk]
    if mask.is_contiguous():
        return mask
    return _derived(
        "mask", (mask,), (tuple(mask.shape), mask.stride()), lambda: (mask.contiguous(),)
    )[0]


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor | None, scale: float, ext: Any):
        if mask is None:
            y = ext.scaled_upper_triang_masked_softmax_fwd(x.contiguous(), scale)
        else:
            y = ext.scaled_masked_softmax_fwd(x.contiguous(), _kernel_mask(mask), scale)
        ctx.ext, ctx.scale = ext, scale
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        (y,) = ctx.saved_tensors
        dx = ctx.ext.scaled_masked_softmax_bwd(dy.contiguous(), y, ctx.scale)
        return dx, None, None, None


def scaled_upper_triang_masked_softmax(
    x: torch.Tensor, scale: float, *, fused: bool = True
) -> torch.Tensor:
    """Causal softmax of ``scale * x`` over ``[B, s, s]`` scores (column ``j > i`` gets 0)."""
    square = x.dim() == 3 and x.shape[1] == x.shape[2]
    ext = kernels_for(x) if fused and square else None
    if ext is None:
        return reference.scaled_upper_triang_masked_softmax(x, scale)
    return _apply(_Softmax, x, None, scale, ext)


def scaled_masked_softmax(
    x: torch.Tensor, mask: torch.Tensor, scale: float, *, fused: bool = True
) -> torch.Tensor:
    """Softmax of ``scale * x`` ``[b, n, sq, sk]`` where bool ``mask`` ``[b or 1, 1, sq, sk]`` is False.

    Fully masked rows give zeros.
    """
    shape_ok = (
        x.dim() == 4
        and mask.dim() == 4
        and mask.shape[0] in (1, x.shape[0])
        and mask.shape[1] == 1
        and mask.shape[2:] == x.shape[2:]
    )
    shape_ok = shape_ok and mask.dtype == torch.bool and mask.device == x.device
    ext = kernels_for(x) if fused and shape_ok else None
    if ext is None:
        return reference.scaled_masked_softmax(x, mask, scale)
    return _apply(_Softmax, x, mask, scale, ext)


class _BiasAct(torch.autograd.Function):
    """``bias_gelu`` / ``bias_swiglu``: the kernel computes ``dx`` and the bias grad (``dx`` summed over rows).

    ``into_dy`` (GeLU, where the extension has ``bias_gelu_bwd_into_dy``: the CPU one): ``dx`` is written over the
    incoming gradient instead of a new tensor (on CPU a fresh ``[rows, f]`` tensor costs page faults as long as the
    math)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, kind: str, ext: Any, into_dy: bool
    ):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [*, f] -> [rows, f]
        b = _empty_bias(x) if bias is None else bias.contiguous()
        y = getattr(ext, f"bias_{kind}_fwd")(x2, b)
        ctx.ext, ctx.kind, ctx.has_bias = ext, kind, bias is not None
        ctx.into_dy = into_dy and kind == "gelu" and hasattr(ext, "bias_gelu_bwd_into_dy")
        ctx.save_for_backward(x2, b)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        x2, b = ctx.saved_tensors
        dy2 = dy.reshape(
            x2.shape[0], dy.shape[-1]
        ).contiguous()  # [*, f'] -> [rows, f'] (rows may be 0)
        if ctx.into_dy:
            dx, dbias = dy2, ctx.ext.bias_gelu_bwd_into_dy(dy2, x2, b)
        else:
            dx, dbias = getattr(ctx.ext, f"bias_{ctx.kind}_bwd")(
                dy2, x2, b
            )  # dbias: empty without bias
        dbias = dbias if ctx.has_bias and ctx.needs_input_grad[1] else None
        return dx.view(*dy.shape[:-1], x2.shape[-1]), dbias, None, None, None


def bias_gelu(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    fused: bool = True,
    overwrite_grad: bool = False,
) -> torch.Tensor:
    """tanh-GeLU of ``x + bias``: ``[*, f] -> [*, f]``.

    ``overwrite_grad``: backward may write the input gradient over the incoming one (no new tensor). Only for
    callers that own that gradient, e.g. an MLP whose GeLU output feeds one matmul (its backward hands over a fresh
    tensor that nothing else reads); never where the output is used twice as the same tensor or by a user.
    """
    ext = kernels_for(x, bias) if fused and _vectors(x.shape[-1], bias) else None
    if ext is None:
        return reference.bias_gelu(x, bias)
    return _apply(_BiasAct, x, bias, "gelu", ext, overwrite_grad)


def bias_swiglu(x: torch.Tensor, bias: torch.Tensor | None, *, fused: bool = True) -> torch.Tensor:
    """``silu(a) * c`` for ``[a | c] = x + bias``: ``[*, 2f] -> [*, f]``."""
    even = x.shape[-1] % 2 == 0
    ext = kernels_for(x, bias) if fused and even and _vectors(x.shape[-1], bias) else None
    if ext is None:
        return reference.bias_swiglu(x, bias)
    return _apply(_BiasAct, x, bias, "swiglu", ext, False)


def rope_tables(
    cos: torch.Tensor, sin: torch.Tensor, s: int, b: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contiguous ``[s, b, d]`` tables the RoPE kernels read, from ``cos`` / ``sin`` ``[s, b or 1, 1, d]``.

    Made once per pair of table tensors (and ``s``, ``b``): q and k of every layer of a forward share them
    (:func:`_derived`; a table modified in place is copied again)."""

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        # [s, b or 1, 1, d] -> [s, b, 1, d] -> [s, b, d]
        cos3 = cos.expand(s, b, 1, cos.shape[-1]).reshape(s, b, -1).contiguous()
        sin3 = sin.expand(s, b, 1, sin.shape[-1]).reshape(s, b, -1).contiguous()
        return cos3, sin3

    cos3, sin3 = _derived("rope", (cos, sin), (s, b, cos.shape, sin.shape), make)
    return cos3, sin3


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ext: Any):
        cos3, sin3 = rope_tables(cos, sin, x.shape[0], x.shape[1])  # 2 x [s, b, d]
        ctx.ext = ext
        ctx.save_for_backward(cos3, sin3)
        return ext.rope_fwd(x.contiguous(), cos3, sin3)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        cos3, sin3 = ctx.saved_tensors
        return ctx.ext.rope_bwd(dy.contiguous(), cos3, sin3), None, None, None


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, fused: bool = True
) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[s, b, n, hn]`` with tables ``[s, b or 1, 1, d]`` (``d <= hn``)."""
    ext = kernels_for(x, cos, sin) if fused and x.dim() == 4 else None
    if ext is None or cos.requires_grad or sin.requires_grad:
        return reference.rope(x, cos, sin)
    return _apply(_Rope, x, cos, sin, ext)


def cross_entropy_kernels(logits: torch.Tensor) -> ModuleType | None:
    """The extension with ``ce_local_stats`` / ``ce_grad_inplace`` for these logits, or None (use the unfused
    ``mpu.cross_entropy``)."""
    return kernels_for(logits)
