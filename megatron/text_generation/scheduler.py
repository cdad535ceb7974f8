"""Rank 0's request queue and batch scheduler, and the work items every rank of a TP x PP server executes.

Batching. HTTP handler threads (``megatron.text_generation.server``) validate a request, :meth:`Scheduler.admit`
checks it against the model (its length against the context) and queues one item per prompt; the handler waits on
the request's :class:`Job`. The scheduler loop (the thread that calls :meth:`Scheduler.run`) takes up to
``max_batch_size`` waiting prompts, of any requests, first come first served, waiting at most ``batch_wait_ms``
after the oldest one arrived for more, and generates them as one batch. A beam-search request is a work item of
its own. Every prompt samples from its own generator, so its answer does not depend on what it was batched with.
The queue holds at most ``max_queue`` prompts; a request that would overflow it is refused (:class:`Unavailable`,
HTTP 503).

Seeds. Prompt ``i`` (0-based) of a request with ``random_seed`` ``S`` samples from
``torch.Generator().manual_seed(prompt_seed(S, i))`` (``megatron.text_generation.prompt_seed``, the rule
``tools/generate_text.py --seed`` follows too): its text depends on ``S`` and ``i`` only. A request without a seed
draws a fresh random seed per prompt.

Many ranks (TP x PP, launched like training)::

    rank 0: HTTP threads -> queue -> Scheduler.run --broadcast_work(Work)--> generate_requests / beam_search
    rank k:                          serve_worker:   work = broadcast_work(None) --> the same call

Every rank makes the same collective call for each :class:`Work` item (:func:`run_work`). An idle scheduler
broadcasts a ``noop`` item every ``heartbeat_s`` (default :data:`HEARTBEAT_S`) so the other ranks' wait never
reaches the process group's timeout. :meth:`Scheduler.stop` (signal-safe) makes :meth:`~Scheduler.run` return
after the batch in progress; :meth:`~Scheduler.close` answers 503 to every prompt still queued; the server then
broadcasts ``stop`` and every rank returns.

A ``ValueError`` from the generator (a request that does not fit; the same on every rank) fails the requests of
that batch with 400 and serving goes on. Any other error fails them with 500; with one rank serving goes on, with
more :meth:`Scheduler.run` re-raises (the ranks may no longer be in step).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import torch

from megatron.text_generation.generation import (
    Generated,
    PromptRequest,
    TextGenerator,
    prompt_seed,
)
from megatron.text_generation.sampling import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_BATCH_WAIT_MS = 5.0
DEFAULT_MAX_QUEUE = 64
HEARTBEAT_S = 5.0
"""Seconds between the idle scheduler's ``noop`` broadcasts: far below any process-group timeout."""
_POLL_S = 0.05
"""How often the scheduler looks at the stop flag while it waits (a signal handler only sets the flag)."""
_DRAIN_S = 10.0
"""Seconds a closing scheduler waits for the handler threads to write the last answers."""
SHUTTING_DOWN = "the server is shutting down; retry on another server or later."


class RequestError(ValueError):
    """A request the server refuses (answered with HTTP 400 and this message)."""


class Unavailable(RuntimeError):
    """The server cannot take the request now: its queue is full or it is shutting down (HTTP 503)."""


@dataclass(frozen=True)
class ApiRequest:
    """A validated ``PUT /api`` body."""

    prompts: list[str]
    tokens_to_generate: int
    params: SamplingParams
    seed: int | None
    """``random_seed``; None: a fresh seed per prompt."""
    stop_at_eod: bool = True
    logprobs: bool = False
    beam_width: int | None = None
    """Beam search with this many beams (one prompt); None: sampling."""
    stop_token: int | None = None
    length_penalty: float = 1.0


@dataclass(frozen=True)
class BeamRequest:
    """One prompt's beam search (the arguments of ``TextGenerator.beam_search``)."""

    prompt: str
    beam_width: int
    max_new_tokens: int
    stop_token: int | None
    length_penalty: float


@dataclass(frozen=True)
class Work:
    """What rank 0 broadcasts to every rank, one per scheduler step (picklable)."""

    kind: Literal["generate", "beam", "noop", "stop"]
    requests: tuple[PromptRequest, ...] = ()
    beam: BeamRequest | None = None


NOOP = Work("noop")
STOP = Work("stop")


def run_work(generator: TextGenerator, work: Work) -> list[Generated]:
    """The collective call ``work`` names (every rank makes it with the same item); [] for noop/stop.

    Raises:
        ValueError: the generator refuses a request (the same on every rank).
    """
    if work.kind == "generate":
        return generator.generate_requests(list(work.requests))
    if work.kind == "beam" and work.beam is not None:
        b = work.beam
        return generator.beam_search(
            b.prompt,
            beam_width=b.beam_width,
            max_new_tokens=b.max_new_tokens,
            stop_token=b.stop_token,
            length_penalty=b.length_penalty,
            num_return_gen=b.beam_width,
        )
    return []


