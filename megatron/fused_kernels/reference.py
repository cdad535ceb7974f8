"""PyTorch references of every fused op: the CPU/GPU fallback when no kernel is built, and the tests' oracle.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``n`` heads, ``hn`` head dim, ``d`` rotated dims,
``f`` MLP width, ``N`` tokens (``s*b``), ``vp`` vocabulary columns of this TP rank.

Each function is the exact math of its kernel (``csrc/cpu``, ``csrc/cuda``), written with plain torch ops so
autograd gives the gradients. The model's unfused path (every ``--no-*-fusion`` flag) runs these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm(
    x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """``[*, h] -> [*, h]``: ``(x - mean) / sqrt(var + eps) * gamma + beta`` (biased variance)."""
    return F.layer_norm(x, (x.shape[-1],), gamma, beta, eps)


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """``[*, h] -> [*, h]``: ``x * rsqrt(mean(x^2) + eps)`` in fp32, cast to ``x``'s dtype, times ``gamma``."""
    xf = x.to(torch.float32)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return gamma * normed.to(x.dtype)


def scaled_upper_triang_masked_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``[B, s, s] -> [B, s, s]``: causal softmax of ``scale * x`` (column ``j > i`` masked, its probability 0)."""
    s = x.shape[-1]
    mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
    return torch.softmax((x * scale).masked_fill(mask, float("-inf")), dim=-1)


def scaled_masked_softmax(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``[b, n, sq, sk]`` scores, bool mask ``[b or 1, 1, sq, sk]`` (True = masked) -> probabilities.

    A row whose every column is masked gives zeros (a plain softmax would give NaN).
    """
    probs = torch.softmax((x * scale).masked_fill(mask, float("-inf")), dim=-1)
    return probs.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)


def gelu_tanh(u: torch.Tensor) -> torch.Tensor:
    """``0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3)))`` (torch's ``approximate="tanh"``)."""
    return F.gelu(u, approximate="tanh")


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``[*, f] -> [*, f]``: tanh-GeLU of ``x + bias`` (no bias: of ``x``)."""
    return gelu_tanh(x if bias is None else x + bias)


def bias_swiglu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``[*, 2f] -> [*, f]``: ``silu(a) * c`` with ``[a | c] = x + bias`` (gate first, then up)."""
    u = x if bias is None else x + bias
    gate, up = torch.chunk(u, 2, dim=-1)  # [*, 2f] -> 2 x [*, f]
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` on the last dim, where ``x1, x2`` are its halves."""
    x1, x2 = x.chunk(2, dim=-1)  # [..., d] -> 2 x [..., d/2]
    return torch.cat((-x2, x1), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, n, hn]`` by tables ``[s, b or 1, 1, d]`` (half-split convention).

    With ``d < hn`` (partial rotary) only ``x[..., :d]`` is rotated; ``x[..., d:]`` passes through.
    """
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :d], x[..., d:]  # [s, b, n, hn] -> [s, b, n, d], [s, b, n, hn - d]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)  # -> [s, b, n, hn]


def ce_local_stats(logits: torch.Tensor, local_target: torch.Tensor) -> torch.Tensor:
    """Per-row statistics of one vocabulary shard ``[N, vp]`` -> ``[N, 4]`` fp32.

    Columns: ``m = max_j z_j``, ``se = sum_j exp(z_j - m)``, ``zt = z_target - m`` (0 where ``local_target`` is
    -1, i.e. another rank owns the target), ``sz = sum_j (z_j - m)``.
    """
    z = logits.float()
    m = z.max(dim=-1).values  # [N]
    shifted = z - m.unsqueeze(-1)  # [N, vp]
    owned = local_target >= 0
    zt = shifted.gather(-1, local_target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    zt = zt.masked_fill(~owned, 0.0)
    sums = (shifted.double().exp().sum(-1), shifted.double().sum(-1))
    return torch.stack((m, sums[0].float(), zt, sums[1].float()), dim=-1)


def ce_grad_inplace(
    logits: torch.Tensor,
    local_target: torch.Tensor,
    global_max: torch.Tensor,
    log_sum_exp: torch.Tensor,
    smoothing: float,
    vocab_size: int,
    row_scale: torch.Tensor | None = None,
) -> None:
    """Overwrite ``logits`` ``[N, vp]`` with ``(softmax(z) - q) * row_scale`` (``q`` the smoothed one-hot target of
    this shard, ``row_scale`` ``[N]`` fp32 the upstream grad per row; None or empty: 1)."""
    p = (logits.float() - (global_max + log_sum_exp).unsqueeze(-1)).exp()  # [N, vp]
    owned = local_target >= 0
    rows = torch.nonzero(owned).squeeze(-1)
    p[rows, local_target[rows]] -= 1.0 - smoothing
    if smoothing > 0:
        p -= smoothing / vocab_size
    if row_scale is not None and row_scale.numel() > 0:
        p *= row_scale.unsqueeze(-1)
    logits.copy_(p)
