"""tools/plot_metrics.py: a PNG from metrics files written by the real MetricsWriter; clear errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

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


def test_record_without_a_plotted_key_names_file_line_and_key(tmp_path, capsys) -> None:
    a = tmp_path / "a.jsonl"
    _write(a, [3.0, 2.5, 2.0, 1.8, 1.7])
    lines = a.read_text().splitlines()
    rec = json.loads(lines[2])  # iteration 3, a training record
    del rec["tokens_per_sec"]
    lines[2] = json.dumps(rec)
    a.write_text("\n".join(lines) + "\n")
    out = tmp_path / "x.png"
    assert main([str(a), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: {a}:3: the training record has no key 'tokens_per_sec'" in err, err
    assert "Traceback" not in err and err.count("error:") == 1 and not out.exists()
    rec["tokens_per_sec"] = None  # present but not a number
    lines[2] = json.dumps(rec)
    ev = json.loads(lines[5])  # the evaluation at iteration 5
    del ev["iteration"]
    a.write_text("\n".join(lines) + "\n")
    assert main([str(a), "--out", str(out)]) == 2
    assert f"{a}:3: the training record has None under 'tokens_per_sec'" in capsys.readouterr().err
    lines[2] = json.dumps({**rec, "tokens_per_sec": 1.0})
    lines[5] = json.dumps(ev)
    a.write_text("\n".join(lines) + "\n")
    assert main([str(a), "--out", str(out)]) == 2
    assert f"{a}:6: the evaluation record has no key 'iteration'" in capsys.readouterr().err


def test_out_path_printed_is_the_file_written(tmp_path, capsys) -> None:
    a = tmp_path / "a.jsonl"
    _write(a, [1.0, 0.9])
    stem = tmp_path / "lossplot"
    assert main([str(a), "--out", str(stem)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {stem}.png"
    assert Path(f"{stem}.png").read_bytes()[:4] == b"\x89PNG" and not stem.exists()
    pdf = tmp_path / "loss.pdf"
    assert main([str(a), "--out", str(pdf)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {pdf}" and pdf.read_bytes()[:4] == b"%PDF"
    assert main([str(a), "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a directory" in capsys.readouterr().err
