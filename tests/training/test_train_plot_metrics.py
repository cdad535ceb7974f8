"""tools/plot_metrics.py: a PNG from metrics files written by the real MetricsWriter; clear errors."""

from __future__ import annotations

import math

from megatron.training.metrics import EvalRecord, MetricsWriter, TrainRecord
from tools.plot_metrics import main


def _write(path, losses, valid_every=5) -> None:
    w = MetricsWriter(str(path), None, enabled=True)
    for i, loss in enumerate(losses, start=1):
        w.train(TrainRecord(i, 8 * i, loss, 1e-3, 1.0, 1.0, 0, 1000.0 + i, 0.01, None))
        if i % valid_every == 0:
            w.evaluation(EvalRecord(i, loss + 0.1, math.exp(loss + 0.1)))
    w.close()


def test_plot_two_runs(tmp_path, capsys) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write(a, [5.0 - 0.1 * i for i in range(20)])
    _write(b, [5.1 - 0.1 * i for i in range(20)])
    out = tmp_path / "plots" / "loss.png"
    assert main([str(a), str(b), "--labels", "tp1", "tp2", "--out", str(out), "--title", "t"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert "wrote" in capsys.readouterr().out


def test_plot_errors(tmp_path, capsys) -> None:
    assert main([str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x.png")]) == 2
    assert "no such file" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main([str(empty), "--out", str(tmp_path / "x.png")]) == 2
    assert "no training records" in capsys.readouterr().err
    a = tmp_path / "a.jsonl"
    _write(a, [1.0, 0.9])
    assert main([str(a), "--labels", "x", "y", "--out", str(tmp_path / "x.png")]) == 2
    assert "one label per file" in capsys.readouterr().err
