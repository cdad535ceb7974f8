"""Write a Trident checkpoint at any TP/PP from full (TP = 1) weights, through a real DeepSpeed engine.

``write_trident_checkpoint`` spawns ``TP x PP`` local ranks; each builds the model at the target layout
(``GPTModel`` or ``GPTModelPipe``), loads its shard BEFORE ``deepspeed.initialize`` (so ZeRO's fp32 master copies
hold these weights) and saves through ``DeepSpeedCheckpointer`` at iteration 0, marked ``weights_only`` (training
loads it like --finetune). Used by the HF importer and by :func:`reshard_checkpoint` (offline TP/PP change).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.model_args import write_model_args
from megatron.checkpointing.pointers import ITERATION_FILE, LATEST_FILE
from megatron.checkpointing.readers import (
    Progress,
    build_megatron_model,
    no_progress,
    read_checkpoint_config,
    read_checkpoint_weights,
)
from megatron.config import ModelConfig
from megatron.config.moe_rules import check_deepspeed_saves_every_rank
from megatron.config.rules import check_head_layout, check_tensor_parallel_split
from megatron.conversion.hf_mixtral import verification_config
from megatron.conversion.output_dirs import check_new_save_dir
from megatron.conversion.verify import (
    LogitComparison,
    Verification,
    compare_logits,
    fixed_prompts,
    megatron_logits_fn,
)
from megatron.deepspeed_internals import check_deepspeed_version
from megatron.launch.rendezvous import ensure_rendezvous_env, world_size_from_env
from megatron.launch.spawn import spawn_local_ranks
from megatron.layout.experts import (
    check_expert_parallel,
    local_experts,
    moe_partition,
)
from megatron.layout.vocab import pad_vocab_for_tp

logger = logging.getLogger(__name__)

Verify = Callable[[Path], LogitComparison]
"""``verify(written_dir)``: the comparison of the checkpoint written in ``written_dir`` with its source."""


@dataclasses.dataclass(frozen=True)
class TargetLayout:
    """The parallel layout a converter writes a checkpoint for: ``tp * pp * ep`` ranks write it (data-parallel
    size ``ep``)."""

    tp: int = 1
    """Tensor-parallel size (``--tp``)."""
    pp: int = 1
    """Pipeline-parallel size (``--pp``)."""
    ep: int = 1
    """Expert-parallel size of an MoE model's experts (``--ep``); 1 for a dense model."""


def _rank_writer(
    full_path: str,
    model: dict[str, Any],
    tp: int,
    pp: int,
    out_dir: str,
    meta: dict[str, Any],
    ep: int = 1,
) -> None:
    """One rank of the import: model at the target layout, its shard, DeepSpeed engine, save (spawned).

    With MoE layers the world is ``tp * pp * ep`` (data-parallel size ``ep``): each rank loads its EP rank's
    experts (``megatron.layout.experts.local_experts``) and the engine writes DeepSpeed's expert files.
    """
    from safetensors.torch import load_file

    from megatron import mpu
    from megatron.checkpointing.engine import DeepSpeedCheckpointer
    from megatron.checkpointing.meta import tokenizer_record
    from megatron.config import RunPlan, parse_args
    from megatron.layout.names import pipe_to_megatron_name
    from megatron.layout.tensor_parallel import shard_state_dict
    from megatron.training import initialize
    from megatron.training.ds_config import build_ds_config
    from megatron.training.lr_scheduler import build_lr_scheduler
    from megatron.training.model_setup import build_engine, build_model
    from megatron.training.state import TrainState

    model_cfg = ModelConfig(**model)
    moe = model_cfg.moe.is_moe(model_cfg.num_layers)
    if moe and pp > 1:
        # ZeRO-1 below: DeepSpeed's ZeRO needs the experts in parameter groups of their own.
        model_cfg = dataclasses.replace(
            model_cfg, moe=dataclasses.replace(model_cfg.moe, create_moe_param_group=True)
        )
    argv = [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--micro-batch-size", "1", "--train-iters", "1", "--mock-data", "--save", out_dir,
        "--log-level", "WARNING",
        *(["--zero-stage", "1"] if pp > 1 else []),
        *(["--moe-expert-parallel-size", str(ep)] if moe else []),
    ]  # fmt: skip
    cfg = dataclasses.replace(parse_args(argv), model=model_cfg)
    ensure_rendezvous_env(cfg.parallel.local_rank)
    plan = RunPlan.build(
        cfg,
        world_size=world_size_from_env(),
        device_type=initialize.run_device_type(cfg.parallel),
        true_vocab=model_cfg.vocab_size,
    )
    run = initialize.init_distributed(cfg.parallel)
    try:
        initialize.set_seeds(cfg.training.seed, run.state, device_type=run.device.type)
        module = build_model(cfg.model, cfg.parallel, plan, run, seed=cfg.training.seed)
        full = load_file(full_path)
        partition = moe_partition(model_cfg, expert_tensor_parallel=False) if moe else None
        tp_rank = run.state.get_tensor_model_parallel_rank()
        shard = shard_state_dict(full, model_cfg, tp, tp_rank, partition=partition)
        if moe:
            shard = local_experts(
                shard, model_cfg, ep=ep, ep_rank=_expert_parallel_rank(cfg, run.state)
            )
        own = module.state_dict()
        new = {
            k: shard[pipe_to_megatron_name(k, model_cfg.num_layers) if plan.pipeline_engine else k]
            for k in own
        }
        module.load_state_dict(
            new, strict=True
        )  # before deepspeed.initialize: ZeRO's masters copy it
        ds_config = build_ds_config(cfg, plan)
        bundle = build_engine(
            cfg.model, cfg.training, cfg.parallel, plan, ds_config, run, model=module
        )
        scheduler = build_lr_scheduler(
            cfg.training, plan.global_batch_size, bundle.client_optimizer
        )
        ckpt = DeepSpeedCheckpointer(
            cfg.checkpoint,
            plan,
            model=cfg.model,
            tokenizer=tokenizer_record(cfg.data),
            tensor_model_parallel_rank=tp_rank,
        )
        ckpt.extra_meta = {"weights_only": True, **meta}
        ckpt.save(bundle.engine, scheduler, TrainState())
    finally:
        mpu.destroy_model_parallel()


