"""A raw HTTP client for catalogue cases that send the server a body no JSON client would (not UTF-8, nested
100,000 deep): ``python -m tests.badinput.put_raw URL (--hex HEX | --text TEXT) [--repeat N]``.

PUTs the bytes to ``URL/api`` once and prints ``HTTP <status>: <answer>``. Exit codes, so that a case can promise
one: 2 the server refused the request (4xx), 0 it answered 2xx, 1 anything else (5xx, no answer at all, a
connection closed without a reply).
"""

from __future__ import annotations

import argparse
import http.client
import sys
import urllib.parse


def _body(a: argparse.Namespace) -> bytes:
    data = bytes.fromhex(a.hex) if a.hex is not None else a.text.encode("utf-8")
    return data * a.repeat


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="the server's base URL, http://host:port")
    body = p.add_mutually_exclusive_group(required=True)
    body.add_argument("--hex", help="the body as hex digits")
    body.add_argument("--text", help="the body as text (sent UTF-8)")
    p.add_argument("--repeat", type=int, default=1, help="send the body this many times over")
    a = p.parse_args(argv)
    parts = urllib.parse.urlsplit(a.url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=60)
    try:
        conn.request("PUT", "/api", body=_body(a), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        status, answer = resp.status, resp.read().decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as err:
        print(f"no answer: {type(err).__name__}: {err}")
        return 1
    finally:
        conn.close()
    print(f"HTTP {status}: {answer}")
    return 2 if 400 <= status < 500 else 0 if status < 300 else 1


if __name__ == "__main__":
    sys.exit(main())
