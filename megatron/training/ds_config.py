"""The DeepSpeed config, generated from our flags; a user ``--deepspeed_config`` JSON may only ADD keys.

Trident owns every key that one of its flags determines (batch sizes, ZeRO stage, precision and loss scaling,
clipping, the optimizer, which Trident builds itself as a torch optimizer). A user JSON contributes the rest
(ZeRO tuning such as ``reduce_bucket_size``, ``offload_optimizer``, ``stage3_*`` knobs, ...). A key that repeats one of
ours with another value is a ``ValueError`` naming both sources, raised before any process group exists:

    --global-batch-size (16) sets train_batch_size = 16, but ds.json has train_batch_size = 32;
    remove the key from ds.json or change the flag.

Engine choice (documented decision): PP = 1 uses the plain ``GPTModel`` with ``DeepSpeedEngine`` (every ZeRO stage);
PP > 1 uses ``GPTModelPipe`` with DeepSpeed's ``PipelineEngine`` (ZeRO 0/1; ``validate()`` rejects 2/3).
``--no-pipeline-parallel`` is accepted and only requires PP = 1.

ZeRO-0 + pipeline + clipping: DeepSpeed 0.19.8 computes a wrong global grad norm there (non-TP parameters of every
stage but the first are dropped from the norm). Trident upgrades such runs to ZeRO-1, whose norm is right, and logs
one line saying so (``megatron.config.plan.effective_zero_stage``). Numerics are unchanged; memory only shrinks.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
from pathlib import Path
from typing import Any

from megatron.config import ParallelConfig, RunPlan, TrainingConfig, TridentConfig
from megatron.config.context_parallel import sequence_multiple
from megatron.training.curriculum import SeqlenCurriculum, parse_curriculum, without_curriculum
from megatron.training.zero_init import check_nvme_offload

logger = logging.getLogger(__name__)

_STEPS_PER_PRINT = 10**9  # Trident prints its own progress line; keep DeepSpeed's quiet.


def _owned_entries(cfg: TridentConfig, plan: RunPlan) -> list[tuple[str, Any, str]]:
    """(dotted DeepSpeed key, value, the flag that determines it) for every key Trident owns."""
    t = cfg.training
    stage, gbs, gas = plan.zero_stage, plan.global_batch_size, plan.gradient_accumulation_steps
    cp = plan.context_parallel_size if plan.pipeline_engine else 1
    # DeepSpeed's pipeline grid counts the CP ranks as data-parallel (model_setup.py): its batch counts each
    # sample once per CP rank.
    batch_flag = f"--global-batch-size ({gbs})" + (
        f" x --context-parallel-size ({cp}) (the pipeline grid counts CP ranks as data-parallel)"
        if cp > 1
        else ""
    )
    entries: list[tuple[str, Any, str]] = [
        ("train_batch_size", gbs * cp, batch_flag),
        (
            "train_micro_batch_size_per_gpu",
            t.micro_batch_size,
            f"--micro-batch-size ({t.micro_batch_size})",
        ),
        (
            "gradient_accumulation_steps",
            gas,
            f"--global-batch-size / (--micro-batch-size x data-parallel size) ({gas})",
        ),
        ("zero_optimization.stage", stage, f"--zero-stage ({stage})"),
        ("gradient_clipping", float(t.clip_grad), f"--clip-grad ({t.clip_grad})"),
        ("bf16.enabled", t.bf16, f"--bf16 ({t.bf16})"),
        ("fp16.enabled", t.fp16, f"--fp16 ({t.fp16})"),
        (
            "zero_force_ds_cpu_optimizer",
            False,
            "Trident's torch optimizer (--optimizer); offload works with it only when this is false",
        ),
    ]
    if t.fp16:
        entries += [
            ("fp16.loss_scale", float(t.loss_scale or 0.0), f"--loss-scale ({t.loss_scale})"),
            (
                "fp16.initial_scale_power",
                int(round(math.log2(t.initial_loss_scale))),
                f"--initial-loss-scale ({t.initial_loss_scale})",
            ),
            (
                "fp16.loss_scale_window",
                t.loss_scale_window,
                f"--loss-scale-window ({t.loss_scale_window})",
            ),
            ("fp16.hysteresis", t.hysteresis, f"--hysteresis ({t.hysteresis})"),
            ("fp16.min_loss_scale", t.min_loss_scale, f"--min-loss-scale ({t.min_loss_scale})"),
        ]
    sp = cfg.parallel.ds_sequence_parallel_size
    if sp > 1 and stage == 3:
        # ZeRO-3 + Ulysses: one gradient-reduction path for every bucket, the one ulysses_backward_scale corrects.
        why = f"--ds-sequence-parallel-size {sp} with --zero-stage 3 (see megatron/training/ulysses.py)"
        entries.append(("zero_optimization.reduce_scatter", True, why))
    if plan.pipeline_engine and plan.sequence_parallel:
        # DeepSpeed's pipe engine sends 1/TP of an activation per TP rank and all-gathers it on the receiver, which
        # assumes the activation is identical over TP. Under sequence parallelism every TP rank holds a different
        # sequence shard, so partitioning would mix shards: send whole tensors instead.
        why = "--sequence-parallel with --pipeline-model-parallel-size > 1 (True)"
        entries += [
            ("pipeline.pipe_partitioned", False, why),
            ("pipeline.grad_partitioned", False, why),
        ]
    moe = cfg.model.moe.is_moe(cfg.model.num_layers)
    tp = plan.tensor_model_parallel_size
    if plan.pipeline_engine and moe and tp > 1 and not plan.sequence_parallel:
        # MoE: the running MoE loss travels as a second activation that requires grad; like Megatron-DeepSpeed,
        # send whole tensors (its pipe engine does not partition such tuples).
        why = "MoE layers (--num-experts) with --pipeline-model-parallel-size > 1"
        entries += [
            ("pipeline.pipe_partitioned", False, why),
            ("pipeline.grad_partitioned", False, why),
        ]
    if t.cpu_optimizer:
        entries.append(
            ("zero_optimization.offload_optimizer.device", "cpu", "--cpu-optimizer (True)")
        )
    if t.optimizer == "sgd":
        entries.append(
            ("zero_allow_untested_optimizer", True, "--optimizer sgd (ZeRO accepts SGD only so)")
        )
    if cfg.checkpoint.universal_checkpoint:
        entries.append(("checkpoint.load_universal", True, "--universal-checkpoint (True)"))
    return entries


def load_user_ds_config(path: str) -> dict[str, Any]:
    """Read a ``--deepspeed_config`` JSON file.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: it is not valid JSON, or not a JSON object.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--deepspeed_config {path}: no such file.")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--deepspeed_config {path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}."
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"--deepspeed_config {path}: the top level must be a JSON object.")
    return data


