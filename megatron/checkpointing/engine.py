"""Training checkpoints through the DeepSpeed engine: the save protocol and the load (``CheckpointHooks``).

Files of a tag: DeepSpeed's (``mp_rank_XX_model_states.pt``, ``zero_*_optim_states.pt``, pipeline layer files),
``rng_state_rank{R:05d}.safetensors`` per rank (``rng.py``) and ``trident_meta.json`` (``meta.py``), written last,
holding the SHA-256 of every other file, computed as it was written (``checksums.py``).

Save protocol (crash safety): every rank writes its RNG file, then ``engine.save_checkpoint(tag=...,
save_latest=False)`` (which ends with a barrier over all ranks), then rank 0 writes ``trident_meta.json`` and moves
both pointers with temp file + ``os.replace`` (``pointers.py``). A process killed at any point leaves the pointers at
the previous complete checkpoint; a tag directory without ``trident_meta.json`` is incomplete and never loaded.

Client state saved with the engine (``mp_rank_XX_model_states.pt``): ``iteration``, ``consumed_train_samples``,
``consumed_train_tokens``, ``consumed_valid_samples``, ``consumed_valid_tokens``, ``skipped_iterations``,
``lr_scheduler`` (``OptimizerParamScheduler.state_dict()``), ``trident_model_config`` and DeepSpeed's
``universal_checkpoint_info`` (``megatron/layout/universal_info.py``).

The start-up checks that make a load safe run before any process group exists: :mod:`megatron.checkpointing.rules`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

from megatron.checkpointing.checksums import (
    CHECKSUMS_KEY,
    ChecksumRecorder,
    merge_sidecars,
    remove_sidecars,
)
from megatron.checkpointing.meta import (
    META_FILE,
    META_VERSION,
    check_model_matches,
    check_universal_kind,
)
from megatron.checkpointing.pointers import (
    ITERATION_FILE,
    LATEST_FILE,
    atomic_write,
    find_checkpoint,
    retreat_latest,
    tag_for_iteration,
)
from megatron.checkpointing.rng import load_rng_file, rng_file_name, save_rng_file
from megatron.checkpointing.weights_only import (
    assign_weights,
    needs_own_weight_loader,
    read_tp_rank_weights,
    refresh_master_weights,
    saved_zero_stage,
)
from megatron.checkpointing.zero3 import read_zero3_client_state
from megatron.config import CheckpointConfig, ModelConfig, RunPlan
from megatron.deepspeed_internals import checkpoint_saves_through
from megatron.layout.universal_info import universal_checkpoint_info, used_patterns
from megatron.log import global_rank
from megatron.mpu.mappings import all_reduce_max_, communication_device

logger = logging.getLogger(__name__)


class DeepSpeedCheckpointer:
    """``CheckpointHooks`` implementation over ``engine.save_checkpoint`` / ``engine.load_checkpoint``.

    Args:
        checkpoint: the checkpoint flags (--save, --load and how to resume).
        plan: the run plan (true and padded vocabulary, layout, world size, precision: all recorded in the meta).
        model: the model flags (the shape check at load; saved at the plan's true vocabulary).
        tokenizer: the meta's ``"tokenizer"`` record of the run (``meta.tokenizer_record``: the tokenizer flags
            and its encoding fingerprint, checked when a run loads the checkpoint); None without a tokenizer.
        tensor_model_parallel_rank: this rank's TP rank (which shard ``weights_only.py`` reads).
        expert_parallel_size: --moe-expert-parallel-size, recorded in the meta of an MoE model (``rules.py``
            refuses to load its optimizer state at another size).
        record_checksums: False saves DeepSpeed's files through its own ``torch.save``, recording no digests (as
            an engine that cannot be routed does; a load then checks their archives only). For measuring what
            the checksums cost (``benchmarks/bench_checkpoint_checksums.py``); runs keep the default.
    """

    def __init__(
        self,
        checkpoint: CheckpointConfig,
        plan: RunPlan,
        *,
        model: ModelConfig,
        tokenizer: dict[str, str] | None,
        tensor_model_parallel_rank: int,
        expert_parallel_size: int = 1,
        record_checksums: bool = True,
    ) -> None:
        self.checkpoint = checkpoint
        self.record_checksums = record_checksums
        self.plan = plan
        self.tokenizer = tokenizer
        self.tensor_model_parallel_rank = tensor_model_parallel_rank
        self.expert_parallel_size = expert_parallel_size
        self.model = dataclasses.replace(model, vocab_size=plan.true_vocab_size)
        self.last_save_seconds: float | None = None
        self.last_load_seconds: float | None = None
        self._pending_rng: Path | None = None
        self.extra_meta: dict[str, Any] = {}
        """Merged into ``trident_meta.json`` (the HF importer sets ``{"weights_only": True, ...}``)."""

    # ------------------------------------------------------------------ save
    def save(self, engine: Any, scheduler: Any, state: Any) -> None:
        """Write iteration ``state.iteration`` to --save, then move the pointers (see the module docstring).

        Raises:
            CheckpointSaveError: a file could not be written (disk full, quota, permissions): one line naming the
                file and the checkpoint 'latest' still points to.
        """
        save_dir = Path(self.checkpoint.save or "")
        try:
            self._save(engine, scheduler, state)
        except OSError as err:
            raise CheckpointSaveError(save_failed_message(save_dir, state.iteration, err)) from None
        except RuntimeError as err:  # torch.save wraps the OSError of a failed write
            if "write" not in str(err).lower():
                raise
            raise CheckpointSaveError(save_failed_message(save_dir, state.iteration, err)) from None

    def _save(self, engine: Any, scheduler: Any, state: Any) -> None:
        start = time.perf_counter()
        save_dir = Path(self.checkpoint.save or "")
        tag = tag_for_iteration(state.iteration)
        tag_dir = save_dir / tag
        tag_dir.mkdir(parents=True, exist_ok=True)
        marker = tag_dir / META_FILE
        if global_rank() == 0:
            retreat_latest(save_dir, tag)
            if marker.exists():
                marker.unlink()  # re-saving an iteration: incomplete until this save finishes
            remove_sidecars(tag_dir)  # records of an earlier, failed save of this tag
        _wait_for_all_ranks()  # no rank overwrites files of the tag before 'latest' left it
        recorder = ChecksumRecorder(tag_dir)
        save_rng_file(tag_dir / rng_file_name(global_rank()), recorder.write_bytes)
        seq = self.model.seq_length
        client_state = {
            "iteration": int(state.iteration),
            "consumed_train_samples": int(state.consumed_train_samples),
            "consumed_train_tokens": int(state.consumed_train_tokens),
            "consumed_valid_samples": int(state.consumed_valid_samples),
            "consumed_valid_tokens": int(state.consumed_valid_samples) * seq,
            "skipped_iterations": int(state.skipped_iterations),
            "lr_scheduler": scheduler.state_dict(),
            "trident_model_config": dataclasses.asdict(self.model),
        }
        universal_info = used_patterns(
            universal_checkpoint_info(self.model, self.plan.padded_vocab_size),
            [name for name, _ in engine.module.named_parameters()],
        )
        if getattr(engine, "has_moe_layers", False):
            # DeepSpeed's MoE save refuses the key in client_state ("reserved checkpoint keys") and saves the
            # module attribute of that name under it instead: the same place in mp_rank_XX_model_states.pt.
            setattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, universal_info)
        else:
            client_state[UNIVERSAL_CHECKPOINT_INFO] = universal_info
        # Ends with a barrier over all ranks: after it, every rank's files are written.
        route = (
            checkpoint_saves_through(engine, recorder.torch_save)
            if self.record_checksums
            else contextlib.nullcontext(False)
        )
        with route as hashed:
            engine.save_checkpoint(
                str(save_dir), tag=tag, client_state=client_state, save_latest=False
            )
        if hashed:
            recorder.write_sidecar(global_rank())
            _wait_for_all_ranks()  # every rank's record is on disk before rank 0 merges them
        if global_rank() == 0:
            plan = self.plan
            meta = {
                "version": META_VERSION,
                "iteration": int(state.iteration),
                "consumed_train_samples": int(state.consumed_train_samples),
                "consumed_valid_samples": int(state.consumed_valid_samples),
                "model": dataclasses.asdict(self.model),
                "padded_vocab_size": plan.padded_vocab_size,
                "tensor_model_parallel_size": plan.tensor_model_parallel_size,
                "pipeline_model_parallel_size": plan.pipeline_model_parallel_size,
                "world_size": plan.world_size,
                "zero_stage": int(engine.zero_optimization_stage()),
                "precision": plan.precision,
                **(
                    {"moe_expert_parallel_size": self.expert_parallel_size}
                    if getattr(engine, "has_moe_layers", False)
                    else {}
                ),
                **({"tokenizer": self.tokenizer} if self.tokenizer else {}),
                **self.extra_meta,
                **({CHECKSUMS_KEY: merge_sidecars(tag_dir)} if hashed else {}),
            }
            atomic_write(marker, json.dumps(meta, indent=1, sort_keys=True) + "\n")
            remove_sidecars(tag_dir)
            atomic_write(save_dir / LATEST_FILE, tag)
            atomic_write(save_dir / ITERATION_FILE, f"{state.iteration}\n")
        _wait_for_all_ranks()  # nobody reads the pointers (e.g. a relaunch's preflight) before they moved
        self.last_save_seconds = time.perf_counter() - start
        if global_rank() == 0:
            logger.info(
                "saved checkpoint %s at iteration %d in %.2f s",
                tag_dir,
                state.iteration,
                self.last_save_seconds,
            )

    # ------------------------------------------------------------------ load
    def _own_weight_loader(
        self, engine: Any, meta: dict[str, Any], tag_dir: Path, optimizer_state: bool
    ) -> bool:
        """Whether the weights must be read by ``weights_only.py`` instead of DeepSpeed's loader."""
        if int(meta.get("pipeline_model_parallel_size", 1)) != 1:
            return False
        return needs_own_weight_loader(
            saved_stage=saved_zero_stage(tag_dir, meta),
            run_stage=int(engine.zero_optimization_stage()),
            optimizer_state=optimizer_state,
        )

    def restore_rng(self) -> None:
        """Apply the RNG states found by :meth:`load` (pretrain calls it after building the data iterators)."""
        if self._pending_rng is not None:
            load_rng_file(self._pending_rng)
            self._pending_rng = None

    def load(self, engine: Any, scheduler: Any, state: Any) -> None:
        """Resume from --load (nothing there: start from scratch with one log line)."""
        ck = self.checkpoint
        load_dir = ck.load or ""
        tag = self._find_tag(load_dir)
        if tag is None:
            return
        start = time.perf_counter()
        meta = check_model_matches(load_dir, tag, self.model)
        check_universal_kind(meta, ck.universal_checkpoint, load_dir, tag)
        # A converted (e.g. HF-imported) checkpoint carries weights only: no schedule/optimizer progress to keep.
        finetune = ck.finetune or bool(meta.get("weights_only", False))
        tag_dir = Path(load_dir) / tag
        client = self._load_engine_states(engine, meta, load_dir, tag, finetune)
        if not finetune:  # weights only: iteration 0, the schedule from its start, fresh RNG states
            self._restore_progress(engine, state, client)
            self._restore_lr_schedule(scheduler, state, client)
            self._find_rng_file(meta, tag_dir)
        self.last_load_seconds = time.perf_counter() - start
        if global_rank() == 0:
            logger.info(
                "loaded checkpoint %s (iteration %d%s) in %.2f s",
                tag_dir,
                int(client.get("iteration", 0)),
                ", --finetune: weights only, iteration 0" if finetune else "",
                self.last_load_seconds,
            )

    def _find_tag(self, load_dir: str) -> str | None:
        """The tag to load; None (one log line) when --load holds none and the run may start from scratch."""
        ck = self.checkpoint
        tag = find_checkpoint(load_dir, ck.load_tag, universal=ck.universal_checkpoint)
        if tag is None:
            # Every rank sees the same directory, so all ranks stop here together.
            if ck.exit_on_missing_checkpoint:
                raise FileNotFoundError(
                    f"--load {load_dir} holds no checkpoint and --exit-on-missing-checkpoint is set; fix the "
                    "path, or drop the flag to start from scratch"
                )
            if global_rank() == 0:
                logger.info("no checkpoint in --load %s: starting from scratch", load_dir)
        return tag

    def _load_engine_states(
        self, engine: Any, meta: dict[str, Any], load_dir: str, tag: str, finetune: bool
    ) -> dict[str, Any]:
        """Weights (and the optimizer state unless weights only or --no-load-optim) into ``engine``; returns the
        client state saved with them."""
        ck = self.checkpoint
        load_optim = not (ck.no_load_optim or finetune)
        tag_dir = Path(load_dir) / tag
        client: dict[str, Any] | None
        own_loader = not ck.universal_checkpoint and self._own_weight_loader(
            engine, meta, tag_dir, load_optim
        )
        if own_loader:
            tp_rank = self.tensor_model_parallel_rank
            weights = read_tp_rank_weights(tag_dir, meta, tp_rank)
            assign_weights(engine, weights, f"--load {load_dir} (tag {tag})")
            if finetune:
                client = {"iteration": int(meta.get("iteration", 0))}
            else:  # --no-load-optim of a ZeRO-3 checkpoint (_check_layout: the run is ZeRO-3 too)
                client = read_zero3_client_state(tag_dir, tp_rank)
        else:
            _, client = engine.load_checkpoint(
                load_dir,
                tag=tag,
                load_module_strict=True,
                load_optimizer_states=load_optim,
                load_lr_scheduler_states=False,
                load_module_only=finetune,
            )
            if not load_optim:
                refresh_master_weights(engine)
        if client is None:
            raise RuntimeError(f"DeepSpeed could not load {tag_dir}.")
        return client

    def _restore_progress(self, engine: Any, state: Any, client: dict[str, Any]) -> None:
        """Iteration and consumed samples/tokens from ``client`` (--reset-iteration: all restart at 0)."""
        if self.checkpoint.reset_iteration:
            # --reset-iteration (Megatron-DeepSpeed's load_checkpoint): progress restarts at 0, so the data
            # order restarts at its first sample; the engine's step count follows, as theirs does.
            engine.global_steps = 0
            engine.global_samples = 0
            return
        state.iteration = int(client["iteration"])
        state.consumed_train_samples = int(client["consumed_train_samples"])
        state.consumed_valid_samples = int(client.get("consumed_valid_samples", 0))
        state.skipped_iterations = int(client.get("skipped_iterations", 0))
        # Before the token count was kept, every iteration had --seq-length tokens per sample.
        state.consumed_train_tokens = int(
            client.get(
                "consumed_train_tokens",
                state.consumed_train_samples * self.model.seq_length,
            )
        )

    def _restore_lr_schedule(self, scheduler: Any, state: Any, client: dict[str, Any]) -> None:
        """The LR schedule's state from ``client`` (unless --no-load-lr-state)."""
        if self.checkpoint.no_load_lr_state:
            return
        scheduler.load_state_dict(client["lr_scheduler"])
        if "num_tokens" not in client["lr_scheduler"]:
            scheduler.step(0, tokens=state.consumed_train_tokens)

    def _find_rng_file(self, meta: dict[str, Any], tag_dir: Path) -> None:
        """Remember this rank's RNG file for :meth:`restore_rng` (unless --no-load-rng or another layout)."""
        if self.checkpoint.no_load_rng:
            return
        same_world = (
            meta.get("world_size") == self.plan.world_size
            and not self.checkpoint.universal_checkpoint
        )
        if same_world:
            self._pending_rng = tag_dir / rng_file_name(global_rank())
            if not self._pending_rng.is_file():
                load_rng_file(self._pending_rng)  # raises the missing-file error now
        elif global_rank() == 0:
            logger.info("checkpoint saved on another layout: fresh RNG states")


class CheckpointSaveError(RuntimeError):
    """A checkpoint file could not be written; 'latest' still names the last complete checkpoint."""


def save_failed_message(save_dir: Path, iteration: int, err: BaseException) -> str:
    """One line: which file of which save failed, why, and where 'latest' points (it was never moved)."""
    latest = save_dir / LATEST_FILE
    good = latest.read_text(encoding="utf-8").strip() if latest.is_file() else None
    where = (
        f"'latest' still points to {good}, the last good checkpoint"
        if good
        else f"{save_dir} has no complete checkpoint ('latest' was never written)"
    )
    what = getattr(err, "filename", None)
    reason = getattr(err, "strerror", None) or str(err).splitlines()[0]
    return (
        f"saving checkpoint {tag_for_iteration(iteration)} to --save {save_dir} failed"
        f"{f' writing {what}' if what else ''}: {reason}; {where}. Free space (or fix the directory) and "
        "relaunch to resume from it."
    )


def _wait_for_all_ranks() -> None:
    """A barrier over every rank (an all-reduce of one element through ``mpu.mappings``)."""
    if dist.is_available() and dist.is_initialized():
        world = dist.group.WORLD
        all_reduce_max_(torch.zeros(1, device=communication_device(world)), group=world)
