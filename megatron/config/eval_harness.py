"""The rules of --eval-harness-*: lm-evaluation-harness tasks scored on the training model during training.

The evaluation runs generation's ``InferenceEngine`` on the training model's own parameters at the training layout
(``megatron/text_generation/training_model.py``), so the layouts generation cannot run are refused here, at
start-up, instead of at the first evaluation: sequence parallelism (generation feeds one token at a time, which
cannot be split over the TP ranks), context parallelism and DeepSpeed-Ulysses (the sequence is split over ranks),
ZeRO-3 (the parameters are partitioned over the data-parallel ranks).
"""

from __future__ import annotations

import importlib.util

from megatron.config.arguments import TridentConfig

_FOLLOWERS = (
    ("--eval-harness-interval", "eval_harness_interval"),
    ("--eval-harness-include-path", "eval_harness_include_path"),
    ("--eval-harness-limit", "eval_harness_limit"),
    ("--eval-harness-num-fewshot", "eval_harness_num_fewshot"),
)
"""The flags that only mean something with --eval-harness-tasks."""


def _layout_refusal(cfg: TridentConfig) -> str | None:
    """Why generation cannot run on this training layout (None: it can)."""
    p = cfg.parallel
    if p.sequence_parallel_enabled:
        return (
            "--sequence-parallel (generation feeds one token at a time; drop --sequence-parallel)"
        )
    if p.context_parallel_size > 1:
        return f"--context-parallel-size {p.context_parallel_size} (use 1)"
    if p.ds_sequence_parallel_size > 1:
        return f"--ds-sequence-parallel-size {p.ds_sequence_parallel_size} (use 1)"
    if p.zero_stage == 3:
        return "--zero-stage 3 (its parameters are partitioned over data-parallel ranks; use 0, 1 or 2)"
    return None


def check_eval_harness(cfg: TridentConfig) -> None:
    """--eval-harness-* against each other, the layout and the installed packages.

    Raises:
        ValueError: a follower flag without --eval-harness-tasks, an empty task name, a layout generation cannot
            run, or lm-evaluation-harness is not installed.
    """
    t = cfg.training
    if not t.eval_harness_tasks:
        for flag, field in _FOLLOWERS:
            value = getattr(t, field)
            if value is not None:
                raise ValueError(
                    f"{flag} ({value}) without --eval-harness-tasks evaluates nothing; add "
                    "--eval-harness-tasks TASK [TASK ...] or drop the flag."
                )
        return
    if any(not name.strip() for name in t.eval_harness_tasks):
        raise ValueError(
            f"--eval-harness-tasks {' '.join(repr(n) for n in t.eval_harness_tasks)}: a task name is empty."
        )
    refusal = _layout_refusal(cfg)
    if refusal is not None:
        raise ValueError(
            f"--eval-harness-tasks runs generation on the training model, which it cannot do with {refusal}."
        )
    if importlib.util.find_spec("lm_eval") is None:
        raise ValueError(
            "--eval-harness-tasks needs lm-evaluation-harness: pip install lm_eval==0.4.13 (or drop the flag)."
        )
