"""Megatron-DeepSpeed's sequence-length curriculum: the ``curriculum_learning`` section of the DeepSpeed JSON.

Their ``examples_deepspeed/curriculum_learning`` scripts (and the MoE templates, with ``"enabled": false``) put a
legacy top-level section in the DeepSpeed config::

    "curriculum_learning": {"enabled": true, "curriculum_type": "seqlen", "min_difficulty": 64,
                            "max_difficulty": 2048, "schedule_type": "fixed_linear",
                            "schedule_config": {"total_curriculum_step": 15000, "difficulty_step": 8}}

DeepSpeed 0.19.8 refuses that key ("Legacy top-level 'curriculum_learning' has been removed"), so Trident takes it
out of the JSON it hands DeepSpeed and runs the curriculum itself, as Megatron-DeepSpeed's
``curriculum_learning_legacy`` path does:

- iteration ``i`` (1-based: the optimizer step about to run) trains on the first ``seqlen(i)`` positions of every
  sample: tokens, labels, loss mask, position ids (and the attention mask) are cut to that length, the rest of the
  sample is not used (as theirs);
- ``seqlen(i)`` is DeepSpeed's own ``CurriculumScheduler.get_difficulty(i)`` (``fixed_linear``, ``fixed_root``,
  ``fixed_discrete``), capped at ``max_difficulty``: a function of the iteration alone, so a resumed run continues
  the same schedule and every layout sees the same truncated samples;
- evaluation uses whole sequences (their ``evaluate`` resets the length too);
- consumed tokens (``--train-tokens``, the token LR schedule) count the truncated length;
- the length is in the progress line (``curriculum seqlen``), the metrics record (``curriculum_seqlen``) and
  TensorBoard (``seqlen/curriculum_seqlen``).

Only ``curriculum_type: seqlen`` exists here (the only type their GPT scripts use); DeepSpeed's newer
``data_efficiency`` curriculum (``--data-efficiency-curriculum-learning``) is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

SECTION = "curriculum_learning"
SCHEDULES = ("fixed_linear", "fixed_root", "fixed_discrete")
_REQUIRED = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
}


@dataclass(frozen=True)
class SeqlenCurriculum:
    """A validated sequence-length schedule (the JSON section, as DeepSpeed's scheduler reads it)."""

    config: str
    """The section as canonical JSON (a frozen value; :meth:`seqlen` builds DeepSpeed's scheduler from it)."""
    max_difficulty: int

    def seqlen(self, iteration: int) -> int:
        """The sequence length of (1-based) ``iteration``."""
        return min(self.max_difficulty, int(_scheduler(self.config).get_difficulty(iteration)))


_SCHEDULERS: dict[str, Any] = {}


def _scheduler(config: str) -> Any:
    if config not in _SCHEDULERS:
        from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

        _SCHEDULERS[config] = CurriculumScheduler(json.loads(config))
    return _SCHEDULERS[config]


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_schedule(section: dict[str, Any], where: str, multiple: int) -> list[int]:
    """The difficulties the schedule can produce that must divide by ``multiple`` (raises on a bad key)."""
    kind = section.get("schedule_type")
    if kind not in SCHEDULES:
        raise ValueError(
            f"{where}.schedule_type is {json.dumps(kind)}; use one of {', '.join(SCHEDULES)}."
        )
    sched = section.get("schedule_config")
    missing = [k for k in _REQUIRED[kind] if not isinstance(sched, dict) or k not in sched]
    if missing:
        raise ValueError(
            f"{where}.schedule_config lacks {', '.join(missing)} (needed by schedule_type {kind})."
        )
    sched = cast(dict[str, Any], sched)  # an object with the keys: checked just above
    if kind == "fixed_discrete":
        diffs, steps = sched["difficulty"], sched["max_step"]
        if not (
            isinstance(diffs, list)
            and isinstance(steps, list)
            and diffs
            and all(_positive_int(d) for d in diffs)
            and all(_positive_int(s) for s in steps)
            and len(diffs) == len(steps) + 1
        ):
            raise ValueError(
                f"{where}.schedule_config needs 'difficulty': a list of positive lengths and 'max_step': a "
                "list of positive iterations with one element fewer (the last length holds after the last step)."
            )
        return list(diffs)
    for key in _REQUIRED[kind]:
        if not _positive_int(sched[key]):
            raise ValueError(
                f"{where}.schedule_config.{key} is {json.dumps(sched[key])}; give a positive integer."
            )
    if sched["difficulty_step"] % multiple:
        raise ValueError(
            f"{where}.schedule_config.difficulty_step ({sched['difficulty_step']}) must be a multiple of "
            f"{multiple} (--tensor-model-parallel-size with --sequence-parallel splits the sequence)."
        )
    return []


def _enabled(section: Any, where: str) -> bool:
    if section is None:  # absent: off, as DeepSpeed reads it
        return False
    if not isinstance(section, dict) or not isinstance(section.get("enabled", False), bool):
        raise ValueError(f"{where} must be an object with a boolean 'enabled'.")
    return bool(section.get("enabled", False))


def _data_efficiency_section(
    user: dict[str, Any], source: str, flag: bool
) -> tuple[dict[str, Any] | None, str]:
    """The seqlen_truncate metric of ``data_efficiency.data_sampling.curriculum_learning`` as a legacy-style
    section (None when that curriculum is off), and where it is, for messages."""
    where = f"{source}: data_efficiency.data_sampling.curriculum_learning"
    de = user.get("data_efficiency")
    sampling = de.get("data_sampling") if isinstance(de, dict) else None
    section = sampling.get("curriculum_learning") if isinstance(sampling, dict) else None
    on = (
        de is not None
        and _enabled(de, f"{source}: data_efficiency")
        and _enabled(sampling, f"{source}: data_efficiency.data_sampling")
        and _enabled(section, where)
    )
    if on != flag:
        raise ValueError(
            f"--data-efficiency-curriculum-learning and {where} go together: "
            + ("add the flag" if on else f"enable that section in {source}")
            + " (or remove the other)."
        )
    if not on:
        return None, where
    metrics = cast(dict[str, Any], section).get("curriculum_metrics")  # _enabled: an object
    names = list(metrics) if isinstance(metrics, dict) else []
    if names != ["seqlen_truncate"]:
        raise ValueError(
            f'{where}.curriculum_metrics is {json.dumps(names)}; only "seqlen_truncate" is supported (metrics '
            "such as vocabulary rarity need DeepSpeed's data analysis index files, and seqlen_reshape changes "
            "the batch size, which Trident does not do)."
        )
    metric = metrics["seqlen_truncate"]
    if not isinstance(metric, dict):
        raise ValueError(f"{where}.curriculum_metrics.seqlen_truncate must be an object.")
    keys = ("min_difficulty", "max_difficulty", "schedule_type", "schedule_config")
    legacy = {"enabled": True, "curriculum_type": "seqlen", **{k: metric.get(k) for k in keys}}
    return legacy, f"{where}.curriculum_metrics.seqlen_truncate"


def parse_curriculum(
    user: dict[str, Any],
    source: str,
    *,
    seq_length: int,
    sequence_multiple: int = 1,
    data_efficiency: bool = False,
) -> SeqlenCurriculum | None:
    """The curriculum of the user's DeepSpeed JSON ``user`` (None when absent or ``"enabled": false``).

    Args:
        user: the parsed ``--deepspeed_config``.
        source: its path, for messages.
        seq_length: ``--seq-length``; ``max_difficulty`` may not exceed it.
        sequence_multiple: every length must be a multiple of it (``config.context_parallel.sequence_multiple``).
        data_efficiency: ``--data-efficiency-curriculum-learning``: the schedule is the ``seqlen_truncate``
            metric of ``data_efficiency.data_sampling.curriculum_learning`` (same lengths, same truncation).

    Raises:
        ValueError: a key is missing or wrong (naming the file, the key and the fix).
    """
    _check_no_random_ltd(user, source)
    de_section, de_where = _data_efficiency_section(user, source, data_efficiency)
    section = user.get(SECTION)
    where = f"{source}: {SECTION}"
    if section is not None and not _enabled(section, where):
        section = None
    if section is not None and de_section is not None:
        raise ValueError(
            f"{where} and {de_where} are both enabled; keep one sequence-length curriculum."
        )
    if de_section is not None:
        section, where = de_section, de_where
    if section is None:
        return None
    if section.get("curriculum_type") != "seqlen":
        raise ValueError(
            f'{where}.curriculum_type is {json.dumps(section.get("curriculum_type"))}; only "seqlen" (the '
            "sequence-length curriculum) is supported."
        )
    lo, hi = section.get("min_difficulty"), section.get("max_difficulty")
    if not (_positive_int(lo) and _positive_int(hi) and lo <= hi <= seq_length):
        raise ValueError(
            f"{where}: min_difficulty ({json.dumps(lo)}) and max_difficulty ({json.dumps(hi)}) must be integers "
            f"with 1 <= min_difficulty <= max_difficulty <= --seq-length ({seq_length})."
        )
    extra = _check_schedule(section, where, sequence_multiple)
    bad = [d for d in [hi, *extra] if d % sequence_multiple or d > seq_length]
    if bad:
        raise ValueError(
            f"{where}: lengths {bad} must be at most --seq-length ({seq_length}) and multiples of "
            f"{sequence_multiple} (the sequence is split over that many ranks: --tensor-model-parallel-size "
            "with --sequence-parallel, --ds-sequence-parallel-size, 2 x --context-parallel-size)."
        )
    return SeqlenCurriculum(json.dumps(section, sort_keys=True), hi)


class CurrentSeqlen:
    """The length the next training micro-batches are cut to (None: whole samples); set by the trainer before each
    step, read by the training batch iterator (evaluation batches are never cut)."""

    def __init__(self) -> None:
        self.value: int | None = None


def truncate_batch(batch: dict[str, Any], seqlen: int | None) -> dict[str, Any]:
    """``batch`` with every sequence dimension cut to ``seqlen``: ``[b, s]`` tensors and the ``[b, 1, s, s]`` mask."""
    if seqlen is None or batch["tokens"].shape[1] <= seqlen:
        return batch
    out = {}
    for key, value in batch.items():
        if key == "attention_mask":
            out[key] = value[:, :, :seqlen, :seqlen].contiguous()
        else:
            out[key] = value[:, :seqlen].contiguous()
    return out


def _check_no_random_ltd(user: dict[str, Any], source: str) -> None:
    de = user.get("data_efficiency")
    routing = de.get("data_routing") if isinstance(de, dict) else None
    ltd = routing.get("random_ltd") if isinstance(routing, dict) else None
    if (
        isinstance(de, dict)
        and de.get("enabled")
        and isinstance(routing, dict)
        and routing.get("enabled")
        and isinstance(ltd, dict)
        and ltd.get("enabled")
    ):
        raise ValueError(
            f"{source}: data_efficiency.data_routing.random_ltd is enabled, but random layerwise token dropping "
            "is not built; set its 'enabled' to false."
        )


def without_curriculum(user: dict[str, Any]) -> dict[str, Any]:
    """``user`` without the curriculum sections Trident runs itself: the legacy ``curriculum_learning`` (DeepSpeed
    0.19.8 refuses it) and ``data_efficiency`` (DeepSpeed would only act on it through its own data loader, which
    Trident does not use; random-LTD is refused by :func:`parse_curriculum`)."""
    return {k: v for k, v in user.items() if k not in (SECTION, "data_efficiency")}