class _RecordingDict(dict):  # type: ignore[type-arg]
    """A dict that records every top-level key DeepSpeed's config parser looks up (and the last one)."""

    def __init__(self, data: dict[str, Any]) -> None:
        super().__init__(data)
        self.seen: set[str] = set()
        self.last: str | None = None

    def _note(self, key: Any) -> None:
        if isinstance(key, str):
            self.seen.add(key)
            self.last = key

    def get(self, key: Any, default: Any = None) -> Any:
        self._note(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self._note(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._note(key)
        return super().__contains__(key)

    def keys(self) -> Any:  # DeepSpeed writes ``KEY in param_dict.keys()``
        owner = self

        class _Keys:
            def __contains__(self, key: object) -> bool:
                return owner.__contains__(key)

            def __iter__(self) -> Any:
                return iter(dict.keys(owner))

        return _Keys()


_WORLD_OF_ONE = {
    "train_batch_size": 1,
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
}


def _parse_with_deepspeed(rec: _RecordingDict) -> None:
    """Run DeepSpeed's own config parser (``DeepSpeedConfig``: its constants and pydantic models) over ``rec``, which
    records the top-level keys it reads. Raises what DeepSpeed raises."""
    from deepspeed.runtime.config import DeepSpeedConfig

    class _OneRank:  # the batch keys are a world of one, whatever process group exists (a rank of a real run)
        @staticmethod
        def get_data_parallel_world_size() -> int:
            return 1

    DeepSpeedConfig(rec, mpu=_OneRank())


def check_deepspeed_keys(user: dict[str, Any], source: str) -> None:
    """Every top-level key of ``user`` is one DeepSpeed reads, and DeepSpeed's pydantic models accept every section.

    DeepSpeed itself ignores an unknown top-level key (``zero_optimisation`` silently meant ZeRO-0); the known keys
    are those its parser looks up (recorded while it parses, so they follow the installed DeepSpeed).

    Raises:
        ValueError: one line naming the unknown key (and the known ones), or the key path DeepSpeed rejects.
    """
    import pydantic

    # The batch keys become a world of one (ours are checked against the flags separately).
    rec = _RecordingDict({**user, **_WORLD_OF_ONE})
    try:
        _parse_with_deepspeed(rec)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        loc = [str(p) for p in first["loc"]]
        # The section whose object holds the rejected path (pydantic names only the path inside its model).
        sections = [k for k, v in user.items() if isinstance(v, dict) and _get(v, ".".join(loc))[0]]
        path = ".".join([sections[0] if len(sections) == 1 else rec.last or "?", *loc])
        raise ValueError(
            f"{source}: DeepSpeed rejects {path} ({first['msg']}); fix or remove it in {source}."
        ) from None
    except (AssertionError, ValueError, TypeError, KeyError) as err:
        where = f" (while reading '{rec.last}')" if rec.last else ""
        raise ValueError(f"{source}: DeepSpeed rejects the config{where}: {err}") from None
    known = rec.seen | set(_owned_keys())
    unknown = sorted(k for k in user if k not in known)
    if unknown:
        close = {k: difflib.get_close_matches(k, sorted(known), n=1) for k in unknown}
        hints = "".join(f" ('{k}': did you mean '{m[0]}'?)" for k, m in close.items() if m)
        raise ValueError(
            f"{source}: unknown top-level key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}{hints}; "
            f"DeepSpeed would ignore {'them' if len(unknown) > 1 else 'it'}. Known keys: "
            f"{', '.join(sorted(known))}."
        )


def _owned_keys() -> tuple[str, ...]:
    return ("steps_per_print", "wall_clock_breakdown", "zero_force_ds_cpu_optimizer")


def _get(d: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = d
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _set(d: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        d = d.setdefault(part, {})
    d[leaf] = value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (isinstance(a, bool) and isinstance(b, bool) and a == b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def _check_no_client_sections(user: dict[str, Any], source: str) -> None:
    for key, why in (
        (
            "optimizer",
            "Trident builds a torch optimizer from --optimizer/--lr/--adam-*/--weight-decay",
        ),
        ("scheduler", "Trident drives the LR schedule from --lr-decay-style/--lr-warmup-*"),
    ):
        if key in user:
            raise ValueError(
                f"{source} has an '{key}' section, but {why}; remove '{key}' from {source} and use the flags."
            )


def _offload_device(user: dict[str, Any], key: str, source: str) -> str | None:
    """The device of ``zero_optimization.<key>`` in the user's config (None when absent or ``"none"``).

    Raises:
        ValueError: the section is not an object.
    """
    present, section = _get(user, f"zero_optimization.{key}")
    if not present or section is None:
        return None
    if not isinstance(section, dict):
        raise ValueError(
            f"zero_optimization.{key} in {source} is {section!r}; DeepSpeed expects an object such "
            f'as {{"device": "cpu"}} (or {{"device": "none"}} to turn it off).'
        )
    device = section.get("device", "none")
    return None if device in (None, "none") else str(device)


def _check_offload(user: dict[str, Any], stage: int, source: str) -> None:
    """ZeRO offload only exists at the stages that partition what it moves (DeepSpeed ignores it elsewhere)."""
    opt = _offload_device(user, "offload_optimizer", source)
    if opt is not None and stage == 0:
        raise ValueError(
            f"{source} has zero_optimization.offload_optimizer (device {opt}), but the ZeRO stage is 0, where "
            "DeepSpeed ignores it; pass --zero-stage 1 (or 2/3) or remove offload_optimizer from "
            f"{source}."
        )
    param = _offload_device(user, "offload_param", source)
    if param is not None and stage != 3:
        raise ValueError(
            f"{source} has zero_optimization.offload_param (device {param}), but the ZeRO stage is {stage}; "
            f"parameter offload needs --zero-stage 3 (or remove offload_param from {source})."
        )
    check_nvme_offload(user, source)


def _check_async_save(user: dict[str, Any], async_save: bool, source: str) -> None:
    """--async-save writes through DeepSpeed's torch checkpoint engine; a JSON choosing another engine (its own
    writers, DataStates) would write synchronously or behind Trident's protocol (0.19.8: ``checkpoint.writer``
    selects the fast or decoupled writer; a ``datastates_ckpt`` entry that is not false, DataStates)."""
    if not async_save:
        return
    for key in ("checkpoint.writer", "datastates_ckpt"):
        present, value = _get(user, key)
        if present and value not in (None, False):
            raise ValueError(
                f"--async-save writes checkpoints in the background through DeepSpeed's torch checkpoint engine, "
                f"but {source} sets {key} = {json.dumps(value)}, which selects another checkpoint engine; remove "
                f"{key} from {source} or drop --async-save."
            )


def build_ds_config(
    cfg: TridentConfig, plan: RunPlan, user: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The DeepSpeed config dict for ``cfg`` run as ``plan``, merged with ``user`` (or --deepspeed_config).

    Args:
        cfg: validated config.
        plan: the run plan (batch sizes, accumulation steps, the ZeRO stage in effect).
        user: the user's extra keys; None reads ``cfg.training.deepspeed_config`` when it is set.

    Returns:
        A fresh dict: the user's keys, then Trident's owned keys on top.

    Raises:
        ValueError: a user key contradicts a flag (naming the flag, the key and both values), the user JSON
            has an optimizer/scheduler section, or it asks for ZeRO offload at a stage without it.
        FileNotFoundError: --deepspeed_config names a missing file.
    """
    source = "the DeepSpeed config"
    if user is None and cfg.training.deepspeed_config:
        source = cfg.training.deepspeed_config
        user = load_user_ds_config(source)
    user = user or {}
    parse_curriculum(
        user,
        source,
        seq_length=cfg.model.seq_length,
        sequence_multiple=_sequence_multiple(cfg.parallel),
        data_efficiency=cfg.training.data_efficiency_curriculum_learning,
    )  # checked here with the other JSON errors; DeepSpeed 0.19.8 refuses the legacy section: Trident runs it
    user = without_curriculum(user)
    _check_no_client_sections(user, source)
    merged: dict[str, Any] = json.loads(json.dumps(user))  # deep copy, JSON types only
    merged.setdefault("steps_per_print", _STEPS_PER_PRINT)
    merged.setdefault("wall_clock_breakdown", False)
    for key, value, flag in _owned_entries(cfg, plan):
        present, theirs = _get(user, key)
        # A JSON that repeats --zero-stage (Megatron-DeepSpeed's scripts do) is raised with it.
        if key == "zero_optimization.stage" and _same(theirs, plan.requested_zero_stage):
            theirs = value
        if present and not _same(theirs, value):
            raise ValueError(
                f"{flag} sets {key} = {json.dumps(value)}, but {source} has {key} = "
                f"{json.dumps(theirs)}; remove the key from {source} or change the flag."
            )
        _set(merged, key, value)
    _check_offload(user, plan.zero_stage, source)
    _check_async_save(user, cfg.checkpoint.async_save, source)
    if user:  # after our own checks, whose messages know more than DeepSpeed's
        check_deepspeed_keys(user, source)
    return merged


def _sequence_multiple(p: ParallelConfig) -> int:
    # Megatron SP splits s over TP, Ulysses over its N ranks, CP into 2 x CP chunks (config/context_parallel.py).
    return sequence_multiple(p)


def curriculum_of(
    t: TrainingConfig, parallel: ParallelConfig, *, seq_length: int
) -> SeqlenCurriculum | None:
    """The sequence-length curriculum of --deepspeed_config (``curriculum.py``), None without one."""
    source = t.deepspeed_config
    return parse_curriculum(
        load_user_ds_config(source) if source else {},
        source or "no --deepspeed_config",
        seq_length=seq_length,
        sequence_multiple=_sequence_multiple(parallel),
        data_efficiency=t.data_efficiency_curriculum_learning,
    )


def log_zero_upgrade(t: TrainingConfig, plan: RunPlan) -> None:
    """Log once when the ZeRO stage in effect differs from --zero-stage (see ``effective_zero_stage``)."""
    if plan.zero_stage_raised:
        logger.info(
            "--zero-stage 0 with --pipeline-model-parallel-size %d and --clip-grad %s: using ZeRO-1 "
            "(DeepSpeed 0.19.8 computes a wrong grad norm for ZeRO-0 pipelines with clipping).",
            plan.pipeline_model_parallel_size,
            t.clip_grad,
        )
