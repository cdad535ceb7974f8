"""Start-up rules of checkpointing: every check of --save/--load and of a checkpoint against the run, made before
any process group exists and identically on every rank (so all ranks fail together, with one line).

The compatibility of a checkpoint's layout, ZeRO stage and precision with the run that loads it is a table,
:data:`RESUME_RULES`: each row names what must agree, when it is broken, and the message (what was saved, what the
run uses, the fix). DeepSpeed stores each ZeRO stage kind and each precision in other files, and ZeRO partitions
over the data-parallel ranks, so loading the optimizer state needs them to agree; loading weights only
(``--finetune``, converted checkpoints) needs only the TP/PP sizes (``weights_only.py`` reads the rest).

Rows marked ``mended_on_load`` (TP / PP size, ZeRO-3 vs 0/1/2 files, how the stage stores the optimizer state, DP
size, MoE EP size) are not errors where :func:`converts_on_load`: a dense checkpoint saved with ZeRO-1/2, loaded
with its optimizer state into a run that can load a universal checkpoint, is converted on the way in
(``relayout.py``); an fp32 MoE checkpoint at TP = PP = 1 at another EP (or, with ZeRO-1/2, DP) size too
(``relayout_moe.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.checkpointing.checksums import (
    PendingVerification,
    check_readable_archives,
    files_to_verify,
    start_verification,
    verify_checkpoint_files,
)
from megatron.checkpointing.meta import check_model_matches, check_universal_kind, read_meta
from megatron.checkpointing.pointers import complete_tags, find_checkpoint
from megatron.checkpointing.weights_only import saved_zero_stage, stage_family
from megatron.config import CheckpointConfig, DataConfig, RunPlan, TridentConfig
from megatron.log import global_rank

logger = logging.getLogger(__name__)


def check_save_dir(save: str) -> None:
    """Preflight for --save: the directory exists or can be created, and a file can be written in it.

    Raises:
        ValueError: naming --save, the reason and the fix.
    """
    path = Path(save)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".trident_write_test.{os.getpid()}.{global_rank()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"--save {save}: the directory cannot be written ({err.strerror or err}); "
            "choose a writable directory or fix its permissions."
        ) from None


def _same_dir(a: str, b: str) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def _check_save_holds_no_other_run(ck: CheckpointConfig) -> None:
    """--save must not receive a new run's checkpoints on top of another run's (they would be overwritten and
    'latest' moved): refuse a --save holding checkpoints unless it is the --load directory being resumed."""
    if not ck.save or not Path(ck.save).is_dir():
        return
    tags = complete_tags(Path(ck.save))
    if not tags:
        return
    newest = tags[-1][1]
    if not ck.load or not _same_dir(ck.load, ck.save):
        drop = [
            f
            for f, on in (
                ("--finetune", ck.finetune),
                ("--universal-checkpoint", ck.universal_checkpoint),
            )
            if on
        ]
        raise ValueError(
            f"--save {ck.save} already holds checkpoints of a run (newest {newest}); this run would "
            f"overwrite them. To continue that run pass --load {ck.save}"
            + (f" and drop {' and '.join(drop)}" if drop else "")
            + "; to start a new one use an empty --save directory."
        )
    if ck.finetune and not bool(read_meta(ck.save, newest).get("weights_only", False)):
        raise ValueError(
            f"--finetune with --load = --save = {ck.save}: it would restart at iteration 0 over the "
            f"checkpoints there (newest {newest}). To continue a fine-tuning run, relaunch without "
            "--finetune; to start one, --load the pretrained checkpoint and --save to an empty directory."
        )
    if ck.reset_iteration:
        raise ValueError(
            f"--reset-iteration with --load = --save = {ck.save}: every relaunch would restart at iteration 0 "
            f"over the checkpoints there (newest {newest}). Pass --reset-iteration once, with --save to an empty "
            "directory."
        )


@dataclass(frozen=True)
class ResumeCase:
    """A checkpoint found in --load and the run that loads it: what :data:`RESUME_RULES` compare."""

    load_dir: str
    tag: str
    saved_tp: int
    saved_pp: int
    saved_dp: int
    saved_stage: int
    """The ZeRO stage DeepSpeed saved with (recorded, or recognized by its files)."""
    saved_precision: str | None
    """``fp32``/``bf16``/``fp16``; None for checkpoints written before it was recorded."""
    run_tp: int
    run_pp: int
    run_dp: int
    run_stage: int
    """The ZeRO stage the run uses (``--zero-stage`` 0 becomes 1 with pipelines and clipping)."""
    requested_stage: int
    """``--zero-stage`` as given."""
    run_precision: str
    weights_only: bool
    """Only weights are loaded: ``--finetune``, or a weights-only (converted) checkpoint."""
    optimizer_state: bool
    """The optimizer state is loaded too (neither weights only nor ``--no-load-optim``)."""
    saved_ep: int | None = None
    """--moe-expert-parallel-size of the checkpoint; None where it was not recorded."""
    run_ep: int = 1
    """--moe-expert-parallel-size of the run."""

    def uses(self) -> str:
        """How the run's ZeRO stage is described in a message."""
        uses = f"ZeRO-{self.run_stage}"
        if self.run_stage != self.requested_stage:
            uses += (
                f" (--zero-stage {self.requested_stage} becomes 1 with pipeline parallelism and --clip-grad, "
                "where ZeRO-0 computes a wrong gradient norm)"
            )
        return uses

    def stage_fix(self) -> str:
        """The flag that makes the run's stage the saved one."""
        if self.run_stage != self.requested_stage and self.saved_stage == 0:
            return "--clip-grad 0 (as when it was saved)"
        return f"--zero-stage {self.saved_stage}"

    def layout_hint(self) -> str:
        """How to continue at another layout (why this load is not converted on the way in)."""
        reshard = "reshard the weights offline (python -m tools.checkpoint.reshard; fresh optimizer state)."
        if self.saved_ep is not None:
            return (
                "an MoE checkpoint is converted on load only in fp32 at TP = PP = 1 (to another EP size, and "
                f"with ZeRO-1/2 to another DP size): {reshard}"
            )
        if self.saved_stage == 0:
            return (
                "it was saved with ZeRO-0, which keeps no optimizer partitions to convert on load: "
                f"{reshard}"
            )
        if self.saved_stage == 3:
            return (
                "it was saved with ZeRO-3, which is not converted on load (DeepSpeed's universal converter "
                "writes its tensors flat, without the shapes a load needs): pass --no-load-optim (Trident reads "
                f"ZeRO-3 weights at any DP size; fresh optimizer state), or {reshard}"
            )
        if self.run_stage == 3 and self.run_tp > 1:
            return (
                "convert it at --tensor-model-parallel-size 1 with ZeRO-3, or at this TP size with ZeRO-1/2 "
                f"(DeepSpeed's ZeRO-3 universal loader reads no TP slices); or {reshard}"
            )
        if not self.optimizer_state:
            return (
                "drop --no-load-optim / --finetune: a load with the optimizer state converts to the new layout "
                f"on the way in; or {reshard}"
            )
        return (
            "pass --zero-stage 1: DeepSpeed converts a checkpoint on load into ZeRO partitions, which fp32 "
            f"ZeRO-0 has none of; or {reshard}"
        )


