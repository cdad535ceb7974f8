"""Evaluation of a model with lm-evaluation-harness at the generation layout (any TP x PP): the ``lm_eval``
model over the generation engine and the task runner. Training does not import it (an entry point passes it in)."""

from megatron.evaluation.harness import TridentLM, evaluate_tasks
from megatron.evaluation.tasks import task_manager, task_specs

__all__ = ["TridentLM", "evaluate_tasks", "task_manager", "task_specs"]
