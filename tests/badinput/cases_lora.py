"""Bad input of LoRA runs (``--lora-rank``, ``--pretrained-checkpoint``): each one line, exit 2, nothing written."""

from __future__ import annotations

from tests.badinput.cases import TINY_FLAGS, Case

TRAIN = ("pretrain_gpt.py", *TINY_FLAGS, "--train-iters", "4", "--lora-rank", "4")

# fmt: off
CASES: list[Case] = [
    Case(
        "lora-base-missing", (*TRAIN, "--pretrained-checkpoint", "{tmp}/nope", "--save", "{tmp}/out"), 2,
        "--pretrained-checkpoint {tmp}/nope holds no Trident checkpoint",
    ),
    Case(
        "lora-load-is-full-checkpoint",
        (*TRAIN, "--pretrained-checkpoint", "{ws}/ckpt", "--load", "{ws}/ckpt"), 2,
        "is a full checkpoint, not a LoRA adapter checkpoint", unchanged=("{ws}/ckpt",), needs=("ckpt",),
    ),
]
# fmt: on
