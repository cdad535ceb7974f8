"""Interactive client of tools/run_text_generation_server.py (Megatron's ``text_generation_cli.py``).

    python tools/text_generation_cli.py localhost:5000 [--tokens-to-generate 64] [--top_p 0.9]

Reads a prompt per line from standard input and prints each completion. Exit codes: 0 end of input, 2 the server
cannot be reached or refuses the request (its message is printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any


def request(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    """PUT ``body`` as JSON to ``url``; the decoded answer.

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
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read()).get("error", err.reason)
        except (json.JSONDecodeError, AttributeError):
            message = err.reason
        raise ValueError(f"the server refused the request (HTTP {err.code}): {message}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("address", help="host:port of the server")
    p.add_argument("--tokens-to-generate", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_k", "--top-k", dest="top_k", type=int, default=0)
    p.add_argument("--top_p", "--top-p", dest="top_p", type=float, default=0.0)
    a = p.parse_args(argv)
    url = f"http://{a.address}/api" if "://" not in a.address else f"{a.address.rstrip('/')}/api"
    for line in sys.stdin:
        prompt = line.rstrip("\n")
        body = {
            "prompts": [prompt],
            "tokens_to_generate": a.tokens_to_generate,
            "temperature": a.temperature,
            "top_k": a.top_k,
            "top_p": a.top_p,
        }
        try:
            answer = request(url, body)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(answer["text"][0], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