@dataclass(frozen=True)
class ResumeRule:
    """One row of :data:`RESUME_RULES`."""

    what: str
    """What must agree between the checkpoint and the run."""
    broken: Callable[[ResumeCase], bool]
    message: Callable[[ResumeCase], str]
    mended_on_load: bool = False
    """Not an error where :func:`converts_on_load` (the conversion on the way in makes them agree)."""


def _tp_pp_message(c: ResumeCase) -> str:
    return (
        f"--load {c.load_dir} (tag {c.tag}) was saved with --tensor-model-parallel-size {c.saved_tp} and "
        f"--pipeline-model-parallel-size {c.saved_pp}; this run uses {c.run_tp} and {c.run_pp}. Use the "
        f"checkpoint's sizes, or {c.layout_hint()}"
    )


def _zero3_message(c: ResumeCase) -> str:
    return (
        f"--load {c.load_dir} (tag {c.tag}) was saved with ZeRO-{c.saved_stage}; this run uses {c.uses()}, and "
        "DeepSpeed keeps ZeRO-3's weights in other files than ZeRO-0/1/2's. Pass "
        f"{c.stage_fix()} to resume, or --finetune to start a new run from its weights."
    )


def _stage_family_message(c: ResumeCase) -> str:
    fix = c.stage_fix()
    other = {1: 2, 2: 1}.get(c.saved_stage) if c.run_pp == 1 else None  # pipelines refuse ZeRO-2
    also = f" (or {other})" if other is not None and fix.startswith("--zero-stage") else ""
    return (
        f"--load {c.load_dir} (tag {c.tag}) was saved with ZeRO-{c.saved_stage}; this run uses {c.uses()}, "
        f"whose optimizer state DeepSpeed stores differently. Pass {fix}{also}, or --no-load-optim (same "
        "iteration, fresh optimizer state)."
    )


