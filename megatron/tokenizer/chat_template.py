"""A tokenizer's chat template, rendered as transformers renders it, and the character spans of chosen messages.

Where the template comes from (transformers 5's order): ``--chat-template FILE`` when given, else
``chat_template.jinja`` in the tokenizer folder, else ``chat_templates/default.jinja``, else ``chat_template`` in
``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}`` of which ``default`` is used).

How it renders (the environment transformers builds, learned from its ``chat_template_utils``): Jinja2's immutable
sandbox with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that writes
non-ASCII as is and escapes no HTML, the globals ``raise_exception(msg)`` (a ``TemplateError``) and
``strftime_now(fmt)``, and ``{% generation %}...{% endgeneration %}`` blocks rendered as their body. The template
sees ``messages`` (keys whose value is ``null`` dropped, as transformers drops them), ``add_generation_prompt``,
``tools`` and ``documents`` (``None``), and the tokenizer's named special tokens as strings (``bos_token``,
``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``, ``cls_token``, ``mask_token``: those its
``tokenizer_config.json`` / ``special_tokens_map.json`` set). The rendered text is then tokenized without adding
special tokens, which is what ``AutoTokenizer.apply_chat_template(messages, tokenize=True)`` returns.

Spans (:meth:`ChatTemplate.spans`): message ``i`` of a trained role covers, in the full rendering, the characters
from the end of ``render(messages[:i], add_generation_prompt=True)`` (an assistant message: its content starts
after the role header the generation prompt renders) or of ``render(messages[:i])`` (any other role: its header is
part of it) to the end of ``render(messages[:i + 1])``, less trailing whitespace (ChatML's newline after
``<|im_end|>`` is not part of the turn). Each prefix must be a prefix of the full rendering; a template for which it
is not (one that renders an earlier message differently once later ones follow) is a :class:`ConversationError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from megatron.tokenizer.hf_config import TokenizerFileError, load_json

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The named special tokens transformers passes to a template (its ``special_tokens_map``)."""


class ConversationError(ValueError):
    """One conversation cannot be rendered or masked (the template raised, or is not prefix-stable)."""


@dataclass(frozen=True)
class TemplateSource:
    """A chat template's text and where it was read."""

    text: str
    origin: str


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise TokenizerFileError(f"{what} {path} does not exist.") from None
    except UnicodeDecodeError as e:
        raise TokenizerFileError(f"{what} {path} is not UTF-8 text ({e.reason}).") from None
    except OSError as e:
        raise TokenizerFileError(f"{what} {path} cannot be read ({e.strerror}).") from None


def _config_template(path: str) -> TemplateSource | None:
    """The ``chat_template`` entry of a ``tokenizer_config.json`` (None when it has none)."""
    value = load_json(path, "tokenizer_config.json").get("chat_template")
    if value is None:
        return None
    if isinstance(value, str):
        return TemplateSource(value, f"{path} (chat_template)")
    if isinstance(value, list) and all(isinstance(t, dict) for t in value):
        named = {t.get("name"): t.get("template") for t in value}
        if isinstance(named.get("default"), str):
            return TemplateSource(named["default"], f"{path} (chat_template 'default')")
        names = ", ".join(sorted(str(n) for n in named))
        raise TokenizerFileError(
            f"{path}: chat_template holds the named templates {names} but no 'default'; pass the one to use as "
            "--chat-template FILE."
        )
    raise TokenizerFileError(
        f"{path}: chat_template is a {type(value).__name__}; expected a string or a list of "
        '{"name": ..., "template": ...} objects.'
    )


def find_chat_template(directory: str | None, override: str | None = None) -> TemplateSource | None:
    """The chat template to use (see the module docstring for the order); None when there is none.

    Args:
        directory: the tokenizer folder (None: only ``override`` is looked at).
        override: ``--chat-template FILE``.

    Raises:
        TokenizerFileError: ``override`` is missing or unreadable, or the folder's template entry is malformed.
    """
    if override is not None:
        return TemplateSource(_read_text(override, "--chat-template"), override)
    if directory is None:
        return None
    for name in (CHAT_TEMPLATE_FILE, os.path.join("chat_templates", "default.jinja")):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return TemplateSource(_read_text(path, "the chat template"), path)
    config = os.path.join(directory, "tokenizer_config.json")
    return _config_template(config) if os.path.isfile(config) else None


