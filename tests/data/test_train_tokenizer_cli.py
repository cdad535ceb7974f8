"""tools/train_tokenizer.py: no text is an error, an existing tokenizer is never replaced silently, and a failed run
leaves nothing behind (no files, no directory it created, the old tokenizer intact)."""

from __future__ import annotations

import json
import pydoc_data.topics
from pathlib import Path

import pytest

from tools import train_tokenizer

TEXTS = list(pydoc_data.topics.topics.values())[:20]


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = train_tokenizer.main(list(argv))
    return rc, capsys.readouterr().err


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_input_without_text_is_an_error(tmp_path: Path, capsys, kind: str) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    blank = _jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": " \n "}])
    for src in (empty, blank):
        out = tmp_path / "new" / "tok"
        rc, err = _run(capsys, "--input", str(src), "--type", kind, "--vocab-size", "300",
                       "--output-dir", str(out))  # fmt: skip
        assert rc == 1 and err.count("error:") == 1 and "Traceback" not in err, err
        assert f"error: --input {src} (--json-keys text) has no text to train on" in err
        assert not (tmp_path / "new").exists()  # the directories it created are removed


def test_output_dir_that_is_a_file(tmp_path: Path, capsys) -> None:
    src = _jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS])
    a_file = tmp_path / "plain_file"
    a_file.write_text("keep")
    rc, err = _run(capsys, "--input", str(src), "--type", "bpe", "--vocab-size", "300",
                   "--output-dir", str(a_file))  # fmt: skip
    assert rc == 1 and "Traceback" not in err
    assert f"error: --output-dir {a_file} is a file, not a directory" in err
    assert a_file.read_text() == "keep"


def test_existing_tokenizer_needs_overwrite(tmp_path: Path, capsys) -> None:
    src = _jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS])
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "notes.txt").write_text("a non-empty directory without a tokenizer is fine")
    flags = ["--input", str(src), "--type", "bpe", "--output-dir", str(tok)]
    assert _run(capsys, *flags, "--vocab-size", "300")[0] == 0
    before = _tree(tok)
    assert sorted(before) == [
        "merges.txt", "notes.txt", "tokenizer.json", "tokenizer_config.json", "vocab.json",
    ]  # fmt: skip
    for kind in ("bpe", "sentencepiece"):  # any tokenizer file there is protected
        rc, err = _run(capsys, *flags[:3], kind, *flags[4:], "--vocab-size", "320")
        assert rc == 1 and err.count("error:") == 1, err
        assert f"--output-dir {tok} already holds a tokenizer (vocab.json, merges.txt" in err
        assert "pass --overwrite to replace them" in err
        assert _tree(tok) == before
    # A failed --overwrite run (a bad line half-way through the input) keeps the old tokenizer.
    bad = _jsonl(tmp_path / "bad.jsonl", [{"text": t} for t in TEXTS] + [{"txt": "x"}])
    rc, err = _run(capsys, "--input", str(bad), *flags[2:], "--vocab-size", "320", "--overwrite")
    assert rc == 1 and f"{bad}:{len(TEXTS) + 1}: missing key 'text'" in err, err
    assert _tree(tok) == before  # no staging directory left either
    assert _run(capsys, *flags, "--vocab-size", "320", "--overwrite")[0] == 0
    after = _tree(tok)
    assert sorted(after) == sorted(before) and after["vocab.json"] != before["vocab.json"]


def test_failed_run_removes_the_directory_it_created(tmp_path: Path, capsys) -> None:
    bad = _jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"txt": "no"}])
    for kind in ("bpe", "sentencepiece"):
        out = tmp_path / "a" / "b"
        rc, err = _run(capsys, "--input", str(bad), "--type", kind, "--vocab-size", "300",
                       "--output-dir", str(out))  # fmt: skip
        assert rc == 1 and f"{bad}:2: missing key 'text'" in err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]
    existing = tmp_path / "mine"
    existing.mkdir()  # an empty directory the user made stays
    rc, _ = _run(capsys, "--input", str(bad), "--type", "bpe", "--vocab-size", "300",
                 "--output-dir", str(existing))  # fmt: skip
    assert rc == 1 and existing.is_dir() and list(existing.iterdir()) == []