def _precision_message(c: ResumeCase) -> str:
    flag = {"bf16": "--bf16", "fp16": "--fp16", "fp32": "neither --bf16 nor --fp16"}[
        c.saved_precision or "fp32"
    ]
    return (
        f"--load {c.load_dir} (tag {c.tag}) was trained in {c.saved_precision}; this run uses "
        f"{c.run_precision}, and DeepSpeed keeps the optimizer state of each precision in other files. Pass "
        f"{flag} as before, or --no-load-optim (same iteration, fresh optimizer state)."
    )


def _dp_message(c: ResumeCase) -> str:
    what = "weights and " if c.saved_stage == 3 else ""
    return (
        f"--load {c.load_dir} (tag {c.tag}) was saved by {c.saved_dp} data-parallel ranks with "
        f"ZeRO-{c.saved_stage}, whose {what}optimizer state are partitioned over them; this run has "
        f"{c.run_dp}. Launch {c.saved_dp * c.run_tp * c.run_pp} processes, pass --no-load-optim (fresh "
        f"optimizer), or {c.layout_hint()}"
    )


def _moe_refusal(c: ResumeCase) -> str:
    """Why an MoE checkpoint at another EP size is not converted on load (:func:`moe_converts_on_load`)."""
    if c.run_precision != "fp32" or c.saved_precision not in (None, "fp32"):
        return (
            "DeepSpeed's bf16/fp16 optimizers keep fp32 master groups by EP rank, which Trident does not "
            "convert (it converts fp32 MoE checkpoints on load)"
        )
    if c.run_tp > 1:
        return (
            "at TP > 1 DeepSpeed's expert-parallel groups span the tensor-parallel ranks (each TP rank's files "
            "hold other experts), which Trident does not convert (it converts at TP = PP = 1)"
        )
    return "Trident converts an MoE checkpoint on load only at TP = PP = 1"


def _ep_message(c: ResumeCase) -> str:
    return (
        f"--load {c.load_dir} (tag {c.tag}) was saved with --moe-expert-parallel-size {c.saved_ep}; this run "
        f"uses {c.run_ep}, and {_moe_refusal(c)}. Resume with --moe-expert-parallel-size {c.saved_ep} (on a "
        "data-parallel size divisible by it), or pass --no-load-optim (same iteration and expert weights, fresh "
        "optimizer state)."
    )


