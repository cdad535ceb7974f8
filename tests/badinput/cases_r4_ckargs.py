"""Bad inputs of ``pretrain_gpt.py --use-checkpoint-args`` (issue 31): a model flag that disagrees with the --load
checkpoint's meta, and no checkpoint model to take (no --load, a directory without a checkpoint, a meta without a
model record). Each stops in the parse, before torch is imported for training, with one line. The rules themselves
(which flags are the run's, sequence and position lengths) are unit tests in
``tests/config/test_checkpoint_args.py``."""

from __future__ import annotations

import json
from pathlib import Path

from tests.badinput.cases import Case

TRAIN = (
    "pretrain_gpt.py", "--use-checkpoint-args", "--micro-batch-size", "1", "--global-batch-size", "2",
    "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--vocab-size", "299", "--tokenizer-type", "NullTokenizer",
    "--eval-iters", "0",
)  # fmt: skip
META = "{ws}/ckpt/global_step2/trident_meta.json"


def _empty(tmp: Path, ws: Path) -> None:
    (tmp / "ck").mkdir()


def _meta_without_model(tmp: Path, ws: Path) -> None:
    meta = json.loads((ws / "ckpt" / "global_step2" / "trident_meta.json").read_text())
    del meta["model"]
    (tmp / "ck" / "global_step2").mkdir(parents=True)
    (tmp / "ck" / "global_step2" / "trident_meta.json").write_text(json.dumps(meta))
    (tmp / "ck" / "latest").write_text("global_step2")


CASES: list[Case] = [
    Case(
        "ckargs-flag-disagrees-with-checkpoint",
        (*TRAIN, "--load", "{ws}/ckpt", "--save", "{ws}/ckpt", "--num-layers", "3", "--hidden-size", "32"), 2,
        f"--use-checkpoint-args: --num-layers 3 (checkpoint: 2) disagrees with the checkpoint's model in {META}; "
        "drop that flag", unchanged=("{ws}/ckpt",), needs=("ckpt",),
    ),
    Case(
        "ckargs-without-load", (*TRAIN, "--save", "{tmp}/ck"), 2,
        "--use-checkpoint-args takes the model flags from the --load checkpoint (--pretrained-checkpoint with "
        "LoRA), but neither was given",
    ),
    Case(
        "ckargs-load-holds-no-checkpoint", (*TRAIN, "--load", "{tmp}/ck"), 2,
        "--load {tmp}/ck holds no checkpoint (no 'latest'), so there is no model to take",
        unchanged=("{tmp}/ck",), setup=_empty,
    ),
    Case(
        "ckargs-meta-without-model", (*TRAIN, "--load", "{tmp}/ck"), 2,
        '{tmp}/ck/global_step2/trident_meta.json has no "model" record', unchanged=("{tmp}/ck",),
        needs=("ckpt",), setup=_meta_without_model,
    ),
]  # fmt: skip
