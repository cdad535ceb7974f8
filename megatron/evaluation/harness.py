"""lm-evaluation-harness on Trident's generation engine, at the training layout (any TP x PP).

:class:`TridentLM` is an ``lm_eval`` model over an :class:`~megatron.text_generation.engine.InferenceEngine` and
our tokenizer; :func:`evaluate_tasks` runs ``lm_eval.simple_evaluate`` on it, offline, and returns
``task -> metric -> value``.

Every rank of the TP x PP grid runs the same harness on the same requests (``lm_eval`` sees rank 0 of world 1 on
each): the requests, their order and their batches are built from the task data alone, so every rank issues the same
engine calls in the same order and the engine's collectives line up; the last pipeline stage's results reach every
rank, so all ranks compute the same metrics. Only global rank 0 shows progress bars (the caller prints or writes).

Tokenization follows ``lm_eval``'s Hugging Face backend (``HFLM``), so the numbers match it on an exported model:

- ``loglikelihood(context, continuation)``: the context's trailing whitespace moves to the continuation, the pair
  is encoded together and the continuation's ids are the tail after the context's own encoding
  (``TemplateLM._encode_pair``); an empty context becomes the prefix token (BOS, else EOS/EOD). The input is
  ``(context + continuation)[:-1]`` left-truncated to ``max_length`` tokens; the result is ``(sum log p, every
  continuation token is the argmax)``.
- ``tok_encode`` adds the tokenizer's own prefix (``prefix_ids``: Llama 3's ``<|begin_of_text|>``) as
  ``add_special_tokens=True`` does in transformers, unless the text already starts with it.
- ``loglikelihood_rolling``: ``lm_eval``'s disjoint rolling windows of ``max_length`` tokens (context 1, the
  prefix token before the first window), summed per document.
- ``generate_until``: contexts left-truncated to ``max_length - max_gen_toks``, greedy unless ``do_sample`` (then
  ``temperature`` / ``top_k`` / ``top_p``, each request its own seeded generator), stopping at EOD or after
  ``max_gen_toks`` tokens; the text (decoded alone, as ``HFLM`` decodes it) is cut at the first stop string.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from megatron.evaluation.tasks import task_manager, task_specs
from megatron.text_generation import SamplingParams, prompt_seed
from megatron.text_generation.engine import InferenceEngine, TokenRequest
from megatron.text_generation.scoring import ScoreRequest, score_tokens
from megatron.tokenizer import MegatronTokenizer

logger = logging.getLogger(__name__)

DEFAULT_MAX_GEN_TOKS = 256
"""``lm_eval``'s default ``max_gen_toks`` (``HFLM.max_gen_toks``)."""

TokenPair = tuple[Any, list[int], list[int]]
"""``(request key, context ids, continuation ids)``, what ``TemplateLM._loglikelihood_tokens`` receives."""