RESUME_RULES: tuple[ResumeRule, ...] = (
    ResumeRule(
        "tensor- and pipeline-parallel sizes",
        lambda c: (c.saved_tp, c.saved_pp) != (c.run_tp, c.run_pp),
        _tp_pp_message,
        mended_on_load=True,
    ),
    ResumeRule(
        "ZeRO-3 files vs ZeRO-0/1/2 files (unless only weights are loaded)",
        lambda c: not c.weights_only and (c.saved_stage == 3) != (c.run_stage == 3),
        _zero3_message,
        mended_on_load=True,
    ),
    ResumeRule(
        "how the ZeRO stage stores the optimizer state (0 | 1 and 2 | 3), when it is loaded",
        lambda c: c.optimizer_state and stage_family(c.saved_stage) != stage_family(c.run_stage),
        _stage_family_message,
        mended_on_load=True,
    ),
    ResumeRule(
        "precision of the optimizer state, when it is loaded",
        lambda c: (
            c.optimizer_state
            and c.saved_precision is not None
            and c.saved_precision != c.run_precision
        ),
        _precision_message,
    ),
    ResumeRule(
        "MoE expert-parallel size, when the optimizer state is loaded",
        lambda c: c.optimizer_state and c.saved_ep is not None and c.saved_ep != c.run_ep,
        _ep_message,
        mended_on_load=True,
    ),
    ResumeRule(
        "data-parallel size, when ZeRO partitioned the loaded state over it",
        lambda c: c.optimizer_state and c.saved_stage >= 1 and c.saved_dp != c.run_dp,
        _dp_message,
        mended_on_load=True,
    ),
)
"""Checked in order; the first broken row is the error. A row that loads weights only never breaks a row past the
first: ``weights_only.py`` reads any stage at any DP size."""


def moe_converts_on_load(case: ResumeCase) -> bool:
    """Whether an MoE checkpoint is converted on load (``relayout_moe.py``, by parameter name): its optimizer state
    is loaded in fp32 at TP = PP = 1 (at TP > 1 DeepSpeed's EP groups span the TP ranks, so each TP rank's expert
    files hold other experts), and either both sides are ZeRO-0 at another EP size (one torch optimizer state per
    EP rank) or both are ZeRO-1/2 at another EP or DP size (flat partitions, named by DeepSpeed)."""
    if case.saved_ep is None or not case.optimizer_state:
        return False
    if case.run_precision != "fp32" or case.saved_precision not in (None, "fp32"):
        return False
    if (case.saved_tp, case.saved_pp, case.run_tp, case.run_pp) != (1, 1, 1, 1):
        return False
    if case.saved_stage == case.run_stage == 0:
        return case.saved_ep != case.run_ep
    zero12 = case.saved_stage in (1, 2) and case.run_stage in (1, 2)
    return zero12 and (case.saved_ep, case.saved_dp) != (case.run_ep, case.run_dp)


def converts_on_load(case: ResumeCase | None) -> bool:
    """Whether this load converts the checkpoint to the run's layout on the way in: an MoE checkpoint where
    :func:`moe_converts_on_load`; a dense one (``relayout.py``) where a row marked ``mended_on_load`` is broken,
    the optimizer state is loaded, it was saved with ZeRO-1 or 2 (the converter reads the ZeRO partitions; its
    ZeRO-3 output lacks the shapes a load needs), and the run has partitions to load a universal checkpoint into
    (ZeRO >= 1, or bf16; ZeRO-3 only at TP 1)."""
    if case is None or not case.optimizer_state:
        return False
    if case.saved_ep is not None:
        return moe_converts_on_load(case)
    if case.saved_stage not in (1, 2) or (case.run_stage < 1 and case.run_precision != "bf16"):
        return False  # ZeRO-3 sources: the universal converter writes flat tensors (relayout.py)
    if case.run_stage == 3 and case.run_tp > 1:
        return False  # DeepSpeed's ZeRO-3 universal loader reads whole tensors: no TP slices
    return any(rule.mended_on_load and rule.broken(case) for rule in RESUME_RULES)


def check_resume_compatibility(case: ResumeCase | None) -> None:
    """Raise the message of the first broken row of :data:`RESUME_RULES` (None: nothing to compare); where the
    load :func:`converts_on_load`, the rows it mends are not errors.

    Raises:
        ValueError: naming the checkpoint, what it was saved with, what the run uses and the fix.
    """
    if case is None:
        return
    converts = converts_on_load(case)
    for rule in RESUME_RULES:
        if rule.broken(case) and not (converts and rule.mended_on_load):
            raise ValueError(rule.message(case))


