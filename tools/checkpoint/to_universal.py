"""Trident checkpoint -> DeepSpeed universal checkpoint, to resume at another TP / PP / DP with optimizer state.

    python -m tools.checkpoint.to_universal --load ckpt/ [--tag global_step1000]
    # then train with the new layout and: --load ckpt/ --universal-checkpoint (first resume only)

Writes ``ckpt/{tag}_universal`` and ``ckpt/latest_universal``. Exit codes: 0 done; 2 bad input (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import sys
import time

from megatron.conversion.universal import convert_to_universal
from tools.checkpoint._common import EXIT_INPUT_ERROR, EXIT_OK, add_checksum_args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="Trident checkpoint directory (a --save dir)")
    p.add_argument("--tag", default=None, help="tag to convert (default: 'latest')")
    p.add_argument("--workers", type=int, default=1, help="ds_to_universal extract/merge workers")
    add_checksum_args(p)
    a = p.parse_args(argv)
    start = time.perf_counter()
    try:
        tag = convert_to_universal(
            a.load, a.tag, workers=a.workers, verify_checksums=a.verify_checkpoint_checksums
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    print(
        f"wrote {a.load}/{tag} in {time.perf_counter() - start:.1f} s; resume with --universal-checkpoint"
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
