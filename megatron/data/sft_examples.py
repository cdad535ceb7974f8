"""One SFT example (a chat or a prompt/response pair, one JSONL line) -> its token ids and loss mask.

A line is a chat when it has the messages key (``{"messages": [{"role": ..., "content": ...}, ...]}``), else a pair
when it has the prompt and response keys (``{"prompt": ..., "response": ...}``); the key names are options.

* With a chat template (:mod:`megatron.tokenizer.chat_template`): a pair is the chat ``[user: prompt, assistant:
  response]``. The ids are the tokenized rendering, exactly ``AutoTokenizer.apply_chat_template(messages,
  tokenize=True)``. The mask is 1 on the tokens of the trained roles' spans (default: each assistant message from the
  first token of its content through the end-of-turn token(s) closing it, not its role header), found by rendering
  prefixes of the conversation, then mapped to tokens with the tokenizer's character offsets: a token is a target
  when any of its characters is in a span, so a token straddling a span's edge (a header's ``\\n`` merged with a
  content that starts with a newline) is a target, as in transformers' ``return_assistant_tokens_mask``.
* Without one, only pairs: ``prefix_ids`` (the tokenizer's own BOS, e.g. Llama 3's) + the prompt's ids + the
  response's ids + EOS, the prompt and response tokenized separately (the boundary is a token boundary, as when the
  prompt alone is given to generation); the mask is 1 on the response and the EOS.

The trained roles ``all`` make every token a target. A line that cannot become an example (not JSON, no messages or
prompt/response, a message that is not ``{"role": str, ...}``, no message of a trained role, a template that raises
or is not prefix-stable, no tokens) is a bad line: :class:`BadExample` with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron.data.jsonl_input import describe_keys, parse_object
from megatron.tokenizer import HFTokenizer, MegatronTokenizer, TokenizerFileError, build_tokenizer
from megatron.tokenizer.chat_template import (
    ChatTemplate,
    ConversationError,
    find_chat_template,
    template_tokens,
)

ALL_ROLES = "all"
"""The ``--sft-loss-roles`` value that makes every token a target."""


class BadExample(ValueError):
    """A line that cannot become an SFT example; the message is the reason (no file or line)."""


@dataclass(frozen=True)
class SftOptions:
    """What an SFT line looks like and which tokens are targets."""

    messages_key: str = "messages"
    """Key of a chat's message list (``--messages-key``)."""
    prompt_key: str = "prompt"
    """Key of a pair's prompt (``--prompt-key``)."""
    response_key: str = "response"
    """Key of a pair's response (``--response-key``)."""
    loss_roles: tuple[str, ...] = ("assistant",)
    """Roles whose messages are targets (``--sft-loss-roles``); ``("all",)``: every token."""
    chat_template: str | None = None
    """A Jinja file overriding the tokenizer's template (``--chat-template``)."""

    def check(self) -> None:
        """Raises ValueError naming the flag for unusable options."""
        for flag, key in (
            ("--messages-key", self.messages_key),
            ("--prompt-key", self.prompt_key),
            ("--response-key", self.response_key),
        ):
            if not key:
                raise ValueError(f"{flag} must be a non-empty key name.")
        if self.prompt_key == self.response_key:
            raise ValueError(
                f"--prompt-key and --response-key are both {self.prompt_key!r}; give two different keys."
            )
        if not self.loss_roles or (ALL_ROLES in self.loss_roles and len(self.loss_roles) > 1):
            raise ValueError(
                f"--sft-loss-roles {' '.join(self.loss_roles)}: give role names (e.g. assistant), or '{ALL_ROLES}' "
                "alone for every token."
            )

    @property
    def all_tokens(self) -> bool:
        return self.loss_roles == (ALL_ROLES,)


@dataclass(frozen=True)
class Example:
    """One example's token ids and loss mask (uint8, 1 = target), of equal length."""

    ids: list[int]
    mask: np.ndarray
    chat: bool
    """A chat line (else a prompt/response pair)."""


def load_template(
    tokenizer_type: str | None, tokenizer_model: str | None, override: str | None
) -> ChatTemplate | None:
    """The chat template of the tokenizer folder ``tokenizer_model`` (or ``override``), None when there is none.

    Raises:
        TokenizerFileError: the template is unreadable or does not compile, or the tokenizer is not an
            ``HFTokenizer`` (a template needs the folder's special tokens and the character offsets of tokens).
    """
    folder = None
    if tokenizer_type == "HFTokenizer" and tokenizer_model:
        folder = (
            tokenizer_model if os.path.isdir(tokenizer_model) else os.path.dirname(tokenizer_model)
        )
    source = find_chat_template(folder, override)
    if source is None:
        return None
    if tokenizer_type != "HFTokenizer":
        raise TokenizerFileError(
            f"--chat-template needs --tokenizer-type HFTokenizer (a tokenizer folder: its special tokens and "
            f"token offsets), not {tokenizer_type}; or drop --chat-template to write prompt + response + EOS."
        )
    return ChatTemplate(source, template_tokens(folder))


def build_sft_tokenizer(
    tokenizer_kwargs: dict[str, Any], template: ChatTemplate | None
) -> MegatronTokenizer:
    """The tokenizer; with a template an ``HFTokenizer`` without the fast encoder (chats are tokenized by the
    reference, which gives the offsets), so its start-up skips building and probing it."""
    model = tokenizer_kwargs.get("tokenizer_model")
    if template is None or not model:  # (no model: build_tokenizer names the missing flag)
        return build_tokenizer(**tokenizer_kwargs)
    return HFTokenizer(model, fast=False)