def zero_partitions(plan: RunPlan, ds_sequence_parallel_size: int) -> int:
    """The ranks ZeRO shards over (what the checkpoint's optimizer files are counted by): DP x CP x Ulysses SP,
    which is world / (TP x PP) as a checkpoint's meta records it (DeepSpeed shards over its sequence-data-parallel
    group; the pipeline engine over its "data" axis, DP x CP). CP and Ulysses are run-time layouts like DP: a
    checkpoint resumes at another CP size where this count is the same, or through ZeRO-0 / a universal one."""
    return plan.data_parallel_size * plan.context_parallel_size * ds_sequence_parallel_size


def resume_case(
    meta: dict[str, Any],
    ck: CheckpointConfig,
    plan: RunPlan,
    tag: str,
    *,
    ds_sequence_parallel_size: int,
    expert_parallel_size: int = 1,
) -> ResumeCase | None:
    """The :class:`ResumeCase` of loading ``tag`` (with ``meta``) into the run of ``ck`` and ``plan`` (its
    --ds-sequence-parallel-size: :func:`zero_partitions`; its --moe-expert-parallel-size); None for a universal
    load or a checkpoint that records no layout (nothing to compare)."""
    if ck.universal_checkpoint or "tensor_model_parallel_size" not in meta:
        return None
    tp, pp = int(meta["tensor_model_parallel_size"]), int(meta["pipeline_model_parallel_size"])
    weights_only = ck.finetune or bool(meta.get("weights_only", False))
    return ResumeCase(
        load_dir=str(ck.load),
        tag=tag,
        saved_tp=tp,
        saved_pp=pp,
        saved_dp=int(meta.get("world_size", plan.world_size)) // (tp * pp),
        saved_stage=saved_zero_stage(Path(ck.load or "") / tag, meta, default=plan.zero_stage),
        saved_precision=meta.get("precision"),
        run_tp=plan.tensor_model_parallel_size,
        run_pp=plan.pipeline_model_parallel_size,
        run_dp=zero_partitions(plan, ds_sequence_parallel_size),
        run_stage=plan.zero_stage,
        requested_stage=plan.requested_zero_stage,
        run_precision=plan.precision,
        weights_only=weights_only,
        optimizer_state=not (weights_only or ck.no_load_optim),
        saved_ep=int(meta["moe_expert_parallel_size"])
        if "moe_expert_parallel_size" in meta
        else None,
        run_ep=expert_parallel_size,
    )


def _check_tokenizer_matches(
    meta: dict[str, Any], ck: CheckpointConfig, data: DataConfig, tag: str, fingerprint: str | None
) -> None:
    """The run's tokenizer must encode like the checkpoint's: both fingerprints known and different is an error
    (a warning with --finetune, which may change tokenizers on purpose). Without fingerprints, a warning (not an
    error: e.g. HFTokenizer and GPT2BPETokenizer over GPT-2's files give the same ids) when the tokenizer type
    differs; a different vocabulary size is a shape error already."""
    recorded = meta.get("tokenizer") or {}
    saved_print = recorded.get("fingerprint")
    if saved_print and fingerprint and saved_print != fingerprint:
        files = [
            f"{flag} {value}"
            for flag, value in (
                ("--vocab-file", data.vocab_file),
                ("--merge-file", data.merge_file),
                ("--tokenizer-model", data.tokenizer_model),
            )
            if value
        ]
        was = [
            f"{key} {recorded[key]}"
            for key in ("vocab_file", "merge_file", "tokenizer_model")
            if key in recorded
        ]
        msg = (
            f"--load {ck.load} (tag {tag}) was trained with a tokenizer that encodes text into other ids "
            f"than this run's (--tokenizer-type {data.tokenizer_type}{', ' if files else ''}"
            f"{', '.join(files)}), so its embeddings would be read with the wrong tokens"
        )
        if not ck.finetune:
            raise ValueError(
                f"{msg}. Pass the tokenizer it was trained with (--tokenizer-type "
                f"{recorded.get('tokenizer_type')}{', ' if was else ''}{', '.join(was)}; the files must be "
                "unchanged), or start a new run from its weights with --finetune."
            )
        if global_rank() == 0:
            logger.warning("%s (--finetune: continuing on purpose?)", msg)
        return
    saved = recorded.get("tokenizer_type")
    now = data.tokenizer_type
    if saved and now and saved != now and global_rank() == 0:
        logger.warning(
            "--load %s (tag %s) was trained with --tokenizer-type %s; this run passes %s: make sure both give the "
            "same token ids",
            ck.load,
            tag,
            saved,
            now,
        )


