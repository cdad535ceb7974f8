"""DeepSpeed-Ulysses in the training step: the gradient scale ZeRO-3 needs (a DeepSpeed 0.19.8 inconsistency).

Each Ulysses rank's backward gives the gradient of its own ``s/N`` tokens' share of the whole-sequence loss
(``model.utils.loss_func``), so the true gradient is the SUM over the Ulysses group (and the mean over DP).
DeepSpeed 0.19.8 does exactly that in ZeRO 0, 1 and 2: it divides by ``(dp * N) / N = dp`` before all-reducing
over the sequence-data-parallel group (``engine._reduce_non_expert_gradients``, ``stage_1_and_2.average_tensor``).
ZeRO-3's default reduce-scatter path (``stage3.__avg_scatter_grads``, taken for every bucket while
``zero_optimization.reduce_scatter`` is true) averages over all ``dp * N`` ranks instead, so without a fix the
gradients are ``N`` times too small (measured: loss curves 2e-3 off the N = 1 run in 20 steps with Adam, where
only clipping and eps see the scale). Its other path (``__avg_scatter_contiguous_grads``) does apply ``N``, but is
chosen per bucket by size, so Trident pins ``reduce_scatter`` to true under ZeRO-3 + Ulysses
(``ds_config.py``) and multiplies the loss it back-propagates by ``N`` (:func:`ulysses_backward_scale`); the
reported loss is not scaled. With context parallelism (``--context-parallel-size cp``) ``loss_func`` multiplies the
backward by ``cp`` already (DeepSpeed divides by ``dp * cp`` in every ZeRO stage when it knows ``sp`` only), so
ZeRO-3's total factor is ``N = cp * sp``, the Ulysses rule with ``N`` the ranks a sequence is split over. The factor depends on DeepSpeed's code, so it runs only with the tested release
(``deepspeed_internals.check_deepspeed_version``); ``tests/training/test_ulysses.py`` checks it against N = 1.
"""

from __future__ import annotations

from typing import Any

from megatron.deepspeed_internals import check_deepspeed_version


def ulysses_backward_scale(engine: Any, size: int) -> float:
    """The factor the loss is multiplied by before ``engine.backward``: ``N`` under ZeRO-3 with Ulysses size
    ``size = N > 1`` (see the module docstring), else 1."""
    if size > 1 and engine.zero_optimization_stage() == 3:
        check_deepspeed_version()  # the factor compensates 0.19.8's averaging; another release may differ
        return float(size)
    return 1.0
