"""Plot loss (train, valid) and throughput from one or more ``--metrics-file`` JSONL files into a PNG.

python -m tools.plot_metrics runs/a/metrics.jsonl runs/b/metrics.jsonl --labels tp1 tp2 --out loss.png

Every training record must have ``iteration``, ``lm_loss`` and ``tokens_per_sec`` (every evaluation record
``iteration`` and ``valid_loss``), as ``--metrics-file`` writes them; a record without one is an error naming
``file:line`` and the key (no panel is silently left out). Prints the path written. Exit codes: 0 ok, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys

from megatron.training.plot import plot_metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "metrics", nargs="+", help="metrics JSONL files (pretrain_gpt.py --metrics-file)"
    )
    p.add_argument(
        "--out",
        default="metrics.png",
        help="image to write (default: metrics.png); the suffix picks the format (.png, .pdf, .svg, ...), "
        "and a name without one gets .png",
    )
    p.add_argument("--labels", nargs="+", default=None, help="one legend name per file")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    try:
        out = plot_metrics(a.metrics, a.out, labels=a.labels, title=a.title)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
