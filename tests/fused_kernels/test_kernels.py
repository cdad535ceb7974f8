"""Every fused op, kernel vs its PyTorch reference: forward and every gradient, fp32 / bf16 / fp16, on shapes that
break naive kernels. CPU always (the extension must be built: a test that compared the reference with itself could
not fail); the same checks on CUDA under the ``gpu`` marker.

Error measure: ``max|kernel - reference| / max|reference|`` per tensor. fp32 bound 1e-6 on CPU (the kernels sum in
another order than ATen: a few fp32 roundings of the largest term, ~1e-7), bf16/fp16 bound 1e-2 (8 / 11 mantissa
bits: one rounding is 4e-3 / 5e-4, and a kernel rounds once where the reference rounds after each op).

fp32 on CUDA (:func:`_tol`): the device's ``tanhf`` / ``expf`` / ``rsqrtf`` are accurate to 2 ulp (CUDA C++
Programming Guide, "Mathematical Functions", maximum ulp error) and the GPU reduces in yet another order. Norms,
softmax, RoPE and cross-entropy: 2 ulp is 2.4e-7 relative per value, scaled by at most a few in these formulas, on
top of the CPU's ~1e-7 of reordering: 2e-6. The GeLU backward (``csrc/cuda/activations.cu``) forms ``1 - t^2``
from ``t = tanhf(z)`` (the CPU kernel uses ``4 s (1 - s)``, ``s = sigmoid(2z)``, with no cancellation), and
``d dgelu / dt = -u k0 (1 + 3 k1 u^2) t`` reaches ~10 where ``t`` is not yet 1 in fp32: 2 ulp of ``t`` (1.2e-7
absolute for ``t`` in [0.5, 1)) move ``dgelu`` by up to 2.3e-6 (the maximum over u, at u = 5.2, where ``dgelu`` is
1.0), i.e. 2.3e-6 of ``max|dx|``; the bias gradient sums such errors over the rows: 1e-5 for the activations
(SwiGLU's ``expf`` enters damped through ``sigmoid``: < 1e-7). A wrong formula or index errs by 1e-3 or more, so
the bounds still catch every real bug.
"""

from __future__ import annotations

import math
import mmap
import os

import pytest
import torch

from megatron import fused_kernels as fk
from megatron.fused_kernels import reference

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-2}
CUDA_FP32_TOL = {"default": 2e-6, "activation": 1e-5}  # see the module docstring
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tol(dtype: torch.dtype, device: str | torch.device, kind: str = "default") -> float:
    """The error bound of ``dtype`` on ``device`` (``kind`` 'activation': GeLU / SwiGLU)."""
    if dtype == torch.float32 and torch.device(device).type == "cuda":
        return CUDA_FP32_TOL[kind]
    return TOL[dtype]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


@pytest.fixture(autouse=True)
def _kernels_present(request: pytest.FixtureRequest) -> None:
    device = (
        request.node.callspec.params.get("device", "cpu")
        if hasattr(request.node, "callspec")
        else "cpu"
    )
    if os.environ.get("TRIDENT_NO_KERNELS") == "1":
        pytest.skip("TRIDENT_NO_KERNELS=1: nothing to compare")
    assert fk.extension(device) is not None, f"no fused kernels for {device}: {fk.status()}"


