"""Batched generation and beam search over one pipeline stage per rank, at the training TP x PP layout.

Legend: ``b`` rows of a micro-batch, ``L`` the longest prompt of a micro-batch, ``s`` tokens fed this forward,
``h`` hidden, ``vp`` this TP rank's vocabulary columns, ``V`` true vocabulary.

Every rank of the world (``TP x PP`` ranks, no data parallelism) runs the same loop on the same requests; the
collectives are the model's TP ones, the hidden states passed stage to stage, and one broadcast per step from the
last stage (which samples) to the others over each pipeline group::

    step:  for each micro-batch m:   stage 0 -> send -> stage 1 -> ... -> last stage: logits -> sample
           broadcast (tokens, log-probs) of every row: last stage -> all stages (pipeline group)

Sends are asynchronous, so stage 0 runs micro-batch ``m + 1`` while stage 1 runs ``m``. All TP ranks of the last
stage gather the same full logits and draw with the same generators, so they sample the same tokens.

Prompts of different lengths are left-padded inside a micro-batch: row ``i``'s prompt ends at column ``L``, its
positions start at 0 on its first real token, and the KV cache masks the padding slots
(``InferenceParams.set_padding``). A row's tokens and log-probs therefore do not depend on its batch-mates (beyond
the floating-point order of a batched matmul), and each request draws from its own generator.

Log-probs are of the model's distribution (temperature 1, no top-k/top-p), in fp32: the prompt's through the
vocabulary-parallel cross-entropy (no ``[s, b, V]`` gather), a generated token's from the gathered last-position
logits.

Beam search (one prompt, ``w`` beams; Megatron's semantics): per step, the scores ``log p + beam score`` of all
``w x V`` continuations (of beam 0 only at the first step) are sorted (ties: lower beam, then lower id first); the
best ``2w`` are walked in order: a stop token among the first ``w`` ends a hypothesis with score
``sum log p / len ** length_penalty`` (``len`` counts the stop token), a stop token further down is skipped, any
other token extends a beam until ``w`` beams are chosen. The search ends when ``w`` hypotheses are kept and the
best new score, length-penalised at the current length, is no better than the worst kept; after
``max_new_tokens`` steps the open beams join the hypotheses. The best ``num_return`` hypotheses are returned.

A width close to or above the vocabulary (or above ``V ** step``) leaves fewer real continuations than beams: the
first step has only ``V`` candidates, one of them perhaps the stop token. The beams left over are *empty*: score
``-inf``, so none of their continuations is ever chosen over a real one, they never become hypotheses, and the
search returns fewer than ``num_return`` hypotheses when fewer distinct ones exist (never a duplicate, never an
invented score). Megatron's own code fails on such widths (its next-beam tensors come out short).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megatron.model.inference import InferenceParams
from megatron.model.stage import GPTStage
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.mpu.mappings import (
    broadcast_,
    broadcast_object,
    gather_from_tensor_model_parallel_region,
    recv_from_group_rank,
    send_to_group_rank,
)
from megatron.mpu.parallel_state import ProcessGroup, group_rank, group_world_size
from megatron.text_generation.sampling import SamplingParams, sample_next

MAX_LENGTH_PENALTY = 10.0
"""Largest ``|length_penalty|``: ``length ** 10`` stays finite for any context (``1e6 ** 10 = 1e60``), and
useful values are small (Megatron's default 1; transformers' examples 0.6..2; 0 ranks by total log p)."""


def check_length_penalty(value: float, name: str = "--length-penalty") -> None:
    """Refuse a length penalty the score ``sum log p / length ** value`` cannot use.

    Raises:
        ValueError: ``value`` is nan, infinite or beyond ``±MAX_LENGTH_PENALTY`` (naming ``name``).
    """
    if not (math.isfinite(value) and abs(value) <= MAX_LENGTH_PENALTY):
        bound = f"{MAX_LENGTH_PENALTY:g}"
        raise ValueError(
            f"{name} ({value}) must be a finite number in [-{bound}, {bound}]: the beam score is "
            f"sum log p / length ** {name} (1.0, the default, is Megatron's; 0 ranks by total log p)."
        )


@dataclass
class TokenRequest:
    """One prompt to continue (token ids); ``generator`` is this request's own (CPU) random stream."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    params: SamplingParams
    generator: torch.Generator
    stop_token: int | None = None
    """End this row after this token (it is kept in the output); None: always ``max_new_tokens``."""
    log_probs: bool = False


