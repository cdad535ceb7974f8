"""Bad inputs of context parallelism (``--context-parallel-size``): each refused in one line before any process
group exists (about 3-5 s each); the other refusals (MoE, world size, Ulysses and TP multiples) are unit-tested
in ``tests/training/test_context_parallel.py``, which keeps the suite short."""

from __future__ import annotations

from tests.badinput.cases import TINY_FLAGS, Case

TRAIN = ("pretrain_gpt.py", *TINY_FLAGS, "--train-iters", "2")
CASES: list[Case] = [
    Case(
        "cp-seq-length-not-divisible",
        (*TRAIN, "--context-parallel-size", "3", "--attention-dropout", "0"),
        2,
        "--seq-length (16) must be divisible by 2 x --context-parallel-size (3) = 6",
    ),
    Case(
        "cp-attention-dropout",
        (*TRAIN, "--context-parallel-size", "2", "--attention-dropout", "0.1"),
        2,
        "pass --attention-dropout 0",
    ),
]
