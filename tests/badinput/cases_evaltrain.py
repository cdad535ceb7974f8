"""Bad inputs of ``pretrain_gpt.py --eval-harness-*`` (lm-evaluation-harness during training): an unknown task name
(one rank starts: the tasks are looked up once the engine exists, before the first step; the message names the
training flags). The flag rules of ``megatron/config/eval_harness.py`` and the include-path check of preflight are
tested in ``tests/training/test_eval_during_training.py``."""

from __future__ import annotations

from tests.badinput.cases import TINY_FLAGS, Case

TRAIN = ("pretrain_gpt.py", *TINY_FLAGS, "--train-iters", "2")

CASES: list[Case] = [
    Case(
        "eval-harness-unknown-task",
        (
            *TRAIN,
            "--eval-harness-tasks",
            "no_such_task",
            "--eval-harness-include-path",
            "{repo}/examples/eval_tasks",
        ),
        2,
        "--eval-harness-tasks: unknown task(s) no_such_task; --eval-harness-include-path",
    ),
]
