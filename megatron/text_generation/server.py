"""A REST text-generation server in the shape of Megatron's ``tools/run_text_generation_server.py`` (standard
library only: ``http.server``; one request generates at a time).

``PUT /api`` with a JSON body::

    {"prompts": ["text", ...],            required, 1..max_prompts strings
     "tokens_to_generate": 64,             new tokens per prompt (>= 1)
     "temperature": 1.0, "top_k": 0, "top_p": 0.0,    Megatron's sampling (top_k 1 = greedy; top_k/top_p exclusive)
     "random_seed": 1234,                  optional: same seed, same text
     "stop_at_eod": true}

answers ``200 {"text": [prompt + continuation, ...], "tokens": [[generated ids], ...]}``; a malformed request
answers ``400 {"error": "..."}`` naming the field, another method or path ``405``/``404``.

Slow and vanishing clients (a connection is served by a thread of its own; generation holds one lock):

- ``read_timeout`` (``--read-timeout``, default :data:`DEFAULT_READ_TIMEOUT` s) bounds every wait on the client:
  a connection that sends nothing for that long while its request line or headers are read is closed, and the
  whole body must arrive within ``read_timeout`` of the headers, else the server answers ``408`` and closes. A
  body that ends (the client half-closed) before its ``Content-Length`` is a ``400`` naming both byte counts.
- A client that disconnects (reset, broken pipe) while its request is read or its answer written is one
  ``WARNING`` log line, never a traceback; the thread ends and the server keeps serving.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from megatron.text_generation.generation import TextGenerator
from megatron.text_generation.sampling import SamplingParams

logger = logging.getLogger(__name__)

API_PATH = "/api"
MAX_PROMPTS = 64
MAX_BODY_BYTES = 1 << 20
DEFAULT_READ_TIMEOUT = 60.0
"""Seconds the server waits on a silent client (nginx's client_header/body_timeout default): long enough for a
1 MiB body on a slow link, short enough that stuck connections do not pile up."""
_CHUNK = 1 << 16


class _BodyTimeout(Exception):
    """The body did not arrive within the read timeout (answered with HTTP 408)."""


class RequestError(ValueError):
    """A request the server refuses (answered with HTTP 400 and this message)."""


def _field(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name, default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise RequestError(f"'{name}' must be a {kind.__name__}; got {value!r}.")
    return value


def parse_request(body: Any) -> tuple[list[str], int, SamplingParams, int | None, bool]:
    """Validate a request body: ``(prompts, tokens_to_generate, sampling, seed, stop_at_eod)``.

    Raises:
        RequestError: naming the offending field.
    """
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object with a 'prompts' list.")
    unknown = sorted(
        set(body)
        - {
            "prompts",
            "tokens_to_generate",
            "temperature",
            "top_k",
            "top_p",
            "random_seed",
            "stop_at_eod",
        }
    )
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}.")
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise RequestError("'prompts' must be a non-empty list of strings.")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(
            f"'prompts' holds {len(prompts)} prompts; at most {MAX_PROMPTS} per request."
        )
    tokens = _field(body, "tokens_to_generate", int, 64)
    if tokens < 1:
        raise RequestError(f"'tokens_to_generate' must be >= 1; got {tokens}.")
    seed = body.get("random_seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise RequestError(f"'random_seed' must be a non-negative integer; got {seed!r}.")
    try:
        params = SamplingParams(
            temperature=_field(body, "temperature", float, 1.0),
            top_k=_field(body, "top_k", int, 0),
            top_p=_field(body, "top_p", float, 0.0),
        )
    except RequestError:
        raise
    except ValueError as err:
        raise RequestError(str(err).replace("--", "")) from None
    return prompts, tokens, params, seed, _field(body, "stop_at_eod", bool, True)


class _Handler(BaseHTTPRequestHandler):
    generator: TextGenerator
    lock: threading.Lock
    # ``timeout`` (the read timeout, set by make_server): socketserver applies it to the connection, so every
    # wait on the client is bounded.
    _answering = False

    def handle(self) -> None:
        try:
            super().handle()
        except (ConnectionError, TimeoutError) as err:
            self.close_connection = True
            logger.warning(
                "%s: client %s while %s (%s); request dropped",
                self.address_string(),
                "timed out" if isinstance(err, TimeoutError) else "disconnected",
                "its answer was sent" if self._answering else "its request was read",
                type(err).__name__,
            )

    def _read_body(self) -> Any:
        """The JSON body; all of it within the read timeout.

        Raises:
            RequestError: bad Content-Length, a body cut short, or not JSON.
            _BodyTimeout: the body did not arrive in time.
        """
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise RequestError("the Content-Length header is not a number.") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise RequestError(f"the body is {length} bytes; send 0..{MAX_BODY_BYTES}.")
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        data = bytearray()
        while len(data) < length:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _BodyTimeout(f"{len(data)} of the {length} bytes")
                self.connection.settimeout(left)
            try:
                chunk = self.rfile.read1(min(length - len(data), _CHUNK))
            except TimeoutError:
                raise _BodyTimeout(f"{len(data)} of the {length} bytes") from None
            if not chunk:
                raise RequestError(
                    f"the body ended after {len(data)} of the {length} bytes its Content-Length announced."
                )
            data += chunk
        self.connection.settimeout(self.timeout)
        try:
            return json.loads(bytes(data) or b"null")
        except json.JSONDecodeError as err:
            raise RequestError(f"the body is not JSON ({err.msg} at char {err.pos}).") from None

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        self._answering = True
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path != API_PATH:
            self._reply(404, {"error": f"unknown path {self.path}; use PUT {API_PATH}."})
            return
        try:
            body = self._read_body()
        except _BodyTimeout as err:
            self.close_connection = True
            logger.warning(
                "%s: 408, the body did not arrive within %g s (%s received)",
                self.address_string(),
                self.timeout,
                err,
            )
            self._reply(
                408,
                {
                    "error": f"the body did not arrive within {self.timeout:g} s ({err} announced by "
                    "Content-Length were received); send the whole body at once."
                },
            )
            return
        except RequestError as err:
            self.close_connection = True
            self._reply(400, {"error": str(err)})
            return
        try:
            prompts, tokens, params, seed, stop = parse_request(body)
            with self.lock:
                for prompt in prompts:  # every prompt fits before any is generated
                    self.generator.check_request(prompt, tokens)
                # A seed of the request's own (or a fresh one): the global torch RNG is not touched.
                g = torch.Generator().manual_seed(
                    seed if seed is not None else secrets.randbits(63)
                )
                out = [
                    self.generator.generate(
                        p, max_new_tokens=tokens, params=params, generator=g, stop_at_eod=stop
                    )
                    for p in prompts
                ]
        except (RequestError, ValueError) as err:
            self._reply(400, {"error": str(err)})
            return
        except (
            Exception
        ) as err:  # a bug or a device error: answer instead of dropping the connection
            logger.exception("generation failed")
            self._reply(500, {"error": f"generation failed: {type(err).__name__}: {err}"})
            return
        self._reply(
            200, {"text": [o.prompt + o.text for o in out], "tokens": [o.tokens for o in out]}
        )

    def _not_allowed(self) -> None:
        self._reply(405, {"error": f"use PUT {API_PATH} with a JSON body."})

    do_GET = do_POST = do_DELETE = _not_allowed  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        logger.info("%s %s", self.address_string(), format % args)

    def log_error(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        logger.warning("%s: %s", self.address_string(), format % args)


def check_server_args(port: int, read_timeout: float | None) -> None:
    """Refuse a port outside 0..65535 and a read timeout that is not a finite number of seconds > 0 (the
    tool calls this before it loads the checkpoint).

    Raises:
        ValueError: naming the flag, its value and the valid range.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port} must be in 0..65535 (0 picks a free port).")
    if read_timeout is not None and not (0 < read_timeout < math.inf):  # also refuses nan
        raise ValueError(
            f"--read-timeout ({read_timeout}) must be a finite number of seconds > 0 "
            f"(default {DEFAULT_READ_TIMEOUT:g})."
        )


def make_server(
    generator: TextGenerator,
    host: str,
    port: int,
    *,
    read_timeout: float | None = DEFAULT_READ_TIMEOUT,
) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) answering ``PUT /api`` with ``generator``; port 0 picks a free one.

    ``read_timeout``: seconds to wait on a silent client (module docstring); None waits forever.

    Raises:
        ValueError: ``port`` outside 0..65535 or ``read_timeout`` not > 0.
        OSError: the address cannot be bound (in use, unknown host).
    """
    check_server_args(port, read_timeout)
    handler = type(
        "TextGenerationHandler",
        (_Handler,),
        {"generator": generator, "lock": threading.Lock(), "timeout": read_timeout},
    )
    return ThreadingHTTPServer((host, port), handler)
