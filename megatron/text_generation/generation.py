"""Autoregressive text generation from a Trident checkpoint, in one process or at a TP x PP layout.

:class:`TextGenerator` pairs the tokenizer with an :class:`~megatron.text_generation.engine.InferenceEngine` over
this rank's pipeline stage. In one process the stage is the whole model (any checkpoint layout is read into it);
launched like training (``torchrun``, ``deepspeed``, ``srun``) with ``--tensor-model-parallel-size`` and
``--pipeline-model-parallel-size`` each rank reads only its shard of its stage
(``megatron.text_generation.distributed``), and every public generation method is collective: every rank calls it
with the same arguments and gets the same result. The prompt runs once ("prefill"), then each new token runs alone
against the KV cache (``megatron.model.InferenceParams``); several prompts form one left-padded batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron.config import ModelConfig
from megatron.launch.device import requested_device
from megatron.model.stage import GPTStage
from megatron.mpu.mappings import broadcast_object
from megatron.mpu.parallel_state import ProcessGroup
from megatron.text_generation.distributed import InferenceLayout, load_stage
from megatron.text_generation.engine import InferenceEngine, TokenRequest, TokenResult
from megatron.text_generation.sampling import SamplingParams, sample_next
from megatron.tokenizer import build_tokenizer, encoding_fingerprint

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
"""``tokens [1, s] int64 -> logits [1, s, v']`` (``v' >= vocab``): the whole sequence each call."""

StepFn = Callable[[torch.Tensor, int], torch.Tensor]
"""``(new tokens [1, s], offset) -> logits [1, s, v']``: only the tokens after ``offset`` (a KV-cached model)."""


@dataclass(frozen=True)
class Generated:
    """One generated sample."""

    prompt: str
    text: str
    """The generated continuation (the prompt not repeated; the EOD token not included)."""
    tokens: list[int]
    """Generated token ids (EOD included when the sample ended with it)."""
    stopped_at_eod: bool
    log_probs: list[float] | None = None
    """log p of each generated token (the model's distribution: temperature 1, no filters), when asked."""
    prompt_log_probs: list[float] | None = None
    """log p(prompt[i] | prompt[:i]) for i = 1 .. len(prompt) - 1, when asked."""
    score: float | None = None
    """Beam search: the hypothesis's length-penalised score."""


def prompt_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th prompt (or sample) of a request seeded with ``seed``: each prompt draws from its
    own stream, so its text depends on the seed and its place in the request, never on how it was batched."""
    return (seed * 1_000_003 + index) % (1 << 63)


@dataclass(frozen=True)
class PromptRequest:
    """One prompt of a batch (:meth:`TextGenerator.generate_requests`)."""

    prompt: str
    max_new_tokens: int
    params: SamplingParams
    seed: int
    """This prompt's own ``torch.Generator().manual_seed(seed)``: its output never depends on its batch-mates."""
    stop_at_eod: bool = True
    return_log_probs: bool = False


class TooManyTokensError(ValueError):
    """The prompt plus the requested new tokens do not fit in the model's context (Megatron: "Too many tokens").

    The message names no flag (the REST server and the CLI call the knob differently); ``prompt_tokens``,
    ``max_new_tokens`` and ``context`` let a caller say it in its own terms.
    """

    def __init__(self, prompt_tokens: int, max_new_tokens: int, context: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.context = context
        super().__init__(
            f"too many tokens: the prompt has {prompt_tokens} tokens and {max_new_tokens} new tokens were "
            f"requested ({prompt_tokens + max_new_tokens} in all), more than the model's context of {context} "
            f"positions; request at most {context - prompt_tokens} new tokens."
        )


def check_lengths(prompt_tokens: int, max_new_tokens: int, max_positions: int) -> None:
    """Refuse a request that cannot be generated in full (as Megatron does; nothing is silently cut).

    Raises:
        ValueError: an empty prompt, a prompt that fills the context, or ``max_new_tokens < 1``.
        TooManyTokensError: the prompt and ``max_new_tokens`` together exceed ``max_positions``.
    """
    if prompt_tokens < 1:
        raise ValueError("the prompt has no tokens; an empty prompt starts from the EOD token.")
    if max_new_tokens < 1:
        raise ValueError(f"--out-seq-length ({max_new_tokens}) must be >= 1.")
    if prompt_tokens >= max_positions:
        raise ValueError(
            f"the prompt has {prompt_tokens} tokens; the model's context is {max_positions}, so nothing "
            "can be generated. Shorten the prompt."
        )
    if prompt_tokens + max_new_tokens > max_positions:
        raise TooManyTokensError(prompt_tokens, max_new_tokens, max_positions)


@dataclass(frozen=True)
class LogitsSource:
    """The model as :func:`generate_tokens` sees it: how to get logits, and its sizes.

    Exactly one of ``logits_fn`` (re-runs the whole sequence per token) and ``step_fn`` (feeds only new tokens to
    a KV-cached model) is used; ``step_fn`` wins when both are given.
    """

    vocab_size: int
    """The true vocabulary: logit columns beyond it (the padded rows) are never sampled."""
    max_positions: int
    """The model's context: the prompt plus the new tokens must fit in it."""
    logits_fn: LogitsFn | None = None
    step_fn: StepFn | None = None
    device: torch.device | str = "cpu"
    """Where the token tensors are made."""


def generate_tokens(
    model: LogitsSource,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator,
    eod: int | None = None,
) -> list[int]:
    """Tokens generated after ``prompt_ids`` (at most ``max_new_tokens``, stopping after ``eod`` when given).

    Raises:
        ValueError: see :func:`check_lengths` (a request that does not fit is refused, never cut short); ``model``
            has neither ``logits_fn`` nor ``step_fn``.
    """
    check_lengths(len(prompt_ids), max_new_tokens, model.max_positions)
    vocab_size, step_fn, logits_fn = model.vocab_size, model.step_fn, model.logits_fn
    seq = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)  # [1, s]
    fresh, offset = seq, 0  # tokens the cached model has not seen yet, and how many it has
    out: list[int] = []
    for _ in range(max_new_tokens):
        if step_fn is not None:
            logits = step_fn(fresh, offset)[:, -1, :vocab_size]  # [1, s_new, v'] -> [1, v]
            offset += fresh.shape[1]
        elif logits_fn is not None:
            logits = logits_fn(seq)[:, -1, :vocab_size]  # [1, s, v'] -> [1, v]
        else:
            raise ValueError("generate_tokens needs logits_fn or step_fn.")
        nxt = sample_next(logits, params, generator)  # [1]
        out.append(int(nxt.item()))
        fresh = nxt.view(1, 1)
        seq = torch.cat([seq, fresh], dim=1)  # [1, s] -> [1, s + 1]
        if eod is not None and out[-1] == eod:
            break
    return out


class TextGenerator:
    """A checkpoint's model (this rank's pipeline stage) and tokenizer, ready to generate.

    Args:
        model: a TP = 1 ``GPTModel`` in eval mode (one process), or this rank's ``GPTStage``.
        config: its ``ModelConfig`` (true vocabulary, positions).
        tokenizer: a ``MegatronTokenizer``.
        device: where ``model`` lives.
        tokenizer_fallback: ``tokenizer`` is the ``NullTokenizer`` chosen because the checkpoint records no
            tokenizer (errors on text prompts then say so).
        pp_group: the pipeline group of a ``GPTStage`` (None: one stage).
        micro_batch_size: rows per micro-batch through the pipeline (None: ``ceil(batch / PP)``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        tokenizer: Any,
        device: torch.device,
        *,
        tokenizer_fallback: bool = False,
        pp_group: ProcessGroup | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        self.model = model
        self.stage = model if isinstance(model, GPTStage) else GPTStage.from_model(model)  # type: ignore[arg-type]
        self.config = config
        self.tokenizer = tokenizer
        self.device = device
        self.tokenizer_fallback = tokenizer_fallback
        self.engine = InferenceEngine(
            self.stage, pp_group=pp_group, device=device, micro_batch_size=micro_batch_size
        )

    @classmethod
    def from_checkpoint(
        cls,
        ckpt_dir: str | Path,
        *,
        tag: str | None = None,
        tokenizer: dict[str, str] | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        micro_batch_size: int | None = None,
        layout: InferenceLayout | None = None,
        verify_checksums: bool = True,
    ) -> TextGenerator:
        """Load a Trident checkpoint (any saved TP/PP/ZeRO) at ``layout`` (what ``init_inference_distributed``
        returned; collective: every rank calls it) or, without one, whole in this process, and its tokenizer
        (recorded at training, or ``tokenizer``). ``verify_checksums=False`` compares the files' sizes only, not
        their SHA-256 (``--no-verify-checkpoint-checksums``).

        Without a recorded tokenizer (a ``--vocab-size`` run) the ``NullTokenizer`` is used: prompts and output are
        space-separated token ids.

        Raises:
            FileNotFoundError / ValueError: no checkpoint, unreadable files, or a tokenizer whose vocabulary
                differs from the model's.
        """
        # a torch.device (what init_inference_distributed chose) is checked like a --device string
        dev = torch.device(requested_device(None if device is None else str(device)))
        layout = layout or InferenceLayout(device=dev)
        stage, cfg, meta = load_stage(
            ckpt_dir,
            tag,
            dtype=dtype,
            device=dev,
            tp_group=layout.tp_group,
            pp_group=layout.pp_group,
            verify_checksums=verify_checksums,
        )
        tok, fallback = _checkpoint_tokenizer(cfg, meta, tokenizer)
        return cls(
            stage,
            cfg,
            tok,
            dev,
            tokenizer_fallback=fallback,
            pp_group=layout.pp_group,
            micro_batch_size=micro_batch_size,
        )

    @property
    def max_positions(self) -> int:
        """The context length: learned position table size, else the training sequence length."""
        return self.config.max_position_embeddings or self.config.seq_length

    @property
    def is_server_rank(self) -> bool:
        """Global rank 0 (or a single process): the rank that talks to users."""
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

    def broadcast_work(self, obj: Any) -> Any:
        """Global rank 0's picklable ``obj`` on every rank (collective; the identity in one process)."""
        return broadcast_object(obj)

    def prompt_ids(self, prompt: str) -> list[int]:
        """The token ids ``prompt`` starts from: the tokenizer's own prefix exactly once (Llama 3's
        ``<|begin_of_text|>``), then the prompt's ids (an empty prompt without a prefix: the EOD token).

        Raises:
            ValueError: the tokenizer rejects the prompt (for a checkpoint without a recorded tokenizer, the
                message says prompts are token ids and how to pass a tokenizer instead).
        """
        try:
            return self.tokenizer.tokenize_prompt(prompt)
        except ValueError as e:
            word = next((w for w in prompt.split() if not _is_int(w)), None)
            if not self.tokenizer_fallback or word is None:
                raise
            raise ValueError(
                f"the prompt {_short(prompt)} is not token ids ({word!r} is not an integer): this checkpoint "
                "records no tokenizer (it was trained with --vocab-size only), so prompts are token ids "
                f"separated by spaces, e.g. '12 7 40' (ids 0..{self.tokenizer.eod}); or pass --tokenizer-type "
                "and its files (--vocab-file/--merge-file or --tokenizer-model) to use a tokenizer."
            ) from e

    def check_request(self, prompt: str, max_new_tokens: int) -> list[int]:
        """``prompt``'s token ids, after checking that ``max_new_tokens`` more fit in the context.

        Raises:
            ValueError / TooManyTokensError: see :meth:`prompt_ids` and :func:`check_lengths`.
        """
        ids = self.prompt_ids(prompt)
        check_lengths(len(ids), max_new_tokens, self.max_positions)
        return ids

    def _continuation(self, prompt_ids: list[int], new_ids: list[int]) -> str:
        """The text ``new_ids`` add after the prompt (decoded together: a SentencePiece word start after the
        prompt keeps its space, which decoding ``new_ids`` alone would drop)."""
        alone = self.tokenizer.detokenize(new_ids)
        if not prompt_ids:
            return alone
        head = self.tokenizer.detokenize(prompt_ids)
        whole = self.tokenizer.detokenize(prompt_ids + new_ids)
        return whole[len(head) :] if whole.startswith(head) else alone

    def _generated(
        self, prompt: str, ids: list[int], out: TokenResult, stop: int | None
    ) -> Generated:
        ended = stop is not None and bool(out.tokens) and out.tokens[-1] == stop
        text = self._continuation(ids if prompt else [], out.tokens[:-1] if ended else out.tokens)
        return Generated(
            prompt=prompt,
            text=text,
            tokens=list(out.tokens),
            stopped_at_eod=ended and stop == self.tokenizer.eod,
            log_probs=list(out.log_probs) if out.log_probs else None,
            prompt_log_probs=out.prompt_log_probs,
            score=out.score,
        )

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Whole-sequence logits ``[1, s] -> [1, s, vp]`` without the cache (one stage, one TP rank)."""
        if self.engine.pp_size > 1 or self.stage.parallel.tp_size > 1:
            raise ValueError("generation without the KV cache runs in one process (TP = PP = 1).")
        pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)  # [1, s]
        return self.stage(tokens, pos).transpose(0, 1)  # [s, 1, vp] -> [1, s, vp]

    @torch.no_grad()
    def generate(
        self,
        prompt: str,
        *,
        max_new_tokens: int,
        params: SamplingParams,
        generator: torch.Generator,
        stop_at_eod: bool = True,
        use_cache: bool = True,
        return_log_probs: bool = False,
    ) -> Generated:
        """Continue ``prompt`` (an empty prompt starts from the EOD token, Megatron's unconditional samples).

        ``use_cache=False`` re-runs the whole sequence for every token (the reference the KV cache is tested
        against; one process only). Collective at TP/PP > 1.

        Raises:
            ValueError / TooManyTokensError: see :meth:`check_request`; nothing is generated then.
        """
        ids = self.check_request(prompt, max_new_tokens)
        stop = self.tokenizer.eod if stop_at_eod else None
        if use_cache:
            req = TokenRequest(ids, max_new_tokens, params, generator, stop, return_log_probs)
            return self._generated(prompt, ids, self.engine.generate([req])[0], stop)
        model = LogitsSource(
            self.config.vocab_size, self.max_positions, logits_fn=self._logits, device=self.device
        )
        out = generate_tokens(
            model, ids, max_new_tokens=max_new_tokens, params=params, generator=generator, eod=stop
        )
        return self._generated(prompt, ids, TokenResult(tokens=out), stop)

    @torch.no_grad()
    def generate_requests(self, requests: Sequence[PromptRequest]) -> list[Generated]:
        """Generate every request in one batch (collective); each prompt's output is what it would be alone.

        Raises:
            ValueError / TooManyTokensError: a request that does not fit (nothing is generated then).
        """
        ids = [self.check_request(r.prompt, r.max_new_tokens) for r in requests]
        stops = [self.tokenizer.eod if r.stop_at_eod else None for r in requests]
        token_requests = [
            TokenRequest(
                i,
                r.max_new_tokens,
                r.params,
                torch.Generator().manual_seed(r.seed),
                stop,
                r.return_log_probs,
            )
            for i, r, stop in zip(ids, requests, stops, strict=True)
        ]
        outs = self.engine.generate(token_requests)
        return [
            self._generated(r.prompt, i, o, stop)
            for r, i, o, stop in zip(requests, ids, outs, stops, strict=True)
        ]

    @torch.no_grad()
    def beam_search(
        self,
        prompt: str,
        *,
        beam_width: int,
        max_new_tokens: int,
        stop_token: int | None = None,
        length_penalty: float = 1.0,
        num_return_gen: int = 1,
    ) -> list[Generated]:
        """Megatron's beam search from ``prompt`` (collective); best first, ``score`` set.

        ``stop_token`` (default: EOD) ends a hypothesis; it is the last of its ``tokens``, not in its text.

        Raises:
            ValueError / TooManyTokensError: see :meth:`check_request`; a bad beam width or count.
        """
        ids = self.check_request(prompt, max_new_tokens)
        stop = self.tokenizer.eod if stop_token is None else stop_token
        outs = self.engine.beam_search(
            ids,
            beam_width=beam_width,
            max_new_tokens=max_new_tokens,
            stop_token=stop,
            length_penalty=length_penalty,
            num_return=num_return_gen,
        )
        return [self._generated(prompt, ids, o, stop if o.stopped else None) for o in outs]


def _checkpoint_tokenizer(
    cfg: ModelConfig, meta: dict[str, Any], tokenizer: dict[str, str] | None
) -> tuple[Any, bool]:
    """The tokenizer to generate with and whether it is the ``NullTokenizer`` fallback.

    Raises:
        ValueError: its vocabulary or encoding differs from the training tokenizer's.
    """
    # No tokenizer recorded = trained with --vocab-size only: NullTokenizer (text = space-separated ids,
    # EOD = the last id), as the run used.
    fallback = not (tokenizer or meta.get("tokenizer"))
    info = tokenizer or meta.get("tokenizer") or {"tokenizer_type": "NullTokenizer"}
    files = {
        k: info.get(k) for k in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")
    }
    tok = build_tokenizer(**files, vocab_size=cfg.vocab_size - 1)
    if tok.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"the {info['tokenizer_type']} tokenizer has {tok.vocab_size} tokens but the model was "
            f"trained with {cfg.vocab_size}; pass the training tokenizer's flags."
        )
    trained = (meta.get("tokenizer") or {}).get("fingerprint")
    if trained and encoding_fingerprint(tok) != trained:
        raise ValueError(
            f"the {info['tokenizer_type']} tokenizer encodes text into other ids than the one the model was "
            "trained with (its files changed since training, or they are another tokenizer's); pass the "
            "training tokenizer's flags."
        )
    return tok, fallback


def _is_int(word: str) -> bool:
    try:
        int(word)
    except ValueError:
        return False
    return True


def _short(text: str, limit: int = 40) -> str:
    """``text`` quoted, cut to ``limit`` characters (for error messages)."""
    return repr(text if len(text) <= limit else text[:limit] + "...")