def _expert_parallel_rank(cfg: Any, state: Any) -> int:
    """This rank's index in its expert-parallel group (the experts it holds), as the model places them."""
    import torch.distributed as dist

    from megatron.mpu.expert_parallel import expert_parallel_rank

    return expert_parallel_rank(
        dist.get_rank(),
        world_size=dist.get_world_size(),
        tensor_model_parallel_size=state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=state.get_pipeline_model_parallel_world_size(),
        expert_parallel_size=cfg.parallel.moe_expert_parallel_size,
        expert_tensor_parallel=cfg.parallel.enable_expert_tensor_parallelism,
    )


class Interrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT) arrived while a conversion was writing."""


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """While inside: SIGTERM raises :class:`Interrupted` like SIGINT raises ``KeyboardInterrupt``, so ``finally``
    blocks and context managers clean up (a no-op outside the main thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_target_layout(cfg: ModelConfig, layout: TargetLayout) -> None:
    """The model of ``cfg`` can be split over ``layout.tp`` x ``layout.pp`` ranks and its experts over
    ``layout.ep`` (the rules ``GPTModel`` enforces).

    Raises:
        ValueError: naming --tp / --pp / --ep, the model's sizes and the values that would work.
    """
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    if tp < 1 or pp < 1:
        raise ValueError(f"--tp ({tp}) and --pp ({pp}) must be >= 1.")
    check_expert_parallel(cfg, ep)
    if cfg.moe.is_moe(cfg.num_layers):
        check_deepspeed_saves_every_rank(tp, ep)
    if cfg.num_layers < pp:
        raise ValueError(
            f"--pp ({pp}) exceeds the model's {cfg.num_layers} layers; use --pp <= that."
        )
    check_head_layout(cfg)
    check_tensor_parallel_split(cfg, tp, tp_flag="--tp")


def write_trident_checkpoint(
    full: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | Path,
    *,
    layout: TargetLayout,
    record: dict[str, Any],
    timeout: float = 900.0,
    scratch_beside: Path | None = None,
) -> None:
    """Save ``full`` (Megatron names, any vocab padding; global expert ids) as a Trident checkpoint for
    ``layout.tp`` x ``layout.pp`` ranks, the experts of MoE layers split over ``layout.ep`` ranks
    (``tp * pp * ep`` ranks are spawned, data-parallel size ``ep``; the experts are held whole on every TP rank).

    ``record`` is merged into ``trident_meta.json`` (:meth:`StagedWrite.record`: ``converted_from``, ``tokenizer``,
    ``hf_model_type``).
    The model's flags go in ``out_dir/model_args.sh`` (``megatron.checkpointing.model_args``).
    The temporary full-weights file goes in ``.<name>.full-weights-*`` beside ``scratch_beside`` (default:
    ``out_dir``; the staged writer names --save, whose staging directory this is).

    Raises:
        ValueError: (before any process is spawned) ``out_dir`` is not a new or empty directory
            (:func:`check_new_save_dir`), or the model does not split over ``layout``
            (:func:`check_target_layout`).
    """
    from safetensors.torch import save_file

    check_deepspeed_version()  # here, not in each spawned rank: one line instead of a rank's traceback
    check_new_save_dir(out_dir)
    check_target_layout(cfg, layout)
    padded = pad_vocab_for_tp(full, cfg, layout.tp)
    out = Path(scratch_beside or out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Beside --save (same file system, sized for the output; not a small system /tmp), removed on any exit:
    # SIGINT and SIGTERM raise here so the context manager's cleanup runs.
    with (
        interrupts_raise(),
        tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.full-weights-") as tmp,
    ):
        path = str(Path(tmp) / "full.safetensors")
        save_file({k: v.contiguous() for k, v in padded.items()}, path)
        spawn_local_ranks(
            _rank_writer,
            layout.tp * layout.pp * layout.ep,
            path,
            dataclasses.asdict(cfg),
            layout.tp,
            layout.pp,
            str(out_dir),
            record,
            layout.ep,
            init_process_group=False,
            timeout=timeout,
        )
    # The flags of the model just saved, beside 'latest' (published with it).
    write_model_args(out_dir)


def unverified_dir(save: str | Path) -> Path:
    """Where a conversion whose verification failed is kept for inspection: ``<save>.unverified`` beside --save
    (never --save itself, so no run can load it by accident)."""
    out = Path(save).absolute()
    return out.with_name(f"{out.name}.unverified")


def _publish(staging: Path, save: Path) -> None:
    """Move a verified checkpoint from ``staging`` into ``save``: the tag directories first, the pointers
    (``latest_checkpointed_iteration.txt``, then ``latest``) last, each by ``os.replace`` on one file system, so
    ``latest`` appears only once everything it names is in place."""
    save.mkdir(parents=True, exist_ok=True)
    pointers = (ITERATION_FILE, LATEST_FILE)
    for entry in sorted(p for p in staging.iterdir() if p.name not in pointers):
        os.replace(entry, save / entry.name)
    for name in pointers:
        if (staging / name).exists():
            os.replace(staging / name, save / name)


def _keep_unverified(staging: Path, save: Path) -> Path:
    """Move the staged checkpoint to :func:`unverified_dir` (replacing an earlier one); returns its path."""
    failed = unverified_dir(save)
    shutil.rmtree(failed, ignore_errors=True)
    os.replace(staging, failed)
    return failed


@dataclasses.dataclass(frozen=True)
class StagedWrite:
    """What :func:`write_verified_checkpoint` writes: the weights, their model and where they came from."""

    full: dict[str, torch.Tensor]
    """Full (TP = 1) Megatron state dict (any vocab padding; global expert ids)."""
    cfg: ModelConfig
    """The model of ``full``."""
    source: str
    """Recorded in ``trident_meta.json`` as ``converted_from``."""
    tokenizer: dict[str, str] | None = None
    """Recorded in ``trident_meta.json`` (``megatron.tokenizer.info.tokenizer_info``)."""
    hf_model_type: str | None = None
    """Recorded in ``trident_meta.json``: the HF family imported (``llama``, ``qwen2``, ...), which the HF export
    writes back (``hf_features.export_family``)."""

    def record(self) -> dict[str, Any]:
        """What ``trident_meta.json`` records of the source."""
        out: dict[str, Any] = {"converted_from": self.source}
        if self.tokenizer:
            out["tokenizer"] = self.tokenizer
        if self.hf_model_type:
            out["hf_model_type"] = self.hf_model_type
        return out


def write_verified_checkpoint(
    what: StagedWrite,
    save: str | Path,
    *,
    layout: TargetLayout,
    verify: Verify | None,
    tolerance: float | None = None,
    say: Callable[[str], None] = logger.warning,
) -> LogitComparison | None:
    """:func:`write_trident_checkpoint` into a staging directory beside ``save``, ``verify`` it there, and move it
    into ``save`` (pointers last) only when it passes ``tolerance`` (or when ``verify`` is None).

    A comparison over ``tolerance`` moves the checkpoint to ``<save>.unverified`` instead (:func:`unverified_dir`;
    ``say`` tells where) and returns the comparison; ``verify`` raising ``ValueError`` does the same and re-raises
    with that place named. Either way ``save`` is left as it was: no tag, no ``latest``. An error, Ctrl-C or
    SIGTERM while writing removes the staging directory.
    """
    out = Path(save).absolute()
    check_new_save_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with interrupts_raise():
        staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.staging-"))
        try:
            return _write_and_verify(what, staging, out, layout, verify, tolerance, say)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _write_and_verify(
    what: StagedWrite,
    staging: Path,
    out: Path,
    layout: TargetLayout,
    verify: Verify | None,
    tolerance: float | None,
    say: Callable[[str], None],
) -> LogitComparison | None:
    write_trident_checkpoint(
        what.full,
        what.cfg,
        staging,
        layout=layout,
        record=what.record(),
        scratch_beside=out,
    )
    try:
        result = None if verify is None else verify(staging)
    except ValueError as err:
        failed = _keep_unverified(staging, out)
        raise ValueError(
            f"{err} The converted checkpoint was NOT written to {out}; it is kept unverified in {failed} "
            "(do not train from it)."
        ) from None
    if result is not None and tolerance is not None and not result.passes(tolerance):
        failed = _keep_unverified(staging, out)
        say(
            f"verification FAILED: the checkpoint was NOT written to {out} (left for inspection in {failed}; "
            "do not train from it)"
        )
        return result
    _publish(staging, out)
    return result


def reshard_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    layout: TargetLayout,
    tag: str | None = None,
    verification: Verification | None = Verification(),
    progress: Progress = no_progress,
    verify_checksums: bool = True,
    say: Callable[[str], None] = logger.warning,
) -> LogitComparison | None:
    """Offline (TP, PP) -> (``layout.tp``, ``layout.pp``) for the weights of a Trident checkpoint (iteration 0,
    weights only); an MoE model's experts (read from any EP layout) are written over ``layout.ep`` expert-parallel
    ranks. Written and verified in a staging directory, moved into ``dst`` only when verification passes
    (:func:`write_verified_checkpoint`). ``verify_checksums=False`` compares the source files' sizes only
    (``--no-verify-checkpoint-checksums``).

    For resuming WITH optimizer state at another layout use the universal checkpoint (``universal.py``).

    Returns:
        Source vs written checkpoint logits (both run in a TP = 1 ``GPTModel``), None without ``verification``.

    Raises:
        ValueError / FileNotFoundError: ``dst`` is ``src``, a file or holds checkpoints; the model does not split
            over ``layout``; the source is unreadable. All before any rank is spawned.
    """
    found, src_cfg, _ = read_checkpoint_config(src, tag)
    check_target_layout(src_cfg, layout)
    check_new_save_dir(dst, load=src)
    full, cfg, meta = read_checkpoint_weights(
        src, found, progress, verify_checksums=verify_checksums
    )

    result = write_verified_checkpoint(
        StagedWrite(
            full,
            cfg,
            source=str(src),
            tokenizer=meta.get("tokenizer"),
            hf_model_type=meta.get("hf_model_type"),
        ),
        dst,
        layout=layout,
        verify=None if verification is None else _same_logits_as(full, cfg, verification.steps),
        tolerance=None if verification is None else verification.tolerance,
        say=say,
    )
    progress("writing", 1, 1)
    return result


def _same_logits_as(full: dict[str, torch.Tensor], cfg: ModelConfig, steps: int) -> Verify:
    """A :data:`Verify` comparing a written checkpoint with the weights ``full`` it was written from, both run in
    a TP = 1 ``GPTModel`` with the reference kernels (for MoE HF Mixtral's routing: ``verification_config``)."""

    def verify(written: Path) -> LogitComparison:
        back, back_cfg, _ = read_checkpoint_weights(written)
        a = build_megatron_model(full, verification_config(cfg))
        b = build_megatron_model(back, verification_config(back_cfg))
        max_pos = cfg.max_position_embeddings or cfg.seq_length
        prompts, n = fixed_prompts(cfg.vocab_size, max_pos, steps)
        with torch.no_grad():
            return compare_logits(
                megatron_logits_fn(a), megatron_logits_fn(b), prompts, n, vocab_size=cfg.vocab_size
            )

    return verify