def _check(  # type: ignore[no-untyped-def]
    fn,
    inputs: list[torch.Tensor],
    dtype: torch.dtype,
    *,
    floor: dict[int, float] | None = None,
    kind: str = "default",
) -> None:
    """``fn(*inputs, fused=...)``: output and the grads of every floating input, the kernel (``fused=True``, in
    ``dtype``) against the reference evaluated in float64 (the exact math; PyTorch's own fp32 composite is itself
    up to ~2e-6 from it in places). ``floor[i]``: a scale below which tensor ``i``'s error is measured absolutely
    (a gradient that is a difference of nearly equal terms). ``kind``: which bound of :func:`_tol`."""
    tol = _tol(dtype, inputs[0].device, kind)
    outs = {}
    for fused in (True, False):
        leaves = [
            (t.detach().clone() if fused else t.detach().double()).requires_grad_(
                t.is_floating_point()
            )
            if t.is_floating_point()
            else t
            for t in inputs
        ]
        y = fn(*leaves, fused=fused)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(0)).to(y.device, y.dtype)
        y.backward(g)
        outs[fused] = [y.detach()] + [t.grad for t in leaves if t.is_floating_point()]
    for i, (got, want) in enumerate(zip(outs[True], outs[False], strict=True)):
        assert got is not None and want is not None, i
        assert got.shape == want.shape and got.dtype == dtype, (i, got.shape, want.shape, got.dtype)
        assert torch.isfinite(got).all(), f"tensor {i}: non-finite values"
        scale = max(want.abs().max().item(), (floor or {}).get(i, 0.0), 1e-30)
        err = (got.double() - want).abs().max().item() / scale
        assert err <= tol, f"tensor {i} (0 = output, then input grads): rel. error {err:.2e}"


