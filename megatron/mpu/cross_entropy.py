"""Cross-entropy over vocabulary-parallel logits, without gathering the ``[s, b, v]`` logits.

Legend: ``s`` sequence, ``b`` micro-batch, ``p`` TP size, ``v`` (padded) vocab, ``vp = v/p``.

Per token, with the logits ``z`` split over the TP ranks by vocabulary (rank r owns columns
``[r*vp, (r+1)*vp)``)::

    m = max_j z_j                       local max, all-reduce MAX
    Z = sum_j exp(z_j - m)              local sum, all-reduce SUM
    z_t - m                             picked by the rank owning the target, all-reduce SUM (others add 0)
    loss = log Z - (z_t - m)

Label smoothing ``alpha`` (Megatron's semantics): the target class gets probability ``1 - alpha`` and each of
the other ``v - 1`` classes ``alpha / (v - 1)``, i.e.
``loss = (1 - a') * nll - a' * mean_j log p_j`` with ``a' = alpha * v / (v - 1)``. This equals PyTorch's
``F.cross_entropy(..., label_smoothing=a')``. Here ``v`` is the GLOBAL vocab size (``sum_j log p_j`` is
all-reduced), so the loss does not depend on ``p``; upstream Megatron uses the per-rank ``vp`` there, which makes
its smoothed loss change with the TP degree (a known upstream bug, not reproduced). The average runs over every
column passed in, padded-vocabulary columns included.

Backward: ``d loss / d z = softmax(z) - q`` (q the smoothed target distribution), times the incoming grad.

Fused path (``local_kernels`` given, ``--cross-entropy-loss-fusion``, the default where the kernels are built):
one kernel pass per row of the shard gives the local ``m_r``, ``se_r = sum_j exp(z_j - m_r)``, ``z_t - m_r`` and
``sum_j (z_j - m_r)``; one all-reduce MAX gives ``m``, one all-reduce SUM of the rescaled
``[se_r e^(m_r - m), z_t - m_r + m_r - m, sum_j (z_j - m_r) + vp (m_r - m)]`` gives the three global sums. Forward
saves the logits buffer and three ``[N]`` vectors; backward makes one more kernel pass that writes
``(softmax(z) - q) * grad`` over the logits buffer itself (no softmax-sized tensor is allocated; the incoming grad is
applied in the same pass). So the logits passed in are overwritten by the backward (one backward per forward):
callers hand over a buffer nobody reads afterwards (the model's last-layer output); the write bumps the buffer's
autograd version, so another backward that saved it fails loudly instead of computing with gradients.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.mpu.mappings import all_reduce_max_, all_reduce_sum_
from megatron.mpu.parallel_state import ProcessGroup, group_rank, group_world_size, resolve_group
from megatron.mpu.utils import VocabUtility


def _targets_in_shard(
    target: torch.Tensor, vp: int, group: ProcessGroup | None, *, elsewhere: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(not_mine, local_target, v)``: where another TP rank owns the target, the target's column in this rank's
    ``vp`` columns (``elsewhere`` where it is not here), and the global vocabulary ``v = vp * p``."""
    world = group_world_size(group)
    first, last = VocabUtility.vocab_range_from_per_partition_vocab_size(
        vp, group_rank(group), world
    )
    not_mine = (target < first) | (target >= last)
    return not_mine, (target - first).masked_fill(not_mine, elsewhere), vp * world


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        label_smoothing: float,
        group: ProcessGroup | None,
    ) -> torch.Tensor:
        logits = vocab_parallel_logits.float()  # [s, b, vp], fp32 (a copy unless already fp32)
        logits_max = all_reduce_max_(logits.max(dim=-1).values, group)  # [s, b]
        logits = logits - logits_max.unsqueeze(-1)  # new tensor; the caller's logits are untouched
        # [s, b]: 0 where another rank owns the target (its logit is masked out below)
        not_mine, local_target, vocab_size = _targets_in_shard(
            target, logits.size(-1), group, elsewhere=0
        )
        # [s, b, vp] -> [s, b]: the target's logit (0 where another rank owns it, fixed below)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = all_reduce_sum_(predicted.masked_fill(not_mine, 0.0), group)

        exp_logits = logits.exp()  # [s, b, vp]
        sum_exp = all_reduce_sum_(exp_logits.sum(dim=-1), group)  # [s, b]
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - predicted  # [s, b]

        smoothing = 0.0
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            # sum_j log p_j = sum_j (z_j - m) - v * log Z
            sum_log_probs = all_reduce_sum_(logits.sum(dim=-1), group) - vocab_size * log_sum_exp
            loss = (1.0 - smoothing) * loss - smoothing * sum_log_probs / vocab_size

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))  # [s, b, vp]
        ctx.smoothing, ctx.vocab_size, ctx.input_dtype = (
            smoothing,
            vocab_size,
            vocab_parallel_logits.dtype,
        )
        ctx.save_for_backward(softmax, not_mine, local_target)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, not_mine, local_target = ctx.saved_tensors
        grad = softmax.clone()  # [s, b, vp]
        owned = (~not_mine).to(grad.dtype) * (1.0 - ctx.smoothing)  # [s, b]
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -owned.unsqueeze(-1))
        if ctx.smoothing > 0:
            grad.sub_(ctx.smoothing / ctx.vocab_size)
        grad.mul_(grad_output.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        label_smoothing: float,
        group: ProcessGroup | None,
        kernels: Any,
        needs_grad: bool,
    ) -> torch.Tensor:
        buffer = vocab_parallel_logits.contiguous()  # the caller's tensor itself when contiguous
        shape, vp = buffer.shape[:-1], buffer.size(-1)
        logits = buffer.view(-1, vp)  # [s, b, vp] -> [N, vp], the same memory
        # [N]: -1 where another rank owns the target (the kernels' convention)
        not_mine, local_target, vocab_size = _targets_in_shard(
            target.reshape(-1), vp, group, elsewhere=-1
        )

        stats = kernels.ce_local_stats(
            logits, local_target
        )  # [N, 4]: m_r, se_r, z_t - m_r, sum(z - m_r)
        local_max = stats[:, 0]
        global_max = all_reduce_max_(local_max.clone(), group)  # [N]
        shift = local_max - global_max  # m_r - m <= 0
        sums = torch.stack(
            (
                # a shard whose columns are all padding (-inf) adds nothing (its own sum is exp(nan))
                torch.where(torch.isneginf(local_max), 0.0, stats[:, 1] * shift.exp()),
                torch.where(not_mine, torch.zeros_like(shift), stats[:, 2] + shift),
                stats[:, 3] + vp * shift,
            ),
            dim=-1,
        )  # [N, 3]
        sums = all_reduce_sum_(sums, group)
        log_sum_exp = sums[:, 0].log()
        loss = log_sum_exp - sums[:, 1]  # [N]
        smoothing = 0.0
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            sum_log_probs = sums[:, 2] - vocab_size * log_sum_exp
            loss = (1.0 - smoothing) * loss - smoothing * sum_log_probs / vocab_size
        if needs_grad:  # (forward runs with grad mode off: the caller decides)
            ctx.kernels, ctx.smoothing, ctx.vocab_size = kernels, smoothing, vocab_size
            ctx.save_for_backward(buffer, local_target, global_max, log_sum_exp)
        return loss.view(shape)

    @staticmethod
    def backward(
        ctx: Any, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None, None, None]:
        buffer, local_target, global_max, log_sum_exp = ctx.saved_tensors
        logits = buffer.view(-1, buffer.size(-1))  # [s, b, vp] -> [N, vp], the same memory
        row_scale = grad_output.reshape(-1).float().contiguous()  # [s, b] -> [N]
        # (softmax - q) * grad, written over the logits
        ctx.kernels.ce_grad_inplace(
            logits, local_target, global_max, log_sum_exp, ctx.smoothing, ctx.vocab_size, row_scale
        )
        # tell autograd the buffer changed: another backward that saved these logits fails loudly
        torch.autograd.graph.increment_version(buffer)
        return buffer, None, None, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    group: ProcessGroup | None = None,
    *,
    local_kernels: Any = None,
) -> torch.Tensor:
    """Per-token cross-entropy loss from vocabulary-parallel logits.

    Args:
        vocab_parallel_logits: ``[s, b, vp]``, this TP rank's vocabulary columns (any float dtype; math in fp32).
            Callers mask padded-vocabulary columns themselves if they must not count.
        target: ``[s, b]`` integer ids in ``[0, v)``, identical on every TP rank.
        label_smoothing: ``alpha`` in ``[0, 1)``; see the module docstring for the exact semantics.
        group: the TP group (default: the one from parallel_state).
        local_kernels: None for the unfused path; else the module with the fused local passes
            (``ce_local_stats``, ``ce_grad_inplace``; ``megatron.fused_kernels.cross_entropy_kernels``). The fused
            path's backward overwrites ``vocab_parallel_logits`` with their gradient.

    Returns:
        ``[s, b]`` fp32 loss; the caller reduces it (e.g. masked mean). Backward gives the logits' grad in
        their dtype.

    Raises:
        ValueError: shapes disagree, ``label_smoothing`` outside ``[0, 1)``, or a target outside ``[0, v)``.
    """
    group = resolve_group(group)
    if target.shape != vocab_parallel_logits.shape[:-1]:
        raise ValueError(
            f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} must equal the logits shape "
            f"without its last (vocab) dim, {tuple(vocab_parallel_logits.shape[:-1])}"
        )
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(
            f"vocab_parallel_cross_entropy: label_smoothing ({label_smoothing}) must be in [0, 1)"
        )
    vocab_size = vocab_parallel_logits.size(-1) * group_world_size(group)
    if label_smoothing > 0 and vocab_size < 2:
        raise ValueError(
            "vocab_parallel_cross_entropy: label smoothing needs a vocabulary of at least 2"
        )
    if target.numel() and bool(((target < 0) | (target >= vocab_size)).any()):
        bad = target[(target < 0) | (target >= vocab_size)][0]
        raise ValueError(
            f"vocab_parallel_cross_entropy: target id {int(bad)} is outside the vocabulary [0, {vocab_size}); "
            "check the labels and the padded vocab size"
        )
    if local_kernels is not None:
        needs_grad = torch.is_grad_enabled() and vocab_parallel_logits.requires_grad
        return _FusedVocabParallelCrossEntropy.apply(
            vocab_parallel_logits, target, label_smoothing, group, local_kernels, needs_grad
        )
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, group)
