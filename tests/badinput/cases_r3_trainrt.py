"""Bad inputs of a training run found in reliability round 3 (issue #35): data whose every loss token is masked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.badinput.cases import TINY_FLAGS, Case

REPO = Path(__file__).resolve().parents[2]


def _lone_eod_documents(tmp: Path, ws: Path) -> None:
    """A dataset made by tools/preprocess_data.py whose every document is one EOD token (NullTokenizer with
    --vocab-size 299: EOD is id 299), so --eod-mask-loss masks every token."""
    src = tmp / "eod.jsonl"
    src.write_text("".join(json.dumps({"text": "299"}) + "\n" for _ in range(200)))
    subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", str(src),
         "--output-prefix", str(tmp / "eod"), "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "299", "--workers", "1"],  # fmt: skip
        cwd=REPO, check=True, capture_output=True, timeout=60,
    )  # fmt: skip


CASES: list[Case] = [
    Case(
        id="train-every-loss-token-masked",
        argv=(
            "pretrain_gpt.py",
            *[f for f in TINY_FLAGS if f != "--mock-data"],
            "--data-path",
            "{tmp}/eod_text_document",
            "--split",
            "100,0,0",
            "--eod-mask-loss",
            "--train-iters",
            "2",
            "--save",
            "{tmp}/save",
        ),  # fmt: skip
        exit_code=2,
        message="error: no loss token in the 1 iteration(s) trained (iteration 1): the loss mask of every",
        unchanged=("{tmp}/save/latest", "{tmp}/save/global_step1", "{tmp}/save/global_step2"),
        setup=_lone_eod_documents,
    ),
]