def _randn(
    *shape: int, dtype: torch.dtype, device: str, seed: int, scale: float = 1.0
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [1, 7, 96, 5120])
def test_norms(device: str, dtype: torch.dtype, h: int) -> None:
    rows = 1 if h == 5120 else 33
    x = _randn(rows, 3, h, dtype=dtype, device=device, seed=h, scale=2.0) + 0.5
    gamma = _randn(h, dtype=dtype, device=device, seed=h + 1) + 1.0
    beta = _randn(h, dtype=dtype, device=device, seed=h + 2)
    # h = 1: LayerNorm's dx is exactly 0 (x - mean = 0); the float64 reference leaves ~1e-17 of rounding
    # and so is dgamma = sum(dy * xhat): measure both against their terms' natural scales
    ln_floor = (
        {1: (gamma.double().abs().max() * 4 / math.sqrt(1e-5)).item(), 2: 4.0 * x.numel()}
        if h == 1
        else None
    )
    _check(
        lambda x, g, b, fused: fk.layer_norm(x, g, b, 1e-5, fused=fused),
        [x, gamma, beta],
        dtype,
        floor=ln_floor,
    )
    # h = 1: dx = rstd * g * (1 - xhat^2) cancels to ~eps/|x|^3; measure it against rstd * |dy * gamma|
    floor = (
        {1: (gamma.double().abs().max() * 4 / x.double().abs().min()).item()} if h == 1 else None
    )
    _check(lambda x, g, fused: fk.rms_norm(x, g, 1e-5, fused=fused), [x, gamma], dtype, floor=floor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_with_streamed_outputs(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The norms write outputs of the extension's ``stream_bytes`` and more with streaming stores, where their pages
    are resident (``TRIDENT_STREAMING_STORES=1``: always): the same values, with rows of h = 769 starting at every
    alignment (the plain head and tail of each row)."""
    ext = fk.extension("cpu")
    esize = torch.empty(0, dtype=dtype).element_size()
    if ext.build_info() == "default":
        pytest.skip("the default flavour has no streaming stores")
    # the decision: size, then residency (an untouched anonymous mapping's pages are not there yet), then the
    # override
    big = ext.stream_bytes // esize + 4096
    monkeypatch.delenv("TRIDENT_STREAMING_STORES", raising=False)
    assert not ext.worth_streaming(torch.ones(big // 2, dtype=dtype))
    mapping = mmap.mmap(-1, big * esize)
    fresh = torch.frombuffer(mapping, dtype=dtype)
    assert not ext.worth_streaming(fresh)
    fresh.fill_(1.0)
    assert ext.worth_streaming(fresh)
    monkeypatch.setenv("TRIDENT_STREAMING_STORES", "0")
    assert not ext.worth_streaming(fresh)
    del fresh
    mapping.close()
    monkeypatch.setenv("TRIDENT_STREAMING_STORES", "1")
    assert ext.worth_streaming(torch.empty(big, dtype=dtype))

    h = 769
    rows = ext.stream_bytes // (h * esize) + 1
    x = _randn(rows, h, dtype=dtype, device="cpu", seed=11, scale=2.0) + 0.5
    gamma = _randn(h, dtype=dtype, device="cpu", seed=12) + 1.0
    beta = _randn(h, dtype=dtype, device="cpu", seed=13)
    # dgamma / dbeta sum thousands of rows here: one running fp32 sum drifted 1.2e-6 from float64 on one thread
    _check(
        lambda x, g, b, fused: fk.layer_norm(x, g, b, 1e-5, fused=fused), [x, gamma, beta], dtype
    )
    _check(lambda x, g, fused: fk.rms_norm(x, g, 1e-5, fused=fused), [x, gamma], dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", [1, 7, 128, 300])
def test_causal_softmax(device: str, dtype: torch.dtype, s: int) -> None:
    x = _randn(6, s, s, dtype=dtype, device=device, seed=s, scale=3.0)
    scale = 1.0 / math.sqrt(64)
    _check(
        lambda x, fused: fk.scaled_upper_triang_masked_softmax(x, scale, fused=fused), [x], dtype
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("sq", "sk", "bm"), [(1, 1, 1), (7, 13, 2), (64, 200, 1), (5, 1025, 2)])
def test_masked_softmax(device: str, dtype: torch.dtype, sq: int, sk: int, bm: int) -> None:
    b, n = 2, 3
    x = _randn(b, n, sq, sk, dtype=dtype, device=device, seed=sk, scale=3.0)
    gen = torch.Generator().manual_seed(sq)
    mask = (torch.rand(bm, 1, sq, sk, generator=gen) < 0.4).to(device)
    mask[..., 0, :] = True  # a fully masked row: zeros, not NaN
    _check(lambda x, fused: fk.scaled_masked_softmax(x, mask, 0.125, fused=fused), [x], dtype)
    y = fk.scaled_masked_softmax(x, mask, 0.125)
    assert torch.equal(y[..., 0, :], torch.zeros_like(y[..., 0, :]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f", [1, 7, 96, 5120])
def test_bias_activations(device: str, dtype: torch.dtype, f: int) -> None:
    rows = 3 if f == 5120 else 41
    x = _randn(rows, 2, f, dtype=dtype, device=device, seed=f, scale=2.0)
    bias = _randn(f, dtype=dtype, device=device, seed=f + 1)
    act = {"kind": "activation"}
    _check(lambda x, b, fused: fk.bias_gelu(x, b, fused=fused), [x, bias], dtype, **act)
    _check(lambda x, fused: fk.bias_gelu(x, None, fused=fused), [x], dtype, **act)
    x2 = _randn(rows, 2, 2 * f, dtype=dtype, device=device, seed=f + 2, scale=2.0)
    bias2 = _randn(2 * f, dtype=dtype, device=device, seed=f + 3)
    _check(lambda x, b, fused: fk.bias_swiglu(x, b, fused=fused), [x2, bias2], dtype, **act)
    _check(lambda x, fused: fk.bias_swiglu(x, None, fused=fused), [x2], dtype, **act)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_bias_grad_makes_no_fp32_copy_of_dx(kind: str) -> None:
    """The CUDA backward sums the bias gradient in fp32 straight from the bf16 ``dx`` (``sum`` with an fp32
    dtype): its peak is ``dx`` plus small change, where ``dx.to(float32).sum()`` added an fp32 copy (2x ``dx``)."""
    assert fk.extension("cuda") is not None, fk.status()
    rows, width = 4096, 4096 if kind == "gelu" else 2 * 2048
    x = _randn(rows, width, dtype=torch.bfloat16, device="cuda", seed=5).requires_grad_()
    bias = _randn(width, dtype=torch.bfloat16, device="cuda", seed=6).requires_grad_()
    y = fk.bias_gelu(x, bias) if kind == "gelu" else fk.bias_swiglu(x, bias)
    g = torch.ones_like(y)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y.backward(g)
    torch.cuda.synchronize()
    dx_bytes = x.numel() * x.element_size()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 1.5 * dx_bytes, (peak, dx_bytes)  # with the fp32 copy: >= 3x dx_bytes
    assert bias.grad is not None and bias.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("s", "b", "hn", "d"), [(1, 1, 2, 2), (5, 3, 8, 8), (17, 2, 64, 32), (9, 2, 128, 128)]
)
def test_rope(device: str, dtype: torch.dtype, s: int, b: int, hn: int, d: int) -> None:
    from megatron.model.rotary import rotary_cos_sin

    x = _randn(s, b, 4, hn, dtype=dtype, device=device, seed=hn)
    positions = torch.arange(s, device=device).repeat(b, 1) + 3  # [b, s]
    cos, sin = rotary_cos_sin(positions, d, 10000.0, dtype)  # [s, b, 1, d]
    _check(lambda x, fused: fk.rope(x, cos, sin, fused=fused), [x], dtype)
    # tables broadcast over the batch ([s, 1, 1, d]) and a strided q view as the model passes them
    qkv = _randn(s, b, 3, 4, hn, dtype=dtype, device=device, seed=hn + 1)
    _check(lambda x, fused: fk.rope(x[:, :, 0], cos[:, :1], sin[:, :1], fused=fused), [qkv], dtype)


CE_STAT_COLUMNS = ("m", "se", "zt", "sz")


def _check_ce_stats(got: torch.Tensor, want: torch.Tensor, device: str | torch.device) -> None:
    """``ce_local_stats`` ``[N, 4]`` against the reference, each column on its own scale (one bound over the
    stacked columns would be set by ``sz``, ~1e6, and let ``m``, ``se`` and ``zt`` be off by 0.1 and pass):

    - ``m``: the max of the same fp32 values: exact.
    - ``zt = z_t - m``: one fp32 subtraction in both: within one rounding, 2^-23 (|z_t| + |m|) of the row.
    - ``se``: per row relative; a sum of ``exp`` terms <= 1 accumulated in double, each term within a few ulp
      (CPU ``exp_u20`` <= 4 ulp, measured <= 2.3e-7; CUDA ``expf`` 2 ulp): the fp32 bound of :func:`_tol`.
    - ``sz``: per row relative; a double sum of ``vp`` non-positive terms each rounded once (measured <= 7e-8):
      the fp32 bound of :func:`_tol`.
    """
    assert got.shape == want.shape and got.dtype == torch.float32, (got.shape, got.dtype)
    g, w = got.double(), want.double()
    err = (g - w).abs()
    rel = _tol(torch.float32, device)
    bounds = {
        "m": torch.zeros_like(w[:, 0]),
        "zt": 2.0**-23 * (w[:, 2].abs() + w[:, 0].abs()),
        "se": rel * w[:, 1].abs(),
        "sz": rel * w[:, 3].abs(),
    }
    for c, name in enumerate(CE_STAT_COLUMNS):
        over = err[:, c] - bounds[name]
        assert (over <= 0).all(), (
            f"ce_local_stats column {name}: error {err[:, c].max().item():.3e} over its bound in row "
            f"{over.argmax().item()}"
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "vp"), [(1, 50304), (37, 25152), (64, 12576), (5, 7)])
def test_cross_entropy_local_passes(device: str, dtype: torch.dtype, n: int, vp: int) -> None:
    """The two local passes against their references (the composed loss is tested on gloo ranks); the gradient
    pass gets the statistics the kernel computed, as in the model."""
    ext = fk.cross_entropy_kernels(torch.empty(0, device=device, dtype=dtype))
    assert ext is not None
    z = _randn(n, vp, dtype=dtype, device=device, seed=vp, scale=4.0)
    gen = torch.Generator().manual_seed(n)
    target = torch.randint(-1, vp, (n,), generator=gen).to(
        device
    )  # -1: another rank owns the target
    stats = ext.ce_local_stats(z, target)
    _check_ce_stats(stats, reference.ce_local_stats(z, target), device)
    # as global max and log-sum-exp: shifted, as another rank's larger max would shift them
    m = stats[:, 0] + 0.25
    lse = stats[:, 1].log() - 0.25
    tol = _tol(dtype, device)
    # the upstream grad per row: none (empty = 1), or mixed with 0 (a masked token) and a negative value
    scales = [
        torch.empty(0, device=device),
        torch.linspace(-1.0, 2.0, n, device=device).index_fill_(
            0, torch.tensor([0], device=device), 0.0
        ),
    ]
    for smoothing in (0.0, 0.1):
        for scale in scales:
            a, b = z.clone(), z.clone()
            ext.ce_grad_inplace(a, target, m, lse, smoothing, 4 * vp, scale)
            reference.ce_grad_inplace(b, target, m, lse, smoothing, 4 * vp, scale)
            assert _rel(a, b) <= tol, (smoothing, scale.numel(), _rel(a, b))
        if n > 1:  # the scaled gradient is the unit one times the row's scale
            unit, scaled = z.clone(), z.clone()
            ext.ce_grad_inplace(unit, target, m, lse, smoothing, 4 * vp, scales[0])
            ext.ce_grad_inplace(scaled, target, m, lse, smoothing, 4 * vp, scales[1])
            want = (unit.float() * scales[1].unsqueeze(-1)).to(dtype)
            assert _rel(scaled, want) <= tol
            assert not scaled[0].any()


@pytest.mark.parametrize("column", range(4))
def test_ce_stats_check_catches_one_column_off(column: int) -> None:
    """:func:`_check_ce_stats` fails when any single column is off: ``m``, ``se``, ``zt`` by 0.1, where the former
    measure (one relative error over the stacked columns, scaled by ``sz``'s ~1e6) passed them; ``sz`` by 1e-5 of
    itself (0.1 is below one fp32 ulp of ~1e6)."""
    z = _randn(4, 50304, dtype=torch.float32, device="cpu", seed=3, scale=4.0)
    target = torch.tensor([0, 17, -1, 50303])
    want = reference.ce_local_stats(z, target)
    bad = want.clone()
    bad[1, column] += 0.1 if CE_STAT_COLUMNS[column] != "sz" else 1e-5 * bad[1, column]
    _check_ce_stats(want.clone(), want, "cpu")  # the exact statistics pass
    with pytest.raises(AssertionError, match=f"column {CE_STAT_COLUMNS[column]}:"):
        _check_ce_stats(bad, want, "cpu")
    if CE_STAT_COLUMNS[column] != "sz":
        assert _rel(bad, want) <= 1e-6  # the former check: blind to it


def _nan_scores(dtype: torch.dtype, device: str, sk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked-softmax scores ``[1, 2, 7, sk]`` and mask ``[1, 1, 7, sk]`` with one non-finite case per row: 0 fully
    masked (with a NaN), 1 a kept NaN, 2 a NaN only where masked, 3 the only kept score NaN, 4 a kept +inf,
    5 every kept score -inf, 6 the kept scores -inf and NaN."""
    nan, inf = float("nan"), float("inf")
    x = torch.randn(1, 2, 7, sk, generator=torch.Generator().manual_seed(sk))
    mask = torch.zeros(1, 1, 7, sk, dtype=torch.bool)
    mask[..., 0, :] = True
    x[..., 0, 1] = nan
    x[..., 1, sk // 2] = nan
    mask[..., 2, 3] = True
    x[..., 2, 3] = nan
    mask[..., 3, :-1] = True
    x[..., 3, -1] = nan
    x[..., 4, 2] = inf
    mask[..., 5, ::2] = True
    x[..., 5, 1::2] = -inf
    mask[..., 6, :] = True
    mask[..., 6, [1, sk - 2]] = False
    x[..., 6, 1], x[..., 6, sk - 2] = -inf, nan
    return x.to(device=device, dtype=dtype), mask.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sk", [5, 40])
def test_softmax_non_finite_scores_like_the_reference(
    device: str, dtype: torch.dtype, sk: int
) -> None:
    """A NaN (or +inf) score, or only -inf scores, in a row's kept columns: NaN in every column of that row, as
    the reference gives (so the NaN guard sees a diverged run with ``--no-flash-attn``); a NaN where masked, or
    in a fully masked row, changes nothing. Masked and causal; sk = 5 (scalar tails) and 40 (vector paths)."""

    def same(got: torch.Tensor, want: torch.Tensor) -> None:
        assert torch.equal(got.isnan(), want.isnan()), (got.isnan().sum(-1), want.isnan().sum(-1))
        assert _rel(got.nan_to_num(0.0), want.nan_to_num(0.0)) <= _tol(dtype, device)

    x, mask = _nan_scores(dtype, device, sk)
    same(fk.scaled_masked_softmax(x, mask, 0.5), reference.scaled_masked_softmax(x, mask, 0.5))
    xc = torch.randn(3, sk, sk, generator=torch.Generator().manual_seed(sk + 1))
    xc[0, 3, 1] = float("nan")  # a kept NaN: the whole row, the zero part after the diagonal too
    xc[0, 2, sk - 1] = float("nan")  # above the diagonal: ignored
    xc[1, 1, 0] = float("inf")
    xc[1, 2, :3] = float("-inf")  # every kept score -inf
    xc[2, sk - 1, 0] = float("nan")
    xc = xc.to(device=device, dtype=dtype)
    same(
        fk.scaled_upper_triang_masked_softmax(xc, 0.5),
        reference.scaled_upper_triang_masked_softmax(xc, 0.5),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_gelu_grad_written_over_the_incoming_one(dtype: torch.dtype) -> None:
    """``overwrite_grad=True`` (the MLP's call): the same x and bias gradients, bit for bit; on CPU the input
    gradient is the incoming gradient's own buffer (no new tensor); the default leaves the incoming one intact."""
    x = _randn(16, 3, 40, dtype=dtype, device="cpu", seed=7, scale=3.0)
    bias = _randn(40, dtype=dtype, device="cpu", seed=8)
    grads = []
    for overwrite in (False, True):
        xg, bg = x.clone().requires_grad_(), bias.clone().requires_grad_()
        g = _randn(16, 3, 40, dtype=dtype, device="cpu", seed=9)
        g_before = g.clone()
        fk.bias_gelu(xg, bg, overwrite_grad=overwrite).backward(g)
        grads.append((xg.grad, bg.grad))
        assert (xg.grad.data_ptr() == g.data_ptr()) == overwrite
        assert torch.equal(g, g_before) != overwrite
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_fused_flag_off_is_the_reference() -> None:
    """``fused=False`` runs the reference exactly (what every --no-*-fusion flag selects)."""
    x = _randn(4, 2, 96, dtype=torch.float32, device="cpu", seed=1)
    g = torch.ones(96)
    assert torch.equal(fk.rms_norm(x, g, 1e-5, fused=False), reference.rms_norm(x, g, 1e-5))
    assert torch.equal(fk.bias_gelu(x, None, fused=False), reference.bias_gelu(x, None))
    # and fused=True really runs the kernel (its autograd node), not the reference
    xg = x.clone().requires_grad_()
    assert type(fk.rms_norm(xg, g, 1e-5).grad_fn).__name__ == "_RMSNormBackward"
    assert type(fk.bias_gelu(xg, None).grad_fn).__name__ == "_BiasActBackward"
    assert type(fk.rms_norm(xg, g, 1e-5, fused=False).grad_fn).__name__ != "_RMSNormBackward"