def _is_rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class TridentLM(TemplateLM):
    """An ``lm_eval`` language model over this rank's generation engine (collective: see the module docstring).

    Args:
        engine: this rank's :class:`InferenceEngine` (its stage in eval mode).
        tokenizer: the model's tokenizer (a ``MegatronTokenizer``).
        batch_size: requests scored or generated together (sorted longest first, as ``HFLM`` batches them).
        max_length: the context in tokens (None: the model's, ``--max-position-embeddings`` else
            ``--seq-length``, which is what ``HFLM`` reads from an exported model's config).
        max_gen_toks: the default new-token budget of ``generate_until`` (a task's ``max_gen_toks`` wins).
        seed: seeds the sampled generations (request ``i`` of a call draws from ``prompt_seed(seed, i)``).

    Raises:
        ValueError: ``batch_size`` or ``max_gen_toks`` < 1, or ``max_length`` outside ``[2, the model's context]``.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: MegatronTokenizer,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        context = engine.config.max_position_embeddings or engine.config.seq_length
        if batch_size < 1:
            raise ValueError(f"--batch-size ({batch_size}) must be >= 1.")
        if max_gen_toks < 1:
            raise ValueError(f"max_gen_toks ({max_gen_toks}) must be >= 1.")
        if max_length is not None and not 2 <= max_length <= context:
            raise ValueError(
                f"--max-length ({max_length}) must be in [2, {context}] (the model's context)."
            )
        self.engine = engine
        self.trident_tokenizer = tokenizer
        self._batch_size = batch_size
        self._max_length = max_length or context
        self._max_gen_toks = max_gen_toks
        self.seed = seed
        self.show_progress = _is_rank_zero()

    # --- what lm_eval asks of a model -------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.trident_tokenizer.eod

    @property
    def prefix_token_id(self) -> int:
        bos = self.trident_tokenizer.bos
        return self.trident_tokenizer.eod if bos is None else bos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return self.trident_tokenizer.name

    def tok_encode(
        self,
        string: str,
        add_special_tokens: bool | None = None,
        left_truncate_len: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """``string``'s ids; the tokenizer's prefix first unless ``add_special_tokens`` is False (or, when it is
        None, the text already starts with the prefix); the last ``left_truncate_len`` ids when given."""
        ids = self.trident_tokenizer.tokenize(string) if string else []
        prefix = list(self.trident_tokenizer.prefix_ids)
        if prefix and add_special_tokens is not False:
            already = add_special_tokens is None and string.startswith(
                self.trident_tokenizer.detokenize(prefix)
            )
            if not already:
                ids = prefix + ids
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.trident_tokenizer.detokenize(list(ids))

    def loglikelihood(
        self, requests: list[Any], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.show_progress)

    # --- scoring -------------------------------------------------------------------------------------------------

    def _loglikelihood_tokens(
        self, requests: list[TokenPair], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """``(sum log p, all greedy)`` of each continuation, batched longest first; in the given order."""
        order = sorted(
            range(len(requests)),
            key=lambda i: (
                -len(requests[i][1] + requests[i][2]),
                tuple(requests[i][1] + requests[i][2]),
            ),
        )
        out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            scored = score_tokens(self.engine, [self._score_request(requests[i]) for i in chunk])
            for i, res in zip(chunk, scored, strict=True):
                out[i] = (float(sum(res.log_probs)), all(res.greedy))
        return out

    def _score_request(self, pair: TokenPair) -> ScoreRequest:
        _, context, continuation = pair
        if not context or not continuation or len(continuation) > self.max_length:
            raise ValueError(
                f"a loglikelihood request has {len(context)} context and {len(continuation)} continuation "
                f"tokens; both must be >= 1 and the continuation at most --max-length ({self.max_length})."
            )
        # the model reads at most max_length tokens: (context + continuation)[:-1], cut from the left
        whole = (context + continuation)[-(self.max_length + 1) :]
        return ScoreRequest(tokens=whole, num_targets=len(continuation))

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each document's total ``log p`` over ``lm_eval``'s disjoint rolling windows."""
        windows: list[TokenPair] = []
        counts: list[int] = []
        for (text,) in (r.args for r in requests):
            doc = [
                (None, *make_disjoint_window(w))
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            windows += doc
            counts.append(len(doc))
        scores = self._loglikelihood_tokens(windows)
        totals, at = [], 0
        for n in counts:
            totals.append(float(sum(s for s, _ in scores[at : at + n])))
            at += n
        return totals

    # --- generation ----------------------------------------------------------------------------------------------

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation, cut at its first stop string (batched longest context first, one
        batch per distinct ``gen_kwargs``)."""
        args = [r.args for r in requests]
        groups: dict[str, list[int]] = {}
        for i, (_, kwargs) in enumerate(args):
            groups.setdefault(repr(sorted(kwargs.items())), []).append(i)
        out = [""] * len(args)
        for rows in groups.values():
            plan = _GenerationPlan.from_kwargs(args[rows[0]][1], self)
            contexts = {  # an empty context starts from the prefix token (as an empty loglikelihood one)
                i: self.tok_encode(args[i][0], left_truncate_len=plan.max_context)
                or [self.prefix_token_id]
                for i in rows
            }
            order = sorted(rows, key=lambda i: (-len(contexts[i]), args[i][0]))
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                for i, text in zip(
                    chunk, self._generate(plan, [contexts[i] for i in chunk], chunk), strict=True
                ):
                    out[i] = text
        return out

    def _generate(
        self, plan: _GenerationPlan, contexts: list[list[int]], indices: list[int]
    ) -> list[str]:
        requests = [
            TokenRequest(
                ids,
                plan.max_gen_toks,
                plan.params,
                torch.Generator().manual_seed(prompt_seed(self.seed, index)),
                stop_token=self.eot_token_id,
            )
            for ids, index in zip(contexts, indices, strict=True)
        ]
        texts = []
        for res in self.engine.generate(requests):
            tokens = res.tokens[:-1] if res.stopped else res.tokens
            texts.append(_cut(self.tok_decode(tokens), plan.until))
        return texts


def _cut(text: str, until: Sequence[str]) -> str:
    """``text`` up to the first occurrence of each stop string in turn (``HFLM``'s post-processing)."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


class _GenerationPlan:
    """One ``gen_kwargs`` of ``generate_until`` in engine terms."""

    def __init__(
        self, params: SamplingParams, until: list[str], max_gen_toks: int, max_context: int
    ) -> None:
        self.params = params
        self.until = until
        self.max_gen_toks = max_gen_toks
        self.max_context = max_context

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], lm: TridentLM) -> _GenerationPlan:
        """Raises ValueError for a budget that leaves no room for the context, or an unknown kwarg."""
        from lm_eval.models.utils import normalize_gen_kwargs

        k = dict(normalize_gen_kwargs(dict(kwargs), lm.max_gen_toks))
        until = list(k.pop("until"))
        eos = lm.tok_decode([lm.eot_token_id])
        if eos not in until:
            until.append(eos)
        max_gen_toks = int(k.pop("max_gen_toks"))
        if not 1 <= max_gen_toks < lm.max_length:
            raise ValueError(
                f"max_gen_toks ({max_gen_toks}) must be in [1, {lm.max_length - 1}]: the context "
                f"({lm.max_length} tokens) must keep room for the prompt."
            )
        do_sample = bool(k.pop("do_sample", False))
        temperature = float(k.pop("temperature", 0.0) or 0.0)
        top_k, top_p = int(k.pop("top_k", 0) or 0), float(k.pop("top_p", 0.0) or 0.0)
        if k:
            raise ValueError(
                f"generation kwargs {sorted(k)} are not supported (Trident reads until, max_gen_toks, "
                "do_sample, temperature, top_k, top_p)."
            )
        greedy = not do_sample or temperature == 0.0
        params = (
            SamplingParams(greedy=True)
            if greedy
            else SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        )
        return cls(params, until, max_gen_toks, lm.max_length - max_gen_toks)


