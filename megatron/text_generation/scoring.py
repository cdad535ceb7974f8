"""Scoring given token sequences: per-token log-probs and greedy flags, at the generation layout (any TP x PP).

Legend: ``b`` rows of a micro-batch, ``s`` its widest input (tokens fed), ``vp`` this TP rank's vocabulary
columns, ``V`` the true vocabulary.

A :class:`ScoreRequest` is a token sequence ``t[0..n-1]`` and how many of its last tokens to score; the model reads
``t[0..n-2]`` (one forward, no generation) and for every scored target ``t[i]`` (``i >= 1``) returns
``log p(t[i] | t[:i])`` and whether ``t[i]`` is the argmax of that distribution (what lm-evaluation-harness calls
``is_greedy``). Rows are left-padded inside a micro-batch exactly like generation's prefill (the KV cache masks the
padding, positions start at 0 on each row's first token), so a row's scores do not depend on its batch-mates.

Everything stays vocabulary-parallel (no ``[s, b, V]`` gather): ``log p`` comes from the vocab-parallel
cross-entropy (padded columns are ``-inf`` in the logits, so they never count), the greedy flag compares the target's
logit (one TP all-reduce sum: the shard holding it contributes, the others add 0) with the row's largest logit (one
TP all-reduce max). Ties count as greedy (``argmax`` would pick the lowest id; an exact fp32 tie of two logits does not
happen in practice). The last stage's ``[b, s]`` results reach the other stages by one broadcast per micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron.model.inference import InferenceParams
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.mpu.mappings import all_reduce_max_, all_reduce_sum_
from megatron.text_generation.engine import InferenceEngine, _MicroBatch


@dataclass(frozen=True)
class ScoreRequest:
    """Score the last ``num_targets`` tokens of ``tokens`` (``1 <= num_targets < len(tokens)``)."""

    tokens: Sequence[int]
    num_targets: int


@dataclass(frozen=True)
class ScoreResult:
    """Per scored token, in order: ``log p`` (fp32 math, returned as float) and the greedy flag."""

    log_probs: list[float]
    greedy: list[bool]


def check_score_requests(requests: Sequence[ScoreRequest], max_positions: int) -> None:
    """Refuse a request that cannot be scored.

    Raises:
        ValueError: fewer than 2 tokens, ``num_targets`` outside ``[1, len - 1]``, or more inputs than the
            model's context (``len(tokens) - 1 > max_positions``).
    """
    for k, r in enumerate(requests):
        n = len(r.tokens)
        if n < 2 or not 1 <= r.num_targets <= n - 1:
            raise ValueError(
                f"score request {k}: {n} token(s) with num_targets={r.num_targets}; a request needs at least "
                "2 tokens and 1 <= num_targets <= len(tokens) - 1 (the first token is only context)."
            )
        if n - 1 > max_positions:
            raise ValueError(
                f"score request {k}: {n - 1} input tokens exceed the model's context of {max_positions}; "
                "truncate the context from the left."
            )


def _prepare(
    engine: InferenceEngine, requests: Sequence[ScoreRequest], rows: list[int]
) -> _MicroBatch:
    """Left-padded inputs ``t[:-1]`` of ``rows`` and a KV cache just wide enough (no generation step)."""
    lengths = [len(requests[r].tokens) - 1 for r in rows]
    width = max(lengths)
    feed = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    pad = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (r, n) in enumerate(zip(rows, lengths, strict=True)):
        feed[i, width - n :] = torch.tensor(list(requests[r].tokens[:-1]), dtype=torch.long)
        positions[i, width - n :] = torch.arange(n)
        pad[i, : width - n] = True
    cache = InferenceParams(max_batch_size=len(rows), max_sequence_length=width)
    cache.set_padding(pad.to(engine.device))
    return _MicroBatch(
        rows=rows,
        cache=cache,
        feed=feed.to(engine.device),
        positions=positions.to(engine.device),
        next_position=torch.tensor(lengths, dtype=torch.long),
    )


def _targets(requests: Sequence[ScoreRequest], rows: list[int], width: int) -> torch.Tensor:
    """``[b, s]`` the token each input position predicts (left-padded like the inputs; padding 0)."""
    out = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        nxt = list(requests[r].tokens[1:])
        out[i, width - len(nxt) :] = torch.tensor(nxt, dtype=torch.long)
    return out


def _scores(engine: InferenceEngine, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[2, b, s]`` fp64: ``log p`` of each target and its greedy flag (1.0 / 0.0), from ``logits [s, b, vp]``."""
    group = engine.stage.parallel.tp_group
    logits = logits.float()
    tgt = targets.to(logits.device).transpose(0, 1).contiguous()  # [b, s] -> [s, b]
    logp = -vocab_parallel_cross_entropy(logits, tgt, group=group)  # [s, b]
    top = all_reduce_max_(logits.max(dim=-1).values.contiguous(), group)  # [s, b, vp] -> [s, b]
    vp = logits.shape[-1]
    first = engine.stage.parallel.tp_rank * vp  # global id of this shard's first column
    local = tgt - first
    mine = (local >= 0) & (local < vp)
    picked = logits.gather(-1, local.clamp(0, vp - 1).unsqueeze(-1)).squeeze(
        -1
    )  # [s, b, vp] -> [s, b]
    target_logit = all_reduce_sum_(torch.where(mine, picked, torch.zeros_like(picked)), group)
    out = torch.stack([logp.double(), (target_logit >= top).double()])  # [2, s, b]
    return out.transpose(1, 2).cpu().contiguous()  # [2, s, b] -> [2, b, s]


@torch.no_grad()
def score_tokens(
    engine: InferenceEngine,
    requests: Sequence[ScoreRequest],
    *,
    micro_batch_size: int | None = None,
) -> list[ScoreResult]:
    """Log-probs and greedy flags of each request's scored tokens; collective over the pipeline (every rank calls
    it with the same requests and gets the same results).

    Args:
        engine: this rank's generation engine (its stage, pipeline group and device).
        requests: what to score (checked by :func:`check_score_requests` against the model's context).
        micro_batch_size: rows per forward (None: the engine's, else ``ceil(n / PP)``).

    Raises:
        ValueError: see :func:`check_score_requests`.
    """
    config = engine.config
    check_score_requests(requests, config.max_position_embeddings or config.seq_length)
    n = len(requests)
    size = micro_batch_size or engine.micro_batch_size or max(1, math.ceil(n / engine.pp_size))
    batches = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    pending: list[object] = []
    found: list[torch.Tensor] = []
    for rows in batches:
        mb = _prepare(engine, requests, rows)
        width = mb.feed.shape[1]
        logits = engine._forward(mb, pending, last_only=False)
        out = torch.zeros(2, len(rows), width, dtype=torch.float64)
        if logits is not None:  # the last stage: [s, b, vp]
            out = _scores(engine, logits, _targets(requests, rows, width))
        found.append(out)
    results: list[ScoreResult] = []
    for rows, out in zip(batches, found, strict=True):
        out = engine._from_last_stage(out.to(engine._comm_device())).cpu()
        for i, r in enumerate(rows):
            k = requests[r].num_targets
            results.append(
                ScoreResult(
                    log_probs=out[0, i, -k:].tolist(), greedy=[bool(g) for g in out[1, i, -k:]]
                )
            )
    engine._wait(pending)
    return results