def target_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 for every token whose characters ``[start, end)`` meet a span (a zero-width token: its start is in one).

    Args:
        offsets: each token's character range, in order.
        spans: sorted, non-overlapping character ranges.
    """
    if not len(offsets):
        return np.zeros(0, dtype=np.uint8)
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = off[:, 0], np.maximum(off[:, 1], off[:, 0] + 1)
    if not spans:
        return np.zeros(len(off), dtype=np.uint8)
    sp = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    j = np.searchsorted(
        sp[:, 1], starts, side="right"
    )  # the first span ending after the token starts
    hit = j < len(sp)
    hit[hit] = sp[j[hit], 0] < ends[hit]
    return hit.astype(np.uint8)


def _messages(value: Any, key: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        what = "an empty list" if isinstance(value, list) else f"a {type(value).__name__}"
        raise BadExample(f"key {key!r} is {what}; expected a non-empty list of messages")
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise BadExample(f"{key}[{i}] is a {type(message).__name__}; expected an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise BadExample(
                f"{key}[{i}] has {'no' if role is None else 'a non-string'} 'role'; every message needs "
                '{"role": "user"|"assistant"|..., "content": ...}'
            )
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadExample(
                f"{key}[{i}] 'content' is a {type(content).__name__}; expected a string"
            )
    return value


class SftExampleEncoder:
    """Turns parsed JSONL lines into :class:`Example` s (built once, then forked into the workers)."""

    def __init__(
        self, tokenizer: MegatronTokenizer, template: ChatTemplate | None, options: SftOptions
    ) -> None:
        """Raises ValueError when, without a template, the trained roles cover no token of a pair."""
        self.tokenizer = tokenizer
        self.template = template
        self.options = options
        if (
            template is None
            and not options.all_tokens
            and not {"user", "assistant"} & set(options.loss_roles)
        ):
            raise ValueError(
                f"--sft-loss-roles {' '.join(options.loss_roles)} trains on no token: without a chat template "
                "only prompt/response pairs are read, whose roles are user and assistant."
            )
        if template is None:
            _ = (
                tokenizer.eod
            )  # a pair ends with EOS: a tokenizer without one fails here, naming its fix

    def example(self, line: bytes) -> Example:
        """The example on one JSONL line.

        Raises:
            BadExample: why the line is bad.
        """
        obj, reason = parse_object(line)
        if obj is None:
            raise BadExample(reason)
        opts = self.options
        if opts.messages_key in obj:
            return self._chat(_messages(obj[opts.messages_key], opts.messages_key), chat=True)
        if opts.prompt_key in obj and opts.response_key in obj:
            prompt, response = obj[opts.prompt_key], obj[opts.response_key]
            for key, value in ((opts.prompt_key, prompt), (opts.response_key, response)):
                if not isinstance(value, str):
                    raise BadExample(f"key {key!r} is a {type(value).__name__}; expected a string")
            if self.template is None:
                return self._plain_pair(prompt, response)
            pair = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return self._chat(pair, chat=False)
        raise BadExample(
            f"neither key {opts.messages_key!r} nor keys {opts.prompt_key!r} and {opts.response_key!r} "
            f"(the line has keys: {describe_keys(obj)}); check --messages-key / --prompt-key / --response-key"
        )

    def _chat(self, messages: list[dict[str, Any]], *, chat: bool) -> Example:
        if self.template is None:
            raise BadExample(
                "a chat needs a chat template, and the tokenizer folder has none (no chat_template.jinja, no "
                "chat_template in tokenizer_config.json); pass one with --chat-template FILE"
            )
        roles = self.options.loss_roles
        if not self.options.all_tokens and not any(m["role"] in roles for m in messages):
            raise BadExample(
                f"no message of the trained roles ({', '.join(roles)}): nothing to train on; fix the line, or "
                "choose the roles with --sft-loss-roles"
            )
        try:
            text, spans = self.template.spans(messages, () if self.options.all_tokens else roles)
        except ConversationError as e:
            raise BadExample(str(e)) from None
        ids, offsets = self.tokenizer.tokenize_with_offsets(text)  # type: ignore[attr-defined]
        if not ids:
            raise BadExample(f"the chat template ({self.template.origin}) renders no tokens")
        mask = (
            np.ones(len(ids), dtype=np.uint8)
            if self.options.all_tokens
            else target_mask(offsets, spans)
        )
        return Example(list(ids), mask, chat)

    def _tokenize(self, text: str) -> list[int]:
        try:
            return self.tokenizer.tokenize(text) if text else []
        except ValueError as e:
            raise BadExample(f"the tokenizer rejected the text: {e}") from None

    def _plain_pair(self, prompt: str, response: str) -> Example:
        roles, every = self.options.loss_roles, self.options.all_tokens
        head = list(self.tokenizer.prefix_ids)
        prompt_ids = self._tokenize(prompt)
        tail = [*self._tokenize(response), self.tokenizer.eod]
        mask = np.concatenate(
            [
                np.full(len(head), every, dtype=np.uint8),
                np.full(len(prompt_ids), every or "user" in roles, dtype=np.uint8),
                np.full(len(tail), every or "assistant" in roles, dtype=np.uint8),
            ]
        )
        return Example([*head, *prompt_ids, *tail], mask, chat=False)