def check_checkpoint_dirs(
    cfg: TridentConfig,
    plan: RunPlan | None = None,
    tokenizer_fingerprint: str | None = None,
    *,
    background_hashes: bool = False,
) -> PendingVerification | None:
    """Preflight (before any process group), identical on every rank.

    --save must be writable and must not hold another run's checkpoints; --load must be a directory (a missing
    one is an error unless it is the --save of an auto-resumed run); --load-tag, --finetune,
    --universal-checkpoint, --no-load-lr-state, --reset-iteration need --load, and --finetune / --skip-train
    need a checkpoint there. With the run's ``plan``, a checkpoint found in --load must match the model flags (at
    the plan's true vocabulary), the tokenizer (``tokenizer_fingerprint``, else its type), the
    --universal-checkpoint kind and the rows of :data:`RESUME_RULES` (layout, ZeRO stage, precision, DP size,
    MoE EP size). No checkpoint in an existing --load is fine otherwise (the run starts from scratch, with one
    log line).

    The files this rank will load are checked against the checksums recorded at save: sizes here, digests here
    too, or, with ``background_hashes``, on a thread whose :class:`PendingVerification` is returned (the caller
    joins it before the load; ``pretrain`` does, on every rank together).

    The one function here that takes the whole ``cfg``: the entry check reads five of its six sections
    (``checkpoint``, ``model``, ``data`` for the tokenizer, ``training.skip_train``,
    ``parallel.ds_sequence_parallel_size``) and hands each check below only what it reads.

    Raises:
        ValueError / FileNotFoundError: naming the flag, the problem and the fix.
    """
    ck = cfg.checkpoint
    if ck.save:
        if Path(ck.save).is_file():
            raise ValueError(f"--save {ck.save} is a file; give a directory.")
        check_save_dir(ck.save)
        _check_save_holds_no_other_run(ck)
    for flag, given in (
        ("--load-tag", ck.load_tag),
        ("--finetune", ck.finetune),
        ("--universal-checkpoint", ck.universal_checkpoint),
        ("--no-load-lr-state", ck.no_load_lr_state),
        ("--reset-iteration", ck.reset_iteration),
    ):
        if given and not ck.load:
            raise ValueError(f"{flag} was given without --load; add --load DIR.")
    if not ck.load:
        return None
    root = Path(ck.load)
    if root.is_file():
        raise ValueError(
            f"--load {ck.load} is a file; give the checkpoint directory (the --save of the run)."
        )
    auto_resume = bool(ck.save) and _same_dir(ck.load, ck.save)
    if not root.exists() and not auto_resume:
        raise FileNotFoundError(
            f"--load {ck.load} does not exist; check the path (a run that resumes itself passes the same "
            "directory to --save and --load)."
        )
    tag = find_checkpoint(ck.load, ck.load_tag, universal=ck.universal_checkpoint)
    if tag is None:
        wants = "--finetune" if ck.finetune else "--skip-train" if cfg.training.skip_train else None
        if wants:
            raise FileNotFoundError(
                f"{wants}: --load {ck.load} holds no checkpoint (no 'latest'); point --load at a --save "
                "directory of a run."
            )
        return None
    if plan is not None:
        model = dataclasses.replace(cfg.model, vocab_size=plan.true_vocab_size)
        meta = check_model_matches(ck.load, tag, model)
        check_universal_kind(meta, ck.universal_checkpoint, ck.load, tag)
        _check_tokenizer_matches(meta, ck, cfg.data, tag, tokenizer_fingerprint)
        sp = cfg.parallel.ds_sequence_parallel_size
        ep = cfg.parallel.moe_expert_parallel_size
        case = resume_case(
            meta, ck, plan, tag, ds_sequence_parallel_size=sp, expert_parallel_size=ep
        )
        check_resume_compatibility(case)
        _check_model_state_files(root / tag, meta)
        _check_universal_stage(ck, plan)
        if converts_on_load(case):
            return None  # rank 0 checks every file of the tag before it converts (relayout.py)
        return _verify_checkpoint_files(
            root / tag, meta, ck, plan, ds_sequence_parallel_size=sp, background=background_hashes
        )
    return None


