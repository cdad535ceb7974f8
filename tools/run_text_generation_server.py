"""Serve text generation from a Trident checkpoint over HTTP (Megatron's ``run_text_generation_server.py`` API).

    python tools/run_text_generation_server.py --load ckpt/ [--host 127.0.0.1] [--port 5000]
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \\
         -d '{"prompts": ["In the beginning"], "tokens_to_generate": 32, "top_p": 0.9}'

Request and response: ``megatron/text_generation/server.py``. The default host is 127.0.0.1 (this machine only;
pass ``--host 0.0.0.0`` to listen on every interface: the server has no authentication). Exit codes: 0 stopped
with Ctrl-C, 2 bad input (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import sys

from tools._textgen_common import add_load_args, build_generator


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_args(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    p.add_argument("--port", type=int, default=5000, help="TCP port (Megatron's default 5000)")
    a = p.parse_args(argv)
    from megatron.log import setup_logging
    from megatron.text_generation.server import API_PATH, make_server

    setup_logging()
    try:
        server = make_server(build_generator(a), a.host, a.port)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(
            f"error: cannot listen on {a.host}:{a.port} ({e.strerror or e}); use another --port.",
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
