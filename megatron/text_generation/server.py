"""A batched REST text-generation server in the shape of Megatron's ``tools/run_text_generation_server.py``
(standard library only: ``http.server``), at any TP x PP layout.

``PUT /api`` with a JSON body::

    {"prompts": ["text", ...],            required, 1..max_prompts strings
     "tokens_to_generate": 64,             new tokens per prompt (>= 1)
     "temperature": 1.0, "top_k": 0, "top_p": 0.0,    Megatron's sampling (top_k 1 = greedy; top_k/top_p exclusive)
     "random_seed": 1234,                  optional, 0..2**63-1: same seed, same text (see scheduler.py)
     "stop_at_eod": true,
     "logprobs": false,                    true: also answer "logprobs" (Megatron's shape, below)
     "beam_width": 4,                      beam search instead of sampling (exactly one prompt)
     "stop_token": 50256,                  beam search only: the token that ends a beam (default: EOD)
     "length_penalty": 1.0}                beam search only (Megatron's)

answers ``200 {"text": [prompt + continuation, ...], "tokens": [[generated ids], ...]}``, plus
``"logprobs": [[log p of prompt tokens 1..n-1, then of every generated token], ...]`` when asked; beam search
answers one entry per beam (best first) and ``"scores": [...]``. A malformed request answers ``400 {"error":
"..."}`` naming the field, as does a body that is not UTF-8, not JSON, or nested deeper than
:data:`MAX_JSON_DEPTH`; a full queue or a server shutting down ``503`` (with ``Retry-After``); another method or
path ``405``/``404``. ``GET /health`` answers ``200 {"status": "ok", "queue": prompts waiting, ...}``
(``503`` while shutting down).

Batching, seeds, the queue bound and what the other ranks do: ``megatron.text_generation.scheduler``. The
scheduler's loop runs in the thread that calls :meth:`TextGenerationServer.serve_forever`;
:meth:`~TextGenerationServer.stop` (the tool calls it on SIGTERM or Ctrl-C) stops accepting connections, lets
the batch in progress finish and be answered, answers 503 to every prompt still queued, then broadcasts ``stop``.

Slow and vanishing clients (a connection is served by a thread of its own):

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
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from megatron.text_generation.engine import check_length_penalty
from megatron.text_generation.generation import TextGenerator
from megatron.text_generation.sampling import SamplingParams
from megatron.text_generation.scheduler import (
    DEFAULT_BATCH_WAIT_MS,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_QUEUE,
    HEARTBEAT_S,
    STOP,
    ApiRequest,
    RequestError,
    Scheduler,
    Unavailable,
    world_size,
)

logger = logging.getLogger(__name__)

__all__ = [
    "RequestError",
    "TextGenerationServer",
    "check_server_args",
    "make_server",
    "parse_request",
]

API_PATH = "/api"
HEALTH_PATH = "/health"
MAX_PROMPTS = 64
MAX_BODY_BYTES = 1 << 20
DEFAULT_READ_TIMEOUT = 60.0
"""Seconds the server waits on a silent client (nginx's client_header/body_timeout default): long enough for a
1 MiB body on a slow link, short enough that stuck connections do not pile up."""
MAX_JSON_DEPTH = 32
"""Deepest array/object nesting a body may have (a request needs 2; ``json`` recurses once per level)."""
_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
"""A JSON string (skipped whole, escapes included) or one bracket."""
_CHUNK = 1 << 16
_SEED_BOUND = 1 << 63
_FIELDS = frozenset((
    "prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "random_seed", "stop_at_eod",
    "logprobs", "beam_width", "stop_token", "length_penalty",
))  # fmt: skip


class _BodyTimeout(Exception):
    """The body did not arrive within the read timeout (answered with HTTP 408)."""


def _field(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name, default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise RequestError(f"'{name}' must be a {kind.__name__}; got {value!r}.")
    return value


def _beam_fields(body: dict[str, Any], n_prompts: int) -> tuple[int | None, int | None, float]:
    """``(beam_width, stop_token, length_penalty)``; the last two only with the first."""
    if body.get("beam_width") is None:
        extra = [k for k in ("stop_token", "length_penalty") if body.get(k) is not None]
        if extra:
            raise RequestError(
                f"'{extra[0]}' applies to beam search only; add 'beam_width' or drop it."
            )
        return None, None, 1.0
    width = _field(body, "beam_width", int, None)
    if width < 1:
        raise RequestError(f"'beam_width' must be >= 1; got {width}.")
    if n_prompts != 1:
        raise RequestError(f"'beam_width' needs exactly one prompt; got {n_prompts} prompts.")
    if body.get("logprobs"):
        raise RequestError("'logprobs' is not available with 'beam_width'; drop one of them.")
    stop = body.get("stop_token")
    if stop is not None and (not isinstance(stop, int) or isinstance(stop, bool) or stop < 0):
        raise RequestError(f"'stop_token' must be a token id >= 0; got {stop!r}.")
    penalty = _field(body, "length_penalty", float, 1.0)
    try:
        check_length_penalty(penalty, "'length_penalty'")
    except ValueError as err:
        raise RequestError(str(err)) from None
    return width, stop, penalty


def parse_request(body: Any, *, max_prompts: int = MAX_PROMPTS) -> ApiRequest:
    """Validate a ``PUT /api`` body (the model is not consulted: lengths are checked at admission).

    Raises:
        RequestError: naming the offending field.
    """
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object with a 'prompts' list.")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}.")
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise RequestError("'prompts' must be a non-empty list of strings.")
    if len(prompts) > max_prompts:
        raise RequestError(
            f"'prompts' holds {len(prompts)} prompts; at most {max_prompts} per request."
        )
    tokens = _field(body, "tokens_to_generate", int, 64)
    if tokens < 1:
        raise RequestError(f"'tokens_to_generate' must be >= 1; got {tokens}.")
    seed = body.get("random_seed")
    if seed is not None and (
        not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < _SEED_BOUND
    ):
        raise RequestError(
            f"'random_seed' must be a non-negative integer below 2**63; got {seed!r}."
        )
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
    width, stop_token, penalty = _beam_fields(body, len(prompts))
    return ApiRequest(
        prompts=prompts,
        tokens_to_generate=tokens,
        params=params,
        seed=seed,
        stop_at_eod=_field(body, "stop_at_eod", bool, True),
        logprobs=_field(body, "logprobs", bool, False),
        beam_width=width,
        stop_token=stop_token,
        length_penalty=penalty,
    )


def _decode_json(data: bytes) -> Any:
    """The JSON value of a request body (an empty body is ``null``).

    Raises:
        RequestError: the body is not UTF-8 (RFC 8259 requires it between systems), not JSON, nests deeper than
            :data:`MAX_JSON_DEPTH`, or holds a number Python refuses (an integer of over 4300 digits).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RequestError(
            f"the body is not UTF-8 (byte {data[err.start]:#04x} at offset {err.start}); send the JSON "
            "encoded as UTF-8."
        ) from None
    depth = _nesting(text)
    if depth > MAX_JSON_DEPTH:
        raise RequestError(
            f"the body nests JSON arrays/objects {depth} deep; a request needs 2 (at most {MAX_JSON_DEPTH})."
        )
    try:
        return json.loads(text or "null")
    except json.JSONDecodeError as err:
        raise RequestError(f"the body is not JSON ({err.msg} at char {err.pos}).") from None
    except ValueError as err:  # e.g. an integer literal beyond Python's int-string limit
        raise RequestError(f"the body is not usable JSON ({err}).") from None


def _nesting(text: str) -> int:
    """The deepest ``[``/``{`` nesting of JSON ``text`` outside strings (an upper bound for malformed text).

    Checked before parsing: ``json`` recurses once per level, so a body of 100,000 ``[`` would raise
    ``RecursionError`` in the request thread.
    """
    depth = deepest = 0
    for m in _STRUCTURE.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


class _Handler(BaseHTTPRequestHandler):
    scheduler: Scheduler
    max_prompts: int
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
        return _decode_json(bytes(data))

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        self._answering = True
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        if status == 503:
            self.send_header("Retry-After", "1")
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path != API_PATH:
            self._not_found()
            return
        try:
            request = parse_request(self._read_body(), max_prompts=self.max_prompts)
            job = self.scheduler.admit(request)
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
        except Unavailable as err:
            self._reply(503, {"error": str(err)})
            return
        try:
            job.done.wait()
            if job.error is not None:
                self._reply(job.error[0], {"error": job.error[1]})
            else:
                self._reply(200, job.answer())
        finally:
            self.scheduler.answered()

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == HEALTH_PATH:
            health = self.scheduler.health()
            health["world_size"] = world_size()
            self._reply(200 if health["status"] == "ok" else 503, health)
        elif self.path == API_PATH:
            self._not_allowed()
        else:
            self._not_found()

    def _not_found(self) -> None:
        self._reply(
            404, {"error": f"unknown path {self.path}; use PUT {API_PATH} or GET {HEALTH_PATH}."}
        )

    def _not_allowed(self) -> None:
        self._reply(405, {"error": f"use PUT {API_PATH} with a JSON body (or GET {HEALTH_PATH})."})

    do_POST = do_DELETE = _not_allowed  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        logger.info("%s %s", self.address_string(), format % args)

    def log_error(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        logger.warning("%s: %s", self.address_string(), format % args)


class _HTTPServer(ThreadingHTTPServer):
    request_queue_size = 1024
    """The listen backlog (socketserver's default is 5): a burst of clients connecting at once waits to be
    accepted instead of being reset by the kernel."""


class TextGenerationServer:
    """Rank 0's server: the HTTP front (a thread per connection) and the :class:`Scheduler`, whose loop runs in
    the thread that calls :meth:`serve_forever`."""

    def __init__(self, httpd: ThreadingHTTPServer, scheduler: Scheduler) -> None:
        self.httpd = httpd
        self.scheduler = scheduler
        self._done = threading.Event()

    @property
    def server_address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def serve_forever(self) -> None:
        """Serve until :meth:`stop`: answer what is in progress, 503 what is queued, broadcast ``stop``.

        Raises:
            Exception: a generator error when more than one rank serves (no ``stop`` is broadcast then).
        """
        self._done.clear()
        http = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="http", daemon=True
        )
        http.start()
        clean = False
        try:
            self.scheduler.run()
            clean = True
        finally:
            self.httpd.shutdown()  # no new connections are accepted...
            self.scheduler.close()  # ...and open requests are answered (503 the queued)
            if clean:
                self.scheduler.generator.broadcast_work(STOP)
            self._done.set()

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (signal-safe: it only sets a flag)."""
        self.scheduler.stop()

    def shutdown(self, timeout: float = 60.0) -> None:
        """:meth:`stop`, then wait until :meth:`serve_forever` (in another thread) has returned."""
        self.stop()
        self._done.wait(timeout)

    def server_close(self) -> None:
        self.httpd.server_close()


def check_server_args(
    port: int,
    read_timeout: float | None,
    *,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    batch_wait_ms: float = DEFAULT_BATCH_WAIT_MS,
    max_queue: int = DEFAULT_MAX_QUEUE,
    heartbeat_s: float = HEARTBEAT_S,
) -> None:
    """Refuse a bad port, read timeout or queue setting (the tool calls this on every rank before anything is
    loaded).

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
    if max_batch_size < 1:
        raise ValueError(
            f"--max-batch-size ({max_batch_size}) must be >= 1 (default {DEFAULT_MAX_BATCH_SIZE})."
        )
    if not 0 <= batch_wait_ms < math.inf:
        raise ValueError(
            f"--batch-wait-ms ({batch_wait_ms}) must be a finite number >= 0 (default {DEFAULT_BATCH_WAIT_MS:g})."
        )
    if max_queue < 1:
        raise ValueError(f"--max-queue ({max_queue}) must be >= 1 (default {DEFAULT_MAX_QUEUE}).")
    if not 0 < heartbeat_s < math.inf:
        raise ValueError(
            f"--heartbeat-seconds ({heartbeat_s}) must be a finite number > 0 (default {HEARTBEAT_S:g})."
        )


def make_server(
    generator: TextGenerator,
    host: str,
    port: int,
    *,
    read_timeout: float | None = DEFAULT_READ_TIMEOUT,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    batch_wait_ms: float = DEFAULT_BATCH_WAIT_MS,
    max_queue: int = DEFAULT_MAX_QUEUE,
    heartbeat_s: float = HEARTBEAT_S,
) -> TextGenerationServer:
    """A server (bound, not yet serving) answering ``PUT /api`` and ``GET /health``; port 0 picks a free one.

    ``read_timeout``: seconds to wait on a silent client (module docstring); None waits forever. A request may
    hold up to ``min(MAX_PROMPTS, max_queue)`` prompts.

    Raises:
        ValueError: see :func:`check_server_args`.
        OSError: the address cannot be bound (in use, unknown host).
    """
    check_server_args(
        port,
        read_timeout,
        max_batch_size=max_batch_size,
        batch_wait_ms=batch_wait_ms,
        max_queue=max_queue,
        heartbeat_s=heartbeat_s,
    )
    scheduler = Scheduler(
        generator,
        max_batch_size=max_batch_size,
        batch_wait_ms=batch_wait_ms,
        max_queue=max_queue,
        heartbeat_s=heartbeat_s,
    )
    handler = type(
        "TextGenerationHandler",
        (_Handler,),
        {
            "scheduler": scheduler,
            "max_prompts": min(MAX_PROMPTS, max_queue),
            "timeout": read_timeout,
        },
    )
    return TextGenerationServer(_HTTPServer((host, port), handler), scheduler)
