"""Interactive client of tools/run_text_generation_server.py (Megatron's ``text_generation_cli.py``).

    python tools/text_generation_cli.py localhost:5000 [--tokens-to-generate 64] [--top_p 0.9]
        [--random-seed 1234] [--logprobs] [--beam-width 4]

Reads a prompt per line from standard input and prints each completion (with ``--logprobs`` a second line
``logprobs: [...]``: the log-probs of the prompt's tokens 1..n-1 and of the generated ones; with ``--beam-width``
every beam, best first, each followed by ``score: ...``). The address is checked before the first prompt is read;
a busy server (503: queue full) is asked again up to 5 times, a second apart. Exit codes: 0 end of input, 2 a
malformed address, or the server cannot be reached or refuses the request (one ``error:`` line with its message).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


def request(
    url: str, body: dict[str, Any], timeout: float = 600.0, *, busy_retries: int = 0
) -> dict[str, Any]:
    """PUT ``body`` as JSON to ``url``; the decoded answer. A 503 (queue full) is retried ``busy_retries`` times,
    a second apart.

    Raises:
        ValueError: the server answered an error (its message) or something that is not JSON.
        OSError: the server cannot be reached.
    """
    data = json.dumps(body).encode("utf-8")
    req = urllib.request.Request(
        url, data=data, method="PUT", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            answer = json.loads(resp.read())
    except json.JSONDecodeError:
        raise ValueError(f"{url} answered something that is not JSON; is it our server?") from None
    except urllib.error.HTTPError as err:
        if err.code == 503 and busy_retries > 0:
            time.sleep(1.0)
            return request(url, body, timeout, busy_retries=busy_retries - 1)
        try:
            message = json.loads(err.read()).get("error", err.reason)
        except (json.JSONDecodeError, AttributeError):
            message = err.reason
        raise ValueError(f"the server refused the request (HTTP {err.code}): {message}") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("text"), list):
        raise ValueError(f"{url} answered JSON without a 'text' list; is it our server?")
    return answer


def api_url(address: str) -> str:
    """The ``PUT`` URL for ``address`` (``host:port``, or ``http(s)://host:port[/api]``).

    Raises:
        ValueError: the address is not a usable URL (one line naming it and the expected shape).
    """
    url = address.strip() if "://" in address else f"http://{address.strip()}"
    how = "give host:port (e.g. localhost:5000) or http://host:port"
    if not address.strip() or any(c.isspace() or not c.isprintable() for c in address.strip()):
        raise ValueError(f"the server address {address!r} is empty or holds spaces; {how}.")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # parses it: a non-number or one outside 0..65535 raises
    except ValueError as err:
        raise ValueError(
            f"the server address {address!r} is not a valid URL ({err}); {how}."
        ) from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"the server address {address!r} uses {parts.scheme}://; {how}.")
    if not parts.hostname:
        raise ValueError(f"the server address {address!r} names no host; {how}.")
    if port == 0:
        raise ValueError(f"the server address {address!r} has port 0; {how}.")
    path = parts.path.rstrip("/")
    return urllib.parse.urlunsplit(
        (parts.scheme, parts.netloc, path if path.endswith("/api") else f"{path}/api", "", "")
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("address", help="host:port of the server")
    p.add_argument("--tokens-to-generate", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_k", "--top-k", dest="top_k", type=int, default=0)
    p.add_argument("--top_p", "--top-p", dest="top_p", type=float, default=0.0)
    p.add_argument("--random-seed", type=int, default=None, help="same seed, same text")
    p.add_argument("--logprobs", action="store_true", help="also print the tokens' log-probs")
    p.add_argument("--beam-width", type=int, default=None, help="beam search with this many beams")
    a = p.parse_args(argv)
    try:
        url = api_url(a.address)  # before the first prompt is read
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in sys.stdin:
        prompt = line.rstrip("\n")
        body = {
            "prompts": [prompt],
            "tokens_to_generate": a.tokens_to_generate,
            "temperature": a.temperature,
            "top_k": a.top_k,
            "top_p": a.top_p,
        }
        if a.random_seed is not None:
            body["random_seed"] = a.random_seed
        if a.logprobs:
            body["logprobs"] = True
        if a.beam_width is not None:
            body["beam_width"] = a.beam_width
        try:
            answer = request(url, body, busy_retries=5)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            why = getattr(e, "reason", None) or e.strerror or e
            print(
                f"error: cannot reach the server at {url} ({why}); is "
                "tools/run_text_generation_server.py running there (host:port, e.g. localhost:5000)?",
                file=sys.stderr,
            )
            return 2
        _print_answer(answer)
    return 0


def _print_answer(answer: dict[str, Any]) -> None:
    """The completion (every beam with its score for beam search; the log-probs when asked)."""
    if "scores" in answer:
        for text, score in zip(answer["text"], answer["scores"], strict=False):
            print(text, flush=True)
            print(f"score: {score}", flush=True)
        return
    print(answer["text"][0], flush=True)
    if "logprobs" in answer:
        print(f"logprobs: {json.dumps(answer['logprobs'][0])}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
