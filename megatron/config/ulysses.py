"""Rules of DeepSpeed-Ulysses sequence parallelism (``--ds-sequence-parallel-size N``), checked by ``validate()``.

Ulysses splits every micro-batch's sequence over ``N`` ranks (``s/N`` tokens each) and, inside attention, trades
the sequence split for a head split with one all-to-all (``[s/N, b, n/p, hn] -> [s, b, n/(p N), hn]``), so:

- the sequence length divides by ``N`` (every rank holds the same number of tokens);
- the query heads and the key/value heads of each TP rank divide by ``N`` (``n/p`` and ``g/p``);
- the world size divides by ``TP x PP x N`` (data-parallel size = world / (TP x PP x N)).

What composes (as Megatron-DeepSpeed, plus tensor parallelism): data parallelism, ZeRO 0-3, Megatron tensor
parallelism. What is refused by name: pipeline parallelism (DeepSpeed's pipeline engine has no sequence axis in its
grid, and Megatron-DeepSpeed asserts PP = 1 with Ulysses), Megatron's ``--sequence-parallel`` (Megatron-DeepSpeed
refuses the two together), and FPDT (refused in ``refused.py``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megatron.config.rules import choice_list, divisors

if TYPE_CHECKING:
    from megatron.config.arguments import TridentConfig

_FLAG = "--ds-sequence-parallel-size"


def check_ulysses(cfg: TridentConfig, world_size: int) -> None:
    """Raise ``ValueError`` when ``--ds-sequence-parallel-size`` does not fit the model, the flags or the world.

    Args:
        cfg: the run's config (only ``cfg.parallel`` and ``cfg.model`` are read).
        world_size: the number of processes.

    Raises:
        ValueError: one message naming the flag, its value, the rule with the other values, and the fix.
    """
    p, m = cfg.parallel, cfg.model
    sp, tp, pp = (
        p.ds_sequence_parallel_size,
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
    )
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise ValueError(f"{_FLAG} ({sp}) must be a positive integer (1 turns Ulysses off).")
    if sp == 1:
        return
    if pp > 1:
        raise ValueError(
            f"{_FLAG} {sp} with --pipeline-model-parallel-size {pp} is not supported: DeepSpeed's pipeline engine "
            "has no sequence-parallel axis (Megatron-DeepSpeed refuses the two together too); use "
            f"--pipeline-model-parallel-size 1, or {_FLAG} 1."
        )
    if p.sequence_parallel:
        raise ValueError(
            f"{_FLAG} {sp} (DeepSpeed-Ulysses) and --sequence-parallel (Megatron's, over the TP group) are "
            "exclusive, as in Megatron-DeepSpeed; drop --sequence-parallel."
        )
    if m.seq_length % sp:
        raise ValueError(
            f"--seq-length ({m.seq_length}) must be divisible by {_FLAG} ({sp}): each sequence-parallel rank "
            f"holds seq-length / {sp} tokens; use a --seq-length that is a multiple of {sp} (e.g. "
            f"{m.seq_length + sp - m.seq_length % sp}), or {_FLAG} "
            f"{choice_list(divisors(m.seq_length)[:8])}."
        )
    n, g = m.num_attention_heads, m.num_query_groups
    for flag, value in (("--num-attention-heads", n), ("--num-key-value-heads", g)):
        if value % (tp * sp):
            sizes = divisors(math.gcd(n // tp, g // tp))  # TP divides both: checked before
            raise ValueError(
                f"{flag} ({value}) must be divisible by --tensor-model-parallel-size ({tp}) x {_FLAG} ({sp}) = "
                f"{tp * sp}: Ulysses gives each rank {value} / {tp * sp} of the heads after its all-to-all; use "
                f"{_FLAG} {choice_list(sizes)} (dividing the attention heads ({n}) and the key/value heads ({g}) "
                f"per TP rank)."
            )
    if world_size % (tp * pp * sp):
        raise ValueError(
            f"world size ({world_size}) must be divisible by --tensor-model-parallel-size ({tp}) x "
            f"--pipeline-model-parallel-size ({pp}) x {_FLAG} ({sp}) = {tp * pp * sp}; launch a multiple of "
            f"{tp * pp * sp} processes, or use {_FLAG} {choice_list(divisors(world_size // (tp * pp)))}."
        )
