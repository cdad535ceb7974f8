"""benchmarks/bench_generate.py smoke test: a tiny model end to end (table, JSON, greedy agreement), and bad flags."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import bench_generate

TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--vocab-size", "300", "--prompt-length", "8", "--new-tokens", "4", "--batch-sizes", "1,3",
    "--repeats", "1", "--threads", "1", "--device", "cpu",
]  # fmt: skip


@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_tiny_model_report(preset: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    extra = ["--num-key-value-heads", "2"] if preset == "llama" else []
    assert bench_generate.main([*TINY, "--preset", preset, *extra, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "prefill tok/s" in table and "greedy tokens agree: yes" in table
    report = json.loads(out.read_text())
    setup = report["setup"]
    assert setup["preset"] == preset and setup["dtype"] == "fp32" and setup["threads"] == 1
    assert setup["params"] > 0
    assert [r["batch"] for r in report["results"]] == [1, 3]
    for row in report["results"]:
        for name in ("ours", "hf"):
            r = row[name]
            for key in ("prefill_s", "decode_s", "prefill_tokens_per_s", "decode_tokens_per_s"):
                assert r[key] > 0, (name, key, r)
            assert r["forwards"] == 4  # prefill + N - 1 one-token steps
            assert len(r["times_s"]) == 1
        assert row["ratio"]["prefill"] > 0 and row["ratio"]["decode"] > 0
        # fp32, same weights: greedy decoding must agree token for token.
        assert row["tokens_agree"] and row["rows_agree"] == row["batch"]
        assert row["first_divergence"] is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch-sizes", "1,0"], "--batch-sizes"),
        (["--batch-sizes", "one"], "--batch-sizes"),
        (["--new-tokens", "1"], r"--new-tokens \(1\) must be >= 2"),
        (["--prompt-length", "60", "--new-tokens", "8"], "must fit in --seq-length"),
        (["--num-attention-heads", "5"], "divisible by --num-attention-heads"),
        (["--num-key-value-heads", "2"], "needs --preset llama"),
        (["--json", "/no/such/dir/out.json"], "--json"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_flags_one_error_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_generate.main([*TINY, *flags]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert re.search(message, lines[0]), lines[0]
    assert captured.out == ""
