"""Bad inputs of ``tools/preprocess_data.py --sft`` (issue #33): a chat without a chat template, a template for a
tokenizer without a folder (a template that raises on a line: ``tests/data/test_sft_preprocess.py``). Nothing is
written; the input is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

from tests.badinput.cases import Case

SFT = (
    "tools/preprocess_data.py",
    "--sft",
    "--input",
    "{tmp}/in.jsonl",
    "--output-prefix",
    "{tmp}/out",
)
NULL = ("--tokenizer-type", "NullTokenizer", "--vocab-size", "1000")
CHAT = {"messages": [{"role": "user", "content": "1 2"}, {"role": "assistant", "content": "3"}]}


def _chat_input(tmp: Path, ws: Path) -> None:
    (tmp / "in.jsonl").write_text(
        json.dumps({"prompt": "1", "response": "2"}) + "\n" + json.dumps(CHAT) + "\n"
    )
    (tmp / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")


CASES: list[Case] = [
    Case(
        "sft-chat-without-template", (*SFT, *NULL), 1,
        "in.jsonl:2: a chat needs a chat template", unchanged=("{tmp}",), setup=_chat_input,
    ),
    Case(
        "sft-template-needs-hf-tokenizer", (*SFT, *NULL, "--chat-template", "{tmp}/t.jinja"), 2,
        "--chat-template needs --tokenizer-type HFTokenizer", unchanged=("{tmp}",), setup=_chat_input,
    ),
]  # fmt: skip
