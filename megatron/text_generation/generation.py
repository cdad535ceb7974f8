"""Autoregressive text generation from a Trident checkpoint (one process; the checkpoint may have any layout).

The checkpoint's TP/PP shards (or ZeRO-3 partitions) are merged into one TP = 1 ``GPTModel``
(``megatron.checkpointing.readers``), which runs on one device. The prompt runs once ("prefill"), then every new token runs alone against the
model's KV cache (``megatron.model.InferenceParams``). Large-scale serving (batching many requests, TP inference) is
out of scope: export to Hugging Face for that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.readers import build_megatron_model, read_checkpoint_weights
from megatron.config import ModelConfig
from megatron.model import InferenceParams
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


def generate_tokens(
    logits_fn: LogitsFn | None,
    prompt_ids: Sequence[int],
    *,
    vocab_size: int,
    max_positions: int,
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator,
    eod: int | None = None,
    device: torch.device | str = "cpu",
    step_fn: StepFn | None = None,
) -> list[int]:
    """Tokens generated after ``prompt_ids`` (at most ``max_new_tokens``, stopping after ``eod`` when given).

    Exactly one of ``logits_fn`` (re-runs the whole sequence per token) and ``step_fn`` (feeds only new tokens to
    a KV-cached model) is used; ``step_fn`` wins when both are given.

    Raises:
        ValueError: see :func:`check_lengths` (a request that does not fit is refused, never cut short).
    """
    check_lengths(len(prompt_ids), max_new_tokens, max_positions)
    seq = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)  # [1, s]
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
    """A checkpoint's model and tokenizer, ready to generate.

    Args:
        model: a TP = 1 ``GPTModel`` in eval mode.
        config: its ``ModelConfig`` (true vocabulary, positions).
        tokenizer: a ``MegatronTokenizer``.
        device: where ``model`` lives.
        tokenizer_fallback: ``tokenizer`` is the ``NullTokenizer`` chosen because the checkpoint records no
            tokenizer (errors on text prompts then say so).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        tokenizer: Any,
        device: torch.device,
        *,
        tokenizer_fallback: bool = False,
    ) -> None:
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.device = device
        self.tokenizer_fallback = tokenizer_fallback

    @classmethod
    def from_checkpoint(
        cls,
        ckpt_dir: str | Path,
        *,
        tag: str | None = None,
        tokenizer: dict[str, str] | None = None,
        device: str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> TextGenerator:
        """Load a Trident checkpoint (any TP/PP/ZeRO) and its tokenizer (recorded at training, or ``tokenizer``).

        Without a recorded tokenizer (a ``--vocab-size`` run) the ``NullTokenizer`` is used: prompts and output are
        space-separated token ids.

        Raises:
            FileNotFoundError / ValueError: no checkpoint, unreadable files, or a tokenizer whose vocabulary
                differs from the model's.
        """
        full, cfg, meta = read_checkpoint_weights(ckpt_dir, tag)
        # No tokenizer recorded = trained with --vocab-size only: NullTokenizer (text = space-separated ids,
        # EOD = the last id), as the run used.
        fallback = not (tokenizer or meta.get("tokenizer"))
        info = tokenizer or meta.get("tokenizer") or {"tokenizer_type": "NullTokenizer"}
        files = {
            k: info.get(k)
            for k in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")
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
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = build_megatron_model(full, cfg).to(device=dev, dtype=dtype)
        return cls(model, cfg, tok, dev, tokenizer_fallback=fallback)

    @property
    def max_positions(self) -> int:
        """The context length: learned position table size, else the training sequence length."""
        return self.config.max_position_embeddings or self.config.seq_length

    def prompt_ids(self, prompt: str) -> list[int]:
        """The token ids ``prompt`` starts from (an empty prompt: the EOD token).

        Raises:
            ValueError: the tokenizer rejects the prompt (for a checkpoint without a recorded tokenizer, the
                message says prompts are token ids and how to pass a tokenizer instead).
        """
        if not prompt:
            return [self.tokenizer.eod]
        try:
            return self.tokenizer.tokenize(prompt)
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

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)  # [1, s]
        return self.model(tokens, pos)

    def _cached_step_fn(self) -> StepFn:
        """A fresh KV cache and the step function feeding it (one per generated sample)."""
        cache = InferenceParams(max_batch_size=1, max_sequence_length=self.max_positions)

        def step(tokens: torch.Tensor, offset: int) -> torch.Tensor:
            s = tokens.shape[1]
            pos = torch.arange(offset, offset + s, device=tokens.device).unsqueeze(0)  # [1, s]
            cache.sequence_len_offset = offset
            return self.model(tokens, pos, inference_params=cache)

        return step

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
    ) -> Generated:
        """Continue ``prompt`` (an empty prompt starts from the EOD token, Megatron's unconditional samples).

        ``use_cache=False`` re-runs the whole sequence for every token (the reference the KV cache is tested
        against).

        Raises:
            ValueError / TooManyTokensError: see :meth:`check_request`; nothing is generated then.
        """
        ids = self.check_request(prompt, max_new_tokens)
        out = generate_tokens(
            self._logits,
            ids,
            step_fn=self._cached_step_fn() if use_cache else None,
            vocab_size=self.config.vocab_size,
            max_positions=self.max_positions,
            max_new_tokens=max_new_tokens,
            params=params,
            generator=generator,
            eod=self.tokenizer.eod if stop_at_eod else None,
            device=self.device,
        )
        ended = stop_at_eod and bool(out) and out[-1] == self.tokenizer.eod
        text = self._continuation(ids if prompt else [], out[:-1] if ended else out)
        return Generated(prompt=prompt, text=text, tokens=out, stopped_at_eod=ended)


def _is_int(word: str) -> bool:
    try:
        int(word)
    except ValueError:
        return False
    return True


def _short(text: str, limit: int = 40) -> str:
    """``text`` quoted, cut to ``limit`` characters (for error messages)."""
    return repr(text if len(text) <= limit else text[:limit] + "...")
