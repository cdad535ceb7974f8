"""The training side of --eval-harness-tasks: when the harness runs, what it may touch, where its scores go.

The training package schedules and records the evaluation but never imports it (``megatron/evaluation`` and
``megatron/text_generation`` sit beside or above training, ``tests/test_layering.py``). The entry point
(``pretrain_gpt.py``) passes ``pretrain`` a :data:`HarnessFactory`; ``pretrain`` calls it once, after the engine is
built (and the checkpoint loaded), with the :class:`TrainingModel`, and gets the :data:`EvalHarness` the loop calls
every --eval-harness-interval iterations, on every rank together::

    pretrain_gpt.py  --factory-->  pretrain  --TrainingModel-->  factory  --EvalHarness-->  loop
    loop, iteration % interval == 0:  with evaluation_window(model):  scores = harness(iteration)
                                      -> metrics JSONL, TensorBoard, W&B (rank 0), one console line

:func:`evaluation_window` is what makes "the evaluation does not change the training losses" hold whatever the
harness does: the model is in eval mode inside it (no dropout) and every module's mode is put back after it, and
every random state training draws from is restored (``mpu.random.preserved_rng_states``; lm-evaluation-harness
seeds Python, NumPy and torch itself). The harness reads the parameters without a gradient and touches neither the
optimizer nor the data iterators.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron.config import TrainingConfig
from megatron.launch.exit_codes import ConfigError
from megatron.mpu.parallel_state import ParallelState
from megatron.mpu.random import preserved_rng_states
from megatron.training.metrics import MetricsWriter, format_harness_line

logger = logging.getLogger(__name__)

HarnessScores = dict[str, dict[str, float]]
"""``{task: {metric: value}}`` (e.g. ``{"lambada_openai": {"acc": 0.31, "perplexity": 41.2}}``)."""

EvalHarness = Callable[[int], HarnessScores]
"""Scores the training model now (the argument: the iteration just trained); collective over every rank."""


@dataclass(frozen=True)
class TrainingModel:
    """What a harness factory gets: this rank's share of the training model and how the run is laid out."""

    module: nn.Module
    """The engine's module: ``GPTModel`` (PP = 1) or this rank's ``GPTModelPipe`` stage; its parameters are the
    ones the optimizer steps (share them, do not copy them)."""
    device: torch.device
    state: ParallelState
    """The run's process groups (TP, PP, DP)."""
    tokenizer: Any
    """The run's tokenizer (``megatron.tokenizer``)."""
    training: TrainingConfig
    """The run's training flags (the --eval-harness-* ones among them)."""


HarnessFactory = Callable[[TrainingModel], EvalHarness]
"""Builds the run's :data:`EvalHarness` once, at start-up (a bad task name fails there, before any step)."""


@contextmanager
def evaluation_window(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode for the block; afterwards every submodule's mode and every random state training
    draws from are what they were before."""
    modes = [(m, m.training) for m in module.modules()]
    with preserved_rng_states():
        module.eval()
        try:
            yield
        finally:
            for m, training in modes:
                m.training = training


@dataclass
class HarnessSchedule:
    """The run's harness and when it runs (every ``interval`` iterations)."""

    harness: EvalHarness
    module: nn.Module
    """The training module :func:`evaluation_window` holds in eval mode."""
    interval: int

    def due(self, iteration: int) -> bool:
        """``iteration`` is a multiple of --eval-harness-interval."""
        return iteration % self.interval == 0

    def run(self, iteration: int, writer: MetricsWriter) -> HarnessScores:
        """Score the model now and record the scores (rank 0 writes)."""
        start = time.perf_counter()
        with evaluation_window(self.module):
            scores = self.harness(iteration)
        writer.harness(iteration, scores)
        if writer.enabled:
            logger.info(format_harness_line(iteration, scores, time.perf_counter() - start))
        return scores


def harness_schedule(
    factory: HarnessFactory | None, model: TrainingModel
) -> HarnessSchedule | None:
    """The run's :class:`HarnessSchedule` when --eval-harness-tasks is given and the entry point passed a factory
    (the interval: --eval-harness-interval, else --eval-interval); None otherwise.

    Raises:
        ConfigError: the factory refused the tasks (``ValueError`` / ``FileNotFoundError``: an unknown task, a
            missing data file), on every rank alike, before the first step.
    """
    t = model.training
    if factory is None or not t.eval_harness_tasks:
        return None
    interval = t.eval_harness_interval or t.eval_interval
    try:
        # building it draws nothing from training's random streams either
        with preserved_rng_states():
            harness = factory(model)
    except (ValueError, FileNotFoundError) as err:  # an unknown task, a missing data file: exit 2
        raise ConfigError(str(err)) from None
    return HarnessSchedule(harness=harness, module=model.module, interval=interval)
