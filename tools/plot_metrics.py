"""Plot loss (train, valid) and throughput from one or more ``--metrics-file`` JSONL files into a PNG.

python -m tools.plot_metrics runs/a/metrics.jsonl runs/b/metrics.jsonl --labels tp1 tp2 --out loss.png

Every training record must have ``iteration``, ``lm_loss`` and ``tokens_per_sec`` (every evaluation record
``iteration`` and ``valid_loss``), as ``--metrics-file`` writes them; a record without one is an error naming
``file:line`` and the key (no panel is silently left out). Prints the path written. Exit codes: 0 ok, 2 bad input.
matplotlib runs with the Agg backend (no display needed).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron.training.metrics import read_metrics

TRAIN_PLOTTED = ("iteration", "lm_loss", "tokens_per_sec")
EVAL_PLOTTED = ("iteration", "valid_loss")


def _line_of(path: str | Path, record: dict[str, Any]) -> int | None:
    """The 1-based line of ``path`` holding ``record`` (for error messages; read again only on error)."""
    want = json.dumps(record, sort_keys=True)  # compared as text: NaN != NaN as floats
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        try:
            if line.strip() and json.dumps(json.loads(line), sort_keys=True) == want:
                return lineno
        except json.JSONDecodeError:
            continue
    return None


def _check_records(
    path: str | Path, records: list[dict[str, Any]], keys: Sequence[str], kind: str
) -> None:
    """Every record has a number under each of ``keys``.

    Raises:
        ValueError: names ``file:line``, the key and what the record holds instead.
    """
    for rec in records:
        for key in keys:
            value = rec.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                continue
            where = f"{path}:{_line_of(path, rec) or '?'}"
            what = "has no key" if key not in rec else f"has {value!r} under"
            need = ", ".join(repr(k) for k in keys)
            raise ValueError(
                f"{where}: the {kind} record {what} {key!r}; the plot needs a number under {need} in every "
                f"{kind} record, as --metrics-file writes them. Fix or remove that line."
            )


def plot_metrics(
    paths: Sequence[str | Path],
    out: str | Path,
    *,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Write a PNG with two panels: lm loss vs iteration (train lines, valid markers) and tokens/s.

    Args:
        paths: one or more metrics JSONL files (one curve each).
        out: PNG path (parent directories are created).
        labels: legend names (default: each file's stem).
        title: figure title.

    Returns:
        The path written: ``out``, with ``.png`` added when ``out`` has no suffix (matplotlib's default format).

    Raises:
        FileNotFoundError: a metrics file is missing.
        ValueError: a file is not JSONL, has no training record, a record lacks a plotted key (``file:line``), or
            labels do not match the files.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not paths:
        raise ValueError("give at least one metrics file.")
    if Path(out).is_dir():
        raise ValueError(
            f"--out {out} is a directory; give a file name, e.g. {Path(out) / 'metrics.png'}."
        )
    if labels is not None and len(labels) != len(paths):
        raise ValueError(
            f"{len(labels)} labels for {len(paths)} metrics files; give one label per file."
        )
    names = list(labels) if labels is not None else [Path(p).stem for p in paths]
    runs = []  # read and check every file before drawing anything
    for path in paths:
        train, evals = read_metrics(path)
        if not train:
            raise ValueError(f"{path}: no training records (was --metrics-file written by a run?).")
        _check_records(path, train, TRAIN_PLOTTED, "training")
        _check_records(path, evals, EVAL_PLOTTED, "evaluation")
        runs.append((train, evals))
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (train, evals), name in zip(runs, names):
        its = [r["iteration"] for r in train]
        line = ax_loss.plot(its, [r["lm_loss"] for r in train], label=f"{name} train")[0]
        if evals:
            ax_loss.plot(
                [r["iteration"] for r in evals],
                [r["valid_loss"] for r in evals],
                "o--",
                color=line.get_color(),
                label=f"{name} valid",
            )
        ax_tps.plot(its, [r["tokens_per_sec"] for r in train], label=name)
    ax_loss.set_xlabel("iteration")
    ax_loss.set_ylabel("lm loss")
    ax_loss.set_title("loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_tps.set_xlabel("iteration")
    ax_tps.set_ylabel("tokens / s")
    ax_tps.set_title("throughput")
    ax_tps.legend()
    ax_tps.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    if not out.suffix:  # matplotlib would write out + ".png"; return (and print) the real path
        out = out.with_name(out.name + ".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
    return out


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
