"""Concatenate Megatron mmap datasets (same dtype) into one: ``--input DIR`` (every prefix in it, sorted) or
``--inputs P1 P2 ...`` (in that order), written to ``--output-prefix`` (``.bin`` / ``.idx``).
"""

from __future__ import annotations

import argparse
import sys

from megatron.data.preprocess import PreprocessError, find_prefixes, merge_datasets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="directory holding the .bin/.idx pairs to merge")
    src.add_argument("--inputs", nargs="+", help="dataset prefixes to merge, in order")
    p.add_argument("--output-prefix", required=True, help="merged dataset prefix")
    args = p.parse_args(argv)
    try:
        inputs = find_prefixes(args.input) if args.input else args.inputs
        ds = merge_datasets(inputs, args.output_prefix)
    except (PreprocessError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"merged {len(inputs)} datasets into {args.output_prefix}: {len(ds):,} sequences, "
        f"{len(ds.doc_idx) - 1:,} documents, {int(ds.sizes.sum(dtype='int64')):,} tokens",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