def serve_worker(generator: TextGenerator) -> None:
    """Every rank but 0: make rank 0's collective calls until it broadcasts ``stop``.

    Raises:
        Exception: anything but a ValueError from the generator (rank 0 stops too: it cannot stay in step).
    """
    while True:
        work = generator.broadcast_work(None)
        if not isinstance(work, Work) or work.kind == "stop":
            return
        try:
            run_work(generator, work)
        except ValueError:
            pass  # the same on rank 0, which answers 400


class Job:
    """One HTTP request: its answers, filled by the scheduler, and the event its handler thread waits on."""

    def __init__(self, request: ApiRequest) -> None:
        self.request = request
        self.results: list[Generated | None] = [None] * len(request.prompts)
        self.beams: list[Generated] = []
        self._left = len(request.prompts)
        self.error: tuple[int, str] | None = None
        self.done = threading.Event()

    def finish(self, index: int, result: Generated | list[Generated]) -> None:
        if isinstance(result, list):
            self.beams = result
        else:
            self.results[index] = result
        self._left -= 1
        if self._left == 0:
            self.done.set()

    def fail(self, status: int, message: str) -> None:
        if not self.done.is_set():
            self.error = (status, message)
            self.done.set()

    def answer(self) -> dict[str, Any]:
        """The ``200`` response body (Megatron's field names)."""
        if self.request.beam_width is not None:
            return {
                "text": [b.prompt + b.text for b in self.beams],
                "tokens": [b.tokens for b in self.beams],
                "scores": [b.score for b in self.beams],
            }
        out = [r for r in self.results if r is not None]
        answer: dict[str, Any] = {
            "text": [r.prompt + r.text for r in out],
            "tokens": [r.tokens for r in out],
        }
        if self.request.logprobs:
            answer["logprobs"] = [(r.prompt_log_probs or []) + (r.log_probs or []) for r in out]
        return answer


@dataclass
class _Item:
    job: Job
    index: int
    work: PromptRequest | BeamRequest
    arrived: float


