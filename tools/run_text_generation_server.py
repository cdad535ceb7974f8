"""Serve text generation from a Trident checkpoint over HTTP (Megatron's ``run_text_generation_server.py`` API).

    python tools/run_text_generation_server.py --load ckpt/ [--host 127.0.0.1] [--port 5000]
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \\
         -d '{"prompts": ["In the beginning"], "tokens_to_generate": 32, "top_p": 0.9}'

Request and response: ``megatron/text_generation/server.py``. The default host is 127.0.0.1 (this machine only;
pass ``--host 0.0.0.0`` to listen on every interface: the server has no authentication). ``--read-timeout``
(default 60 s) bounds every wait on a silent client: a body shorter than its Content-Length is answered 408 after
it, not waited for forever. Exit codes: 0 stopped with Ctrl-C, 2 bad input (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import socket
import sys

from tools._textgen_common import add_load_args, build_generator


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_args(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    p.add_argument(
        "--port",
        type=int,
        default=5000,
        help="TCP port 0..65535 (Megatron's default 5000; 0: any free)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=None,
        help="seconds to wait on a silent client: its request line and headers, and its whole body (then "
        "408); default 60 (server.DEFAULT_READ_TIMEOUT)",
    )
    a = p.parse_args(argv)
    from megatron.log import setup_logging
    from megatron.text_generation.server import (
        API_PATH,
        DEFAULT_READ_TIMEOUT,
        check_server_args,
        make_server,
    )

    setup_logging()
    timeout = DEFAULT_READ_TIMEOUT if a.read_timeout is None else a.read_timeout
    try:
        check_server_args(a.port, timeout)  # before the (slow) checkpoint load
        server = make_server(build_generator(a), a.host, a.port, read_timeout=timeout)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        fix = "use another --host" if isinstance(e, socket.gaierror) else "use another --port"
        print(
            f"error: cannot listen on {a.host}:{a.port} ({e.strerror or e}); {fix}.",
            file=sys.stderr,
        )
        return 2
    host, port = server.server_address[:2]
    print(f"serving PUT http://{host}:{port}{API_PATH} (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
