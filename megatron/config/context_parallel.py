"""Rules of context parallelism (``--context-parallel-size N``), checked by ``validate()``.

Context parallelism splits every micro-batch's sequence over ``N`` ranks in the causal load-balanced order: the
sequence is cut into ``2N`` chunks and CP rank ``r`` holds chunks ``r`` and ``2N-1-r`` (``model/token_layout.py``);
attention exchanges K/V over the group (``model/context_parallel.py``). So:

- the sequence length divides by ``2N`` (two equal chunks per rank), times the Ulysses degree (Ulysses slices the
  rank's ``S/N`` tokens again), times TP under ``--sequence-parallel`` (Megatron's SP slices them over TP);
- the world size divides by ``TP x PP x N x Ulysses`` (data-parallel size = world / that).

What composes: TP (+ ``--sequence-parallel``), PP, DP, ZeRO 0-3, DeepSpeed-Ulysses (inside CP), GQA, RoPE and learned
positions (the position ids stay global), sliding windows. What is refused by name: MoE (not built with CP),
attention dropout (the exchange has no dropout). Packed documents (``--reset-attention-mask``) compose: every rank
keeps the whole sequence's document ids and the exchange masks by them (a chunk boundary inside a document is just
two blocks of one document). Generation runs at CP = 1 (it builds
its own layout from the checkpoint, which records no CP size); a KV cache under CP is refused in the model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from megatron.config.parallel import ParallelConfig
from megatron.config.rules import choice_list, divisors

if TYPE_CHECKING:
    from megatron.config.arguments import TridentConfig

_FLAG = "--context-parallel-size"


def sequence_multiple(p: ParallelConfig) -> int:
    """What ``--seq-length`` (and every curriculum length) must divide by under the run's sequence splits:
    ``2 x CP`` (at CP > 1) x Ulysses x TP (under --sequence-parallel)."""
    cp = p.context_parallel_size
    megatron_sp = p.tensor_model_parallel_size if p.sequence_parallel_enabled else 1
    return (2 * cp if cp > 1 else 1) * p.ds_sequence_parallel_size * megatron_sp


def _check_sequence(cfg: TridentConfig) -> None:
    p, s = cfg.parallel, cfg.model.seq_length
    multiple = sequence_multiple(p)
    if s % multiple == 0:
        return
    parts = [f"2 x {_FLAG} ({p.context_parallel_size})"]
    if p.ds_sequence_parallel_size > 1:
        parts.append(f"--ds-sequence-parallel-size ({p.ds_sequence_parallel_size})")
    if p.sequence_parallel_enabled:
        parts.append(
            f"--tensor-model-parallel-size ({p.tensor_model_parallel_size}) under --sequence-parallel"
        )
    raise ValueError(
        f"--seq-length ({s}) must be divisible by {' x '.join(parts)} = {multiple}: each context-parallel rank "
        f"holds two equal chunks of seq-length / (2 x {p.context_parallel_size}) tokens; use a --seq-length that "
        f"is a multiple of {multiple} (e.g. {s + multiple - s % multiple})."
    )


def _check_features(cfg: TridentConfig) -> None:
    m, cp = cfg.model, cfg.parallel.context_parallel_size
    if m.moe.is_moe(m.num_layers):
        raise ValueError(
            f"--num-experts {list(m.moe.num_experts)} with {_FLAG} ({cp}): MoE is not built with context "
            f"parallelism; use one of them ({_FLAG} 1, or a dense model)."
        )
    if m.attention_dropout > 0:
        raise ValueError(
            f"--attention-dropout ({m.attention_dropout}) with {_FLAG} ({cp}): the context-parallel attention "
            "exchange has no dropout; pass --attention-dropout 0."
        )


def check_context_parallel(cfg: TridentConfig, world_size: int) -> None:
    """Raise ``ValueError`` when ``--context-parallel-size`` does not fit the model, the flags or the world.

    Args:
        cfg: the run's config (``parallel``, ``model`` and ``data`` are read).
        world_size: the number of processes.

    Raises:
        ValueError: one message naming the flag, its value, the rule with the other values, and the fix.
    """
    p = cfg.parallel
    cp = p.context_parallel_size
    if cp == 1:
        return
    _check_features(cfg)
    _check_sequence(cfg)
    tp, pp, sp = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.ds_sequence_parallel_size,
    )
    if world_size % (tp * pp * sp * cp):
        model = tp * pp * sp
        fits = [
            c
            for c in (divisors(world_size // model) if world_size % model == 0 else [1])
            if cfg.model.seq_length % sequence_multiple(replace(p, context_parallel_size=c)) == 0
        ]
        raise ValueError(
            f"world size ({world_size}) must be divisible by --tensor-model-parallel-size ({tp}) x "
            f"--pipeline-model-parallel-size ({pp}) x --ds-sequence-parallel-size ({sp}) x {_FLAG} ({cp}) = "
            f"{model * cp}; launch a multiple of {model * cp} processes, or use {_FLAG} {choice_list(fits)}."
        )