class Scheduler:
    """Rank 0's queue of prompts and the loop that turns it into batches (module docstring: "Batching").

    Args:
        generator: the model every rank serves.
        max_batch_size: prompts per generated batch.
        batch_wait_ms: how long after the oldest waiting prompt arrived the scheduler waits for more.
        max_queue: prompts that may wait; a request that would overflow the queue is refused (503).
        heartbeat_s: seconds between ``noop`` broadcasts while idle.
    """

    def __init__(
        self,
        generator: TextGenerator,
        *,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        batch_wait_ms: float = DEFAULT_BATCH_WAIT_MS,
        max_queue: int = DEFAULT_MAX_QUEUE,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        self.generator = generator
        self.max_batch_size = max_batch_size
        self.batch_wait = batch_wait_ms / 1000.0
        self.max_queue = max_queue
        self.heartbeat_s = heartbeat_s
        self._cond = threading.Condition()
        self._queue: deque[_Item] = deque()
        self._in_flight = 0
        self._open = 0  # requests admitted and not yet answered
        self._answered = 0
        self._closed = False
        self._stopping = False  # set by stop(): a plain flag, safe to set from a signal handler

    def stop(self) -> None:
        """Ask :meth:`run` to return after the batch in progress (signal-safe: sets a flag only)."""
        self._stopping = True

    def health(self) -> dict[str, Any]:
        """The ``GET /health`` body: status, prompts waiting and generating, requests answered, limits."""
        with self._cond:
            return {
                "status": "shutting down" if self._closed or self._stopping else "ok",
                "queue": len(self._queue),
                "in_flight": self._in_flight,
                "answered": self._answered,
                "max_queue": self.max_queue,
                "max_batch_size": self.max_batch_size,
            }

    def admit(self, request: ApiRequest) -> Job:
        """Check ``request`` against the model and queue its prompts.

        Raises:
            RequestError: a prompt the tokenizer refuses, or one that does not fit the context with
                ``tokens_to_generate`` more tokens.
            Unavailable: the queue cannot take the prompts now, or the server is shutting down.
        """
        gen = self.generator
        items: list[PromptRequest | BeamRequest] = []
        try:
            for prompt in request.prompts:
                gen.check_request(prompt, request.tokens_to_generate)
        except ValueError as err:
            raise RequestError(str(err)) from None
        if request.beam_width is not None:
            vocab = gen.tokenizer.vocab_size
            if request.stop_token is not None and request.stop_token >= vocab:
                raise RequestError(
                    f"'stop_token' ({request.stop_token}) is not a token id of this model (0..{vocab - 1})."
                )
            items.append(
                BeamRequest(
                    prompt=request.prompts[0],
                    beam_width=request.beam_width,
                    max_new_tokens=request.tokens_to_generate,
                    stop_token=request.stop_token,
                    length_penalty=request.length_penalty,
                )
            )
        else:
            for i, prompt in enumerate(request.prompts):
                seed = (
                    secrets.randbits(63) if request.seed is None else prompt_seed(request.seed, i)
                )
                items.append(
                    PromptRequest(
                        prompt=prompt,
                        max_new_tokens=request.tokens_to_generate,
                        params=request.params,
                        seed=seed,
                        stop_at_eod=request.stop_at_eod,
                        return_log_probs=request.logprobs,
                    )
                )
        return self._submit(Job(request), items)

    def _submit(self, job: Job, items: list[PromptRequest | BeamRequest]) -> Job:
        with self._cond:
            if self._closed or self._stopping:
                raise Unavailable(SHUTTING_DOWN)
            if len(self._queue) + len(items) > self.max_queue:
                raise Unavailable(
                    f"the queue is full ({len(self._queue)} of {self.max_queue} prompts waiting, "
                    f"this request adds {len(items)}); retry in a moment."
                )
            now = time.monotonic()
            self._queue.extend(_Item(job, i, w, now) for i, w in enumerate(items))
            self._open += 1
            self._cond.notify_all()
        return job

    def answered(self) -> None:
        """A handler thread has written its answer (or given up on the client)."""
        with self._cond:
            self._open -= 1
            self._answered += 1
            self._cond.notify_all()

    def _next_batch(self) -> list[_Item]:
        """The next work: one beam item, or up to ``max_batch_size`` prompts; [] when idle for a poll."""
        with self._cond:
            if not self._queue:
                self._cond.wait(_POLL_S)
            if not self._queue or self._stopping:
                return []
            if isinstance(self._queue[0].work, BeamRequest):
                batch = [self._queue.popleft()]
            else:
                batch = self._take_prompts()
            # A request already answered (one of its batches failed) needs none of its other prompts.
            batch = [item for item in batch if not item.job.done.is_set()]
            self._in_flight = len(batch)
            return batch

    def _take_prompts(self) -> list[_Item]:
        """Up to ``max_batch_size`` prompts from the head, after waiting up to ``batch_wait_ms`` from the
        oldest one's arrival for more (the caller holds the lock)."""
        deadline = self._queue[0].arrived + self.batch_wait
        while not self._stopping and self._ready() < self.max_batch_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(min(left, _POLL_S))
        if self._stopping:
            return []
        return [self._queue.popleft() for _ in range(self._ready())]

    def _ready(self) -> int:
        """Prompts at the head of the queue that can share a batch (up to the first beam item)."""
        n = 0
        for item in self._queue:
            if isinstance(item.work, BeamRequest) or n == self.max_batch_size:
                break
            n += 1
        return n

    def run(self) -> None:
        """Rank 0's loop: batches and heartbeats until :meth:`stop` (then it returns; see :meth:`close`).

        Raises:
            Exception: a generator error other than ValueError when more than one rank serves.
        """
        last = time.monotonic()
        while not self._stopping:
            batch = self._next_batch()
            if not batch:
                if time.monotonic() - last >= self.heartbeat_s:
                    self.generator.broadcast_work(NOOP)
                    last = time.monotonic()
                continue
            head = batch[0].work
            if isinstance(head, BeamRequest):
                work = Work("beam", beam=head)
            else:
                work = Work("generate", requests=tuple(i.work for i in batch))  # type: ignore[misc]
            try:
                self._run_batch(work, batch)
            finally:
                with self._cond:
                    self._in_flight = 0
            last = time.monotonic()

    def _run_batch(self, work: Work, batch: list[_Item]) -> None:
        try:
            self.generator.broadcast_work(work)
            out = run_work(self.generator, work)
            if work.kind == "generate" and len(out) != len(batch):
                raise RuntimeError(f"{len(out)} results for a batch of {len(batch)} prompts")
        except ValueError as err:  # the same on every rank: they are still in step
            for item in batch:
                item.job.fail(400, str(err))
            return
        except Exception as err:
            logger.exception("generation failed")
            for item in batch:
                item.job.fail(500, f"generation failed: {type(err).__name__}: {err}")
            if world_size() > 1:
                raise
            return
        if work.kind == "beam":
            batch[0].job.finish(0, out)
        else:
            for item, result in zip(batch, out, strict=True):
                item.job.finish(item.index, result)

    def close(self) -> None:
        """Refuse new requests, answer 503 to every queued prompt, and wait (bounded) for the answers to be
        written. Call after :meth:`run` returned."""
        with self._cond:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
        for item in queued:
            item.job.fail(503, SHUTTING_DOWN)
        deadline = time.monotonic() + _DRAIN_S
        with self._cond:
            while self._open > 0 and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)


def world_size() -> int:
    """The number of ranks serving (1 without torch.distributed)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