# --- running tasks ----------------------------------------------------------------------------------------------


@contextmanager
def _restored_rng() -> Iterator[None]:
    """``simple_evaluate`` seeds Python's, NumPy's and torch's global generators: put them back afterwards (a run
    that evaluates while it trains keeps its own random streams)."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = (
        torch.cuda.get_rng_state_all()
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else None
    )
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextmanager
def _every_rank_returns_results() -> Iterator[None]:
    """``simple_evaluate`` returns its results only where ``LOCAL_RANK`` is 0 (under a TP launcher it expects one
    process to report); every rank of ours needs them (the same metrics everywhere), so it sees 0 meanwhile."""
    before = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = before


def evaluate_tasks(
    lm: TridentLM,
    tasks: list[str],
    *,
    include_path: str | None,
    limit: int | None = None,
    num_fewshot: int | None = None,
) -> dict[str, dict[str, float]]:
    """Run ``tasks`` with ``lm_eval.simple_evaluate`` on ``lm`` (offline; collective: every rank of the grid calls
    it with the same arguments) and return ``task -> metric -> value`` (numbers only; lm_eval's ``"acc,none"`` is
    ``"acc"``, a metric under another filter keeps its ``",filter"``). The process's random states are restored.

    Raises:
        FileNotFoundError / ValueError: see :func:`~megatron.evaluation.tasks.task_manager` and
            :func:`~megatron.evaluation.tasks.task_specs`; ``limit`` or ``num_fewshot`` out of range.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"--limit ({limit}) must be >= 1 (documents per task).")
    if num_fewshot is not None and num_fewshot < 0:
        raise ValueError(f"--num-fewshot ({num_fewshot}) must be >= 0.")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    manager = task_manager(tasks, include_path)
    specs = task_specs(tasks, manager)
    from lm_eval import simple_evaluate

    with _restored_rng(), _every_rank_returns_results():
        out = simple_evaluate(
            model=lm,
            tasks=specs,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            log_samples=False,
            bootstrap_iters=0,
        )
    if out is None:  # simple_evaluate returns None where lm.rank != 0 (never ours)
        raise RuntimeError("lm_eval returned no results on this rank.")
    return {
        task: {_metric(name): float(v) for name, v in metrics.items() if _is_number(v)}
        for task, metrics in out["results"].items()
    }


def _metric(name: str) -> str:
    return name.removesuffix(",none")


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
