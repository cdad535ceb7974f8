"""The results of :func:`~megatron.evaluation.harness.evaluate_tasks` as a printed table and a JSON file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

Results = dict[str, dict[str, float]]
"""``task -> metric -> value``."""


def results_table(results: Results) -> str:
    """One line per (task, metric), aligned: ``task  metric  value``."""
    rows = [
        (task, name, f"{value:.6g}") for task, m in results.items() for name, value in m.items()
    ]
    head = ("task", "metric", "value")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [head, *rows]
    ]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def check_output_path(path: str | None) -> None:
    """Refuse an ``--output-path`` that cannot be written, before any model is loaded.

    Raises:
        ValueError / FileNotFoundError: the path is a directory, or its directory does not exist.
    """
    if path is None:
        return
    out = Path(path)
    if out.is_dir():
        raise ValueError(
            f"--output-path {out} is a directory; give a file path, e.g. {out / 'results.json'}."
        )
    if not out.parent.is_dir():
        raise FileNotFoundError(
            f"--output-path {out}: the directory {out.parent} does not exist; create it first."
        )


def write_results(path: str, results: Results, config: dict[str, Any]) -> None:
    """``{"results": ..., "config": ...}`` as JSON into ``path``, atomically (a temporary file, then rename)."""
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.write_text(
        json.dumps({"results": results, "config": config}, indent=2) + "\n", encoding="utf-8"
    )
    os.replace(tmp, out)
