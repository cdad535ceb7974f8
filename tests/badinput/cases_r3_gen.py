"""Bad input to text generation, reliability round 3 (issue 35, items 6, 18 and 19).

- an empty ``--sample-input-file`` (once: one unconditional sample written for a prompt the input does not hold);
- ``--length-penalty nan`` (once: nan scores accepted; -inf and 1e308, once ZeroDivisionError and OverflowError,
  are checked in-process by ``tests/text_generation/test_generate_text_cli.py``, each subprocess here costs
  seconds of ``import torch``) and the server's ``length_penalty: 1e308`` (once: HTTP 500);
- a request body that is not UTF-8 or nests 100,000 deep (once: the request thread died with a traceback and the
  connection closed with no answer). These bodies go through ``tests/badinput/put_raw.py``, which exits 2 when the
  server answers 4xx and 1 when it answers nothing.

The width-above-the-vocabulary beam search of item 3 is not bad input (any width is now searched correctly): its
tests are ``tests/text_generation/test_beam_search_widths.py`` and ``test_server.py``.
"""

from __future__ import annotations

from pathlib import Path

from tests.badinput.cases import Case

GEN = ("tools/generate_text.py", "--device", "cpu", "--load", "{ws}/ckpt")
OUT = "{tmp}/samples.jsonl"
PUT = ("-m", "tests.badinput.put_raw", "{url}")
PENALTY_RULE = "must be a finite number in [-10, 10]"
BEAM_1E308 = (
    '{{"prompts": ["1"], "tokens_to_generate": 2, "beam_width": 2, "length_penalty": 1e308}}'
)
"""Fits the context (16), so the old server reached the search: 2 ** 1e308 overflowed, HTTP 500."""


def _beam(penalty: str) -> tuple[str, ...]:
    return (*GEN, "--prompt", "1 2", "--beam-width", "2", "--length-penalty", penalty)


def _empty_prompts(tmp: Path, ws: Path) -> None:
    """An empty prompt file, and samples of an earlier run that a refused command must leave alone."""
    (tmp / "prompts.txt").write_bytes(b"")
    (tmp / "samples.jsonl").write_text('{"prompt": "1", "text": " 2", "tokens": [2]}\n')


CASES: list[Case] = [
    Case(
        "gen-sample-input-file-empty",
        (*GEN, "--sample-input-file", "{tmp}/prompts.txt", "--sample-output-file", OUT),
        2,
        "prompts.txt is empty: it holds no prompts",
        unchanged=(OUT, "{tmp}/prompts.txt"),
        needs=("ckpt",),
        setup=_empty_prompts,
    ),
    Case(
        "gen-length-penalty-nan",
        (*_beam("nan"), "--sample-output-file", OUT),
        2,
        f"--length-penalty (nan) {PENALTY_RULE}",
        unchanged=(OUT,),
        needs=("ckpt",),
    ),
    Case(
        "server-length-penalty-1e308",
        (*PUT, "--text", BEAM_1E308),
        2,
        """HTTP 400: {{"error": "'length_penalty' (1e+308) """ + PENALTY_RULE,
        needs=("server",),
    ),
    Case(
        "server-body-not-utf8",
        (*PUT, "--hex", "7b2270726f6d707473223a205b22ff225d7d"),  # {"prompts": ["\xff"]}
        2,
        'HTTP 400: {{"error": "the body is not UTF-8 (byte 0xff at offset 14)',
        needs=("server",),
    ),
    Case(
        "server-body-nested-too-deep",
        (*PUT, "--text", "[", "--repeat", "100000"),
        2,
        'HTTP 400: {{"error": "the body nests JSON arrays/objects 100000 deep',
        needs=("server",),
    ),
]
