"""Plot metrics JSONL files (``--metrics-file``): loss (train and valid) and throughput, one PNG.

Used by ``tools/plot_metrics.py``. matplotlib runs with the Agg backend (no display needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from megatron.training.metrics import read_metrics


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
        The PNG path.

    Raises:
        FileNotFoundError: a metrics file is missing.
        ValueError: a file is not JSONL, has no training record, or labels do not match the files.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not paths:
        raise ValueError("give at least one metrics file.")
    if labels is not None and len(labels) != len(paths):
        raise ValueError(
            f"{len(labels)} labels for {len(paths)} metrics files; give one label per file."
        )
    names = list(labels) if labels is not None else [Path(p).stem for p in paths]
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(12, 4.5))
    for path, name in zip(paths, names):
        train, evals = read_metrics(path)
        if not train:
            raise ValueError(f"{path}: no training records (was --metrics-file written by a run?).")
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
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