def _check_universal_stage(ck: CheckpointConfig, plan: RunPlan) -> None:
    """DeepSpeed loads a universal checkpoint into a ZeRO (or bf16) optimizer's partitions; fp32/fp16 ZeRO-0 has
    none (DeepSpeed would fail deep inside its loader)."""
    if ck.universal_checkpoint and plan.zero_stage == 0 and plan.precision != "bf16":
        raise ValueError(
            f"--load {ck.load} --universal-checkpoint: DeepSpeed loads a universal checkpoint into the ZeRO "
            "optimizer's partitions, which --zero-stage 0 does not have; pass --zero-stage 1 (or 2)."
        )


def _verify_checkpoint_files(
    tag_dir: Path,
    meta: dict[str, Any],
    ck: CheckpointConfig,
    plan: RunPlan,
    *,
    ds_sequence_parallel_size: int,
    background: bool = False,
) -> PendingVerification | None:
    """The files this rank will load have the sizes and SHA-256 recorded at save (``checksums.py``); a checkpoint
    saved before checksums were recorded gets one warning and a structural check of its archives."""
    weights_only = ck.finetune or bool(meta.get("weights_only", False))
    names = files_to_verify(
        meta,
        rank=global_rank(),
        run_tp=plan.tensor_model_parallel_size,
        run_pp=plan.pipeline_model_parallel_size,
        run_dp=zero_partitions(plan, ds_sequence_parallel_size),
        optimizer_state=not (weights_only or ck.no_load_optim),
    )
    if names:
        if background and ck.verify_checkpoint_checksums:
            return start_verification(tag_dir, meta, names)
        verify_checkpoint_files(tag_dir, meta, names, hashes=ck.verify_checkpoint_checksums)
        return None
    if global_rank() == 0:
        logger.warning(
            "--load %s (tag %s) records no checksums (saved before Trident recorded them): its files are loaded "
            "unverified",
            ck.load,
            tag_dir.name,
        )
    check_readable_archives(tag_dir, sorted(p.name for p in tag_dir.glob("*.pt")))
    return None


def _check_model_state_files(tag_dir: Path, meta: dict[str, Any]) -> None:
    """Every model-parallel rank's DeepSpeed model-state file is there (a copy that lost one would otherwise fail
    inside DeepSpeed with a bare assertion on some ranks)."""
    if meta.get("universal") or "tensor_model_parallel_size" not in meta:
        return
    mp = int(meta["tensor_model_parallel_size"]) * int(meta["pipeline_model_parallel_size"])
    missing = [
        f"mp_rank_{r:02d}_model_states.pt"
        for r in range(mp)
        if not (tag_dir / f"mp_rank_{r:02d}_model_states.pt").is_file()
        and not any(tag_dir.glob(f"zero_pp_rank_*_mp_rank_{r:02d}_model_states.pt"))
    ]
    if missing:
        raise FileNotFoundError(
            f"--load: {tag_dir} lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
            f"(a checkpoint of {mp} model-parallel ranks); copy the whole checkpoint directory."
        )