def template_tokens(directory: str | None) -> dict[str, str]:
    """The named special tokens (strings) a template sees: ``tokenizer_config.json`` over
    ``special_tokens_map.json``; a token set to ``null`` is absent."""
    tokens: dict[str, str | None] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the second wins
        path = os.path.join(directory, name) if directory else ""
        if not path or not os.path.isfile(path):
            continue
        data = load_json(path, name)
        for key in TEMPLATE_TOKENS:
            if key in data:
                value = data[key]
                value = value.get("content") if isinstance(value, dict) else value
                tokens[key] = value if isinstance(value, str) else None
    return {k: v for k, v in tokens.items() if v is not None}


def _environment() -> Any:
    """The sandboxed Jinja2 environment chat templates are written for (see the module docstring)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: transformers' assistant-mask marker; renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
"""Names a message's reasoning may come under; transformers gives templates the first under the first two."""


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to a template: ``null`` values dropped, reasoning under both names."""
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in REASONING_KEYS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


class ChatTemplate:
    """A compiled chat template with the tokenizer's special-token strings.

    Raises:
        TokenizerFileError: the template does not compile (its origin and line named).
    """

    def __init__(self, source: TemplateSource, tokens: Mapping[str, str]) -> None:
        try:
            import jinja2
        except ImportError:
            raise TokenizerFileError(
                f"{source.origin}: rendering a chat template needs Jinja2 (pip install Jinja2==3.1.6, as "
                "requirements.txt pins it)."
            ) from None

        self.origin = source.origin
        self.tokens = dict(tokens)
        try:
            self._template = _environment().from_string(source.text)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerFileError(
                f"{source.origin}: the chat template does not compile (line {e.lineno}: {e.message}); fix it or "
                "pass another with --chat-template FILE."
            ) from None

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False
    ) -> str:
        """The template's text for ``messages``.

        Raises:
            ConversationError: the template raised (``raise_exception``, an undefined value, a type error).
        """
        import jinja2

        chat = [_template_message(m) for m in messages]
        try:
            return str(
                self._template.render(
                    messages=chat,
                    tools=None,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **self.tokens,
                )
            )
        except jinja2.TemplateError as e:
            raise ConversationError(f"the chat template raised: {e}") from None
        except Exception as e:  # noqa: BLE001 (any error of an untrusted template is this conversation's)
            raise ConversationError(f"the chat template raised {type(e).__name__}: {e}") from None

    def spans(
        self, messages: Sequence[Mapping[str, Any]], roles: Sequence[str]
    ) -> tuple[str, list[tuple[int, int]]]:
        """The full rendering and the ``[start, end)`` character spans of the messages whose role is in ``roles``.

        Raises:
            ConversationError: the template raised, or a prefix's rendering is not a prefix of the full one.
        """
        full = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            role = message.get("role")
            if role not in roles:
                continue
            if role == "assistant":
                start = self._prefix_end(full, messages, i, generation_prompt=True)
            else:
                start = self._prefix_end(full, messages, i, generation_prompt=False) if i else 0
            end = self._prefix_end(full, messages, i + 1, generation_prompt=False)
            end = start + len(full[start:end].rstrip())
            if end > start:
                spans.append((start, end))
        return full, spans

    def _prefix_end(
        self, full: str, messages: Sequence[Mapping[str, Any]], n: int, *, generation_prompt: bool
    ) -> int:
        """Length of the rendering of ``messages[:n]``, checked to be a prefix of ``full``."""
        prefix = self.render(messages[:n], add_generation_prompt=generation_prompt)
        if not full.startswith(prefix):
            at = next((k for k, (a, b) in enumerate(zip(prefix, full)) if a != b), len(full))
            what = "with the generation prompt " if generation_prompt else ""
            raise ConversationError(
                f"the chat template is not prefix-stable: its rendering of the first {n} message(s) "
                f"{what}differs from the full conversation's at character {at} "
                f"({prefix[at : at + 20]!r} vs {full[at : at + 20]!r}), so the messages' tokens cannot be found; "
                "pass a template that renders earlier messages the same whatever follows (--chat-template FILE)"
            )
        return len(prefix)
