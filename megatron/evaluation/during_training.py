"""--eval-harness-tasks during training: the harness factory ``pretrain_gpt.py`` passes to ``pretrain``.

``pretrain`` calls :func:`training_harness` once, after the engine is built, with its ``TrainingModel``
(``megatron/training/eval_harness.py``; taken by duck typing here, as evaluation does not import training): the
tasks are looked up then (an unknown name or a missing data file stops the run before its first step, exit 2), and
an :class:`~megatron.evaluation.harness.TridentLM` is built over an inference engine that shares the training
model's parameters at the training layout (``megatron/text_generation/training_model.py``). Every
--eval-harness-interval iterations the loop calls the returned function on every rank together, inside its
evaluation window (model in eval mode, random states restored), and records the scores.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from megatron.evaluation.harness import TridentLM, evaluate_tasks
from megatron.evaluation.tasks import task_manager, task_specs
from megatron.text_generation.training_model import training_inference_engine

TrainingHarness = Callable[[int], dict[str, dict[str, float]]]
"""iteration -> ``{task: {metric: value}}``."""


def _training_flags(message: str) -> str:
    """``message`` with the evaluation tool's flags spelled as the training run's (``--tasks`` ->
    ``--eval-harness-tasks``, ``--include-path``, ``--limit``, ``--num-fewshot`` likewise)."""
    return re.sub(
        r"(?<![\w-])--(tasks|include-path|limit|num-fewshot)\b", r"--eval-harness-\1", message
    )


def training_harness(model: Any) -> TrainingHarness:
    """The --eval-harness-tasks evaluation of the training model ``model`` (a ``TrainingModel``: ``module``,
    ``device``, ``state``, ``tokenizer``, ``training``).

    Raises:
        ValueError / FileNotFoundError: an unknown task, a missing --eval-harness-include-path or data file.
    """
    t = model.training
    tasks = list(t.eval_harness_tasks or ())
    # an unknown task or a missing data file fails now, at start-up; the messages name tools/eval_harness.py's
    # flags, so they are re-spelled as the training run's
    try:
        task_specs(tasks, task_manager(tasks, t.eval_harness_include_path))
    except ValueError as err:
        raise ValueError(_training_flags(str(err))) from None
    except FileNotFoundError as err:
        raise FileNotFoundError(_training_flags(str(err))) from None
    engine = training_inference_engine(
        model.module,
        pp_group=model.state.get_pipeline_model_parallel_group(),
        device=model.device,
    )
    lm = TridentLM(engine, model.tokenizer, seed=t.seed)

    def harness(iteration: int) -> dict[str, dict[str, float]]:
        return evaluate_tasks(
            lm,
            tasks,
            include_path=t.eval_harness_include_path,
            limit=t.eval_harness_limit,
            num_fewshot=t.eval_harness_num_fewshot,
        )

    return harness