@dataclass
class TokenResult:
    """The output of one :class:`TokenRequest` (or one beam-search hypothesis)."""

    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    prompt_log_probs: list[float] | None = None
    stopped: bool = False
    score: float | None = None


@dataclass
class _MicroBatch:
    rows: list[int]  # indices into the request list
    cache: InferenceParams
    feed: torch.Tensor  # [b, s] tokens for the next forward
    positions: torch.Tensor  # [b, s]
    next_position: torch.Tensor  # [b] position of the next generated token


class InferenceEngine:
    """Generation on this rank's :class:`GPTStage`, in lockstep with the other ranks of its pipeline.

    Args:
        stage: this rank's stage (eval mode), on ``device``.
        pp_group: the pipeline group (None: one stage).
        device: where the stage runs.
        micro_batch_size: rows per micro-batch (None: ``ceil(batch / PP)``, which keeps every stage busy).
        own_weights: the stage's weights are the engine's to re-lay out (on CPU, column-major linear weights run
            faster); False for a stage sharing a training model's parameters, which must stay as the optimizer
            holds them.
    """

    def __init__(
        self,
        stage: GPTStage,
        *,
        pp_group: ProcessGroup | None,
        device: torch.device,
        micro_batch_size: int | None = None,
        own_weights: bool = True,
    ) -> None:
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size ({micro_batch_size}) must be >= 1.")
        self.stage = stage
        self.config = stage.config
        self.pp_group = pp_group
        self.pp_size = group_world_size(pp_group)
        self.pp_rank = group_rank(pp_group)
        self.device = device
        self.micro_batch_size = micro_batch_size
        if device.type == "cpu" and own_weights:
            _column_major_linear_weights(stage)

    @property
    def is_last_stage(self) -> bool:
        """This rank computes the logits (and samples)."""
        return self.pp_rank == self.pp_size - 1

    # --- pipeline plumbing -----------------------------------------------------------------------------------

    def _forward(
        self, mb: _MicroBatch, pending: list[object], *, last_only: bool = True
    ) -> torch.Tensor | None:
        """Run this stage on ``mb.feed``: the last stage returns logits ``[s, b, vp]`` (``[1, b, vp]`` with
        ``last_only``), the others send their hidden states on and return None."""
        b, s = mb.feed.shape
        if self.pp_rank == 0:
            inputs = mb.feed
        else:
            inputs = torch.empty(
                s,
                b,
                self.config.hidden_size,
                dtype=self.stage.parallel.params_dtype,
                device=self.device,
            )
            recv_from_group_rank(inputs, self.pp_rank - 1, self.pp_group)  # [s, b, h]
        out = self.stage(inputs, mb.positions, mb.cache, last_only=last_only)
        mb.cache.sequence_len_offset += s
        if self.is_last_stage:
            return out
        pending.append((send_to_group_rank(out, self.pp_rank + 1, self.pp_group), out))
        return None

    def _from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (contiguous) as the last stage holds it, on every stage of the pipeline (in place)."""
        if not t.is_contiguous():
            raise ValueError(
                "broadcast needs a contiguous tensor (a view would send its storage order)."
            )
        return broadcast_(t, self.pp_size - 1, self.pp_group) if self.pp_size > 1 else t

    @staticmethod
    def _wait(pending: list[object]) -> None:
        for handle, _ in pending:  # type: ignore[misc]
            handle.wait()
        pending.clear()

    def _full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Last-position logits over the true vocabulary: ``[s, b, vp] -> [b, V]`` fp32."""
        last = gather_from_tensor_model_parallel_region(logits[-1], self.stage.parallel.tp_group)
        return last[:, : self.config.vocab_size].float()  # [b, v] -> [b, V]

    # --- batched generation ------------------------------------------------------------------------------------

    def _micro_batches(self, requests: Sequence[TokenRequest]) -> list[list[int]]:
        n = len(requests)
        size = self.micro_batch_size or max(1, math.ceil(n / self.pp_size))
        return [list(range(i, min(i + size, n))) for i in range(0, n, size)]

    def _prepare(self, requests: Sequence[TokenRequest], rows: list[int]) -> _MicroBatch:
        """Left-padded prompts of ``rows`` and their KV cache."""
        lengths = [len(requests[r].prompt_ids) for r in rows]
        width = max(lengths)
        steps = max(requests[r].max_new_tokens for r in rows)
        feed = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        pad = torch.zeros(len(rows), width + steps, dtype=torch.bool)
        for i, (r, n) in enumerate(zip(rows, lengths, strict=True)):
            feed[i, width - n :] = torch.tensor(list(requests[r].prompt_ids), dtype=torch.long)
            positions[i, width - n :] = torch.arange(n)
            pad[i, : width - n] = True
        cache = InferenceParams(max_batch_size=len(rows), max_sequence_length=width + steps)
        cache.set_padding(pad.to(self.device))
        return _MicroBatch(
            rows=rows,
            cache=cache,
            feed=feed.to(self.device),
            positions=positions.to(self.device),
            next_position=torch.tensor(lengths, dtype=torch.long),
        )

    def _prompt_log_probs(
        self, logits: torch.Tensor, mb: _MicroBatch, requests: Sequence[TokenRequest]
    ) -> torch.Tensor:
        """``[b, L-1]`` fp64 log p of each prompt token after the first (padding columns meaningless)."""
        targets = mb.feed[:, 1:].transpose(0, 1)  # [b, L-1] -> [L-1, b]
        nll = vocab_parallel_cross_entropy(
            logits[:-1].float(), targets, group=self.stage.parallel.tp_group
        )  # [L-1, b]
        return (-nll).transpose(0, 1).double().contiguous()  # [L-1, b] -> [b, L-1]

    def _sample(
        self, logits: torch.Tensor, mb: _MicroBatch, requests: Sequence[TokenRequest]
    ) -> torch.Tensor:
        """``[2, b]`` fp64: each row's next token and its log-prob (last stage; one host sync)."""
        full = self._full_logits(logits)  # [b, V]
        tokens = full.argmax(dim=-1)  # [b]: the greedy rows' tokens, one op for all
        for i, r in enumerate(mb.rows):
            params = requests[r].params
            if not (params.greedy or params.top_k == 1):
                tokens[i] = sample_next(full[i : i + 1], params, requests[r].generator)[0]
        out = torch.zeros(2, len(mb.rows), dtype=torch.float64, device=full.device)
        out[0] = tokens
        if any(requests[r].log_probs for r in mb.rows):
            logp = F.log_softmax(full, dim=-1)
            out[1] = logp.gather(1, tokens.view(-1, 1)).view(-1)  # [b, V] -> [b]
        return out.cpu()

    @torch.no_grad()
    def generate(self, requests: Sequence[TokenRequest]) -> list[TokenResult]:
        """Continue every request; collective over the pipeline (every rank calls with the same requests).

        Returns:
            one :class:`TokenResult` per request, on every rank.
        """
        results = [TokenResult() for _ in requests]
        mbs = [self._prepare(requests, rows) for rows in self._micro_batches(requests)]
        done = [False] * len(requests)
        pending: list[object] = []
        first = True
        while not all(done):
            # a finished micro-batch stops (every rank sees the same ``done``); its cache holds no more steps
            mbs = [mb for mb in mbs if not all(done[r] for r in mb.rows)]
            drawn: list[torch.Tensor] = []
            for mb in mbs:
                scored = first and any(requests[r].log_probs for r in mb.rows)
                logits = self._forward(mb, pending, last_only=not scored)
                width = mb.feed.shape[1]
                if scored:
                    plp = torch.zeros(len(mb.rows), width - 1, dtype=torch.float64)
                    if logits is not None and width > 1:
                        plp = self._prompt_log_probs(logits, mb, requests)
                    plp = self._from_last_stage(plp.to(self._comm_device()))
                    for i, r in enumerate(mb.rows):
                        n = len(requests[r].prompt_ids)
                        if requests[r].log_probs:
                            results[r].prompt_log_probs = plp[i, width - n :].tolist()
                drawn.append(
                    self._sample(logits, mb, requests)
                    if logits is not None
                    else torch.empty(2, len(mb.rows), dtype=torch.float64)
                )
            if self.pp_size > 1:
                flat = self._from_last_stage(torch.cat(drawn, dim=1).to(self._comm_device())).cpu()
                drawn = list(flat.split([len(mb.rows) for mb in mbs], dim=1))
            self._wait(pending)
            for mb, picked in zip(mbs, drawn, strict=True):
                self._advance(mb, picked, requests, results, done)
            first = False
        return results

    def _comm_device(self) -> torch.device:
        """Where broadcast tensors live: the CUDA device under NCCL, else CPU."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _advance(
        self,
        mb: _MicroBatch,
        picked: torch.Tensor,
        requests: Sequence[TokenRequest],
        results: list[TokenResult],
        done: list[bool],
    ) -> None:
        """Record the drawn tokens of ``mb`` and set up its next one-token forward."""
        tokens = picked[0].long()
        for i, r in enumerate(mb.rows):
            if done[r]:
                continue
            req, res = requests[r], results[r]
            token = int(tokens[i])
            res.tokens.append(token)
            if req.log_probs:
                res.log_probs.append(float(picked[1, i]))
            if req.stop_token is not None and token == req.stop_token:
                res.stopped, done[r] = True, True
            elif len(res.tokens) >= req.max_new_tokens:
                done[r] = True
        mb.feed = tokens.view(-1, 1).to(self.device)  # [b, 1]
        mb.positions = mb.next_position.view(-1, 1).to(self.device)
        mb.next_position = mb.next_position + 1

    # --- beam search ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def beam_search(
        self,
        prompt_ids: Sequence[int],
        *,
        beam_width: int,
        max_new_tokens: int,
        stop_token: int | None,
        length_penalty: float = 1.0,
        num_return: int = 1,
    ) -> list[TokenResult]:
        """Megatron's beam search (module docstring); collective over the pipeline.

        Returns:
            up to ``num_return`` hypotheses, best first (``score`` set; ``tokens`` end with the stop token when
            ``stopped``), on every rank.

        Raises:
            ValueError: ``beam_width`` or ``num_return`` < 1, ``num_return > beam_width``, or a length penalty
                :func:`check_length_penalty` refuses.
        """
        check_length_penalty(length_penalty)
        if beam_width < 1:
            raise ValueError(f"--beam-width ({beam_width}) must be >= 1.")
        if not 1 <= num_return <= beam_width:
            raise ValueError(
                f"num_return_gen ({num_return}) must be in [1, --beam-width ({beam_width})]."
            )
        n = len(prompt_ids)
        reqs = [
            TokenRequest(
                list(prompt_ids), max_new_tokens, SamplingParams(greedy=True), torch.Generator()
            )
        ] * beam_width
        mb = self._prepare(reqs, list(range(beam_width)))
        search = _BeamState(beam_width, length_penalty, stop_token)
        pending: list[object] = []
        for step in range(max_new_tokens):
            logits = self._forward(mb, pending)
            msg = torch.zeros(
                1 + 3 * beam_width, dtype=torch.float64
            )  # done, beams, tokens, scores
            if logits is not None:
                msg = search.step(F.log_softmax(self._full_logits(logits), dim=-1), step)
            msg = self._from_last_stage(msg.to(self._comm_device())).cpu()
            self._wait(pending)
            if msg[0] > 0:
                break
            beams = msg[1 : 1 + beam_width].long()
            tokens = msg[1 + beam_width : 1 + 2 * beam_width].long()
            search.history = [
                search.history[int(j)] + [int(t)] for j, t in zip(beams, tokens, strict=True)
            ]
            search.scores = msg[1 + 2 * beam_width :].clone()
            mb.cache.reorder(beams.to(self.device))
            mb.feed = tokens.view(-1, 1).to(self.device)
            mb.positions = torch.full(
                (beam_width, 1), n + step, dtype=torch.long, device=self.device
            )
        else:
            search.close(max_new_tokens)
        final = search.best(num_return) if self.is_last_stage else None
        return (
            broadcast_object(final, self.pp_size - 1, self.pp_group) if self.pp_size > 1 else final
        )


def _column_major_linear_weights(stage: GPTStage) -> None:
    """Store every linear weight ``[out, in]`` column-major (same values and shape): on CPU ``F.linear`` then runs
    the GEMM that reads the weight as ``[in, out]`` rows, about 2x faster at batch 8 (what HF's GPT-2 Conv1D
    layout gets). Word embeddings stay row-major (row lookups)."""
    with torch.no_grad():
        for name, p in stage.named_parameters():
            if p.dim() == 2 and "word_embeddings" not in name and p.is_contiguous():
                p.data = p.data.t().contiguous().t()


class _BeamState:
    """The last stage's beam bookkeeping (the other stages follow its broadcast choices)."""

    def __init__(self, width: int, length_penalty: float, stop_token: int | None) -> None:
        self.width = width
        self.length_penalty = length_penalty
        self.stop_token = stop_token
        self.scores = torch.zeros(width, dtype=torch.float64)
        self.history: list[list[int]] = [[] for _ in range(width)]
        self.hypotheses: list[tuple[float, list[int], bool]] = []  # (score, tokens, stopped)

    def _penalised(self, total: float, length: int) -> float:
        return total / length**self.length_penalty

    def _worst(self) -> float:
        return min(h[0] for h in self.hypotheses)

    def _keep(self, total: float, tokens: list[int], stopped: bool) -> None:
        if not math.isfinite(total):  # an empty beam (never a hypothesis)
            return
        score = self._penalised(total, len(tokens))
        if len(self.hypotheses) < self.width or score > self._worst():
            self.hypotheses.append((score, tokens, stopped))
            if len(self.hypotheses) > self.width:
                worst = min(range(len(self.hypotheses)), key=lambda i: self.hypotheses[i][0])
                del self.hypotheses[worst]

    def step(self, logp: torch.Tensor, step: int) -> torch.Tensor:
        """Choose the next beams from ``logp [w, V]``; returns the broadcast message ``[done, beams, tokens,
        scores]`` (fp64). Slots left without a real continuation are empty beams (score ``-inf``)."""
        cand = logp.double() + self.scores.view(-1, 1)  # [w, V]
        flat = cand[0] if step == 0 else cand.reshape(-1)  # [V] or [w * V]
        order = torch.sort(flat, descending=True, stable=True)
        top_scores = order.values[: 2 * self.width]  # [min(2w, V or w * V)]
        chosen = self._walk(
            top_scores.tolist(), order.indices[: 2 * self.width].tolist(), logp.shape[1]
        )
        msg = torch.zeros(1 + 3 * self.width, dtype=torch.float64)
        best = float(top_scores[0])
        if len(self.hypotheses) >= self.width and self._worst() >= self._penalised(best, step + 1):
            msg[0] = 1.0
            return msg
        msg[1 + 2 * self.width :] = -math.inf  # empty beams: beam 0, token 0, never chosen again
        for k, (beam, token, score) in enumerate(chosen):
            msg[1 + k], msg[1 + self.width + k], msg[1 + 2 * self.width + k] = beam, token, score
        return msg

    def _walk(
        self, scores: list[float], indices: list[int], vocab: int
    ) -> list[tuple[int, int, float]]:
        """The next beams ``(beam, token, score)`` (at most ``w``) from the best candidates, best first; keeps
        the stop tokens ranked among the first ``w`` as hypotheses. Stops at the first ``-inf`` candidate (an
        empty beam's continuation)."""
        chosen: list[tuple[int, int, float]] = []
        for rank, (score, idx) in enumerate(zip(scores, indices, strict=True)):
            if score == -math.inf:
                break
            beam, token = divmod(idx, vocab)
            if token == self.stop_token:
                if rank < self.width:
                    self._keep(score, self.history[beam] + [token], True)
                continue
            chosen.append((beam, token, score))
            if len(chosen) == self.width:
                break
        return chosen

    def close(self, steps: int) -> None:
        """No early stop: the open beams join the hypotheses."""
        for k in range(self.width):
            self._keep(float(self.scores[k]), self.history[k], False)

    def best(self, count: int) -> list[TokenResult]:
        ranked = sorted(self.hypotheses, key=lambda h: h[0], reverse=True)[:count]
        return [TokenResult(tokens=t, stopped=s, score=sc) for sc, t, s in ranked]
