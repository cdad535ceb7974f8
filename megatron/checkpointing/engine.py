"""Training checkpoints through the DeepSpeed engine: the save protocol and the load (``CheckpointHooks``).

Files of a tag: DeepSpeed's (``mp_rank_XX_model_states.pt``, ``zero_*_optim_states.pt``, pipeline layer files),
``rng_state_rank{R:05d}.safetensors`` per rank (``rng.py``) and ``trident_meta.json`` (``meta.py``), written last,
holding the SHA-256 of every other file, computed as it was written (``checksums.py``).

Save protocol (crash safety): every rank writes its RNG file, then ``engine.save_checkpoint(tag=...,
save_latest=False)`` (which ends with a barrier over all ranks), then rank 0 writes ``trident_meta.json`` and moves
both pointers with temp file + ``os.replace`` (``pointers.py``). A process killed at any point leaves the pointers at
the previous complete checkpoint; a tag directory without ``trident_meta.json`` is incomplete and never loaded. The
two ends of the protocol (before any file; after every rank's files) are ``commit.py``. With --async-save the
files between them are written by a background thread and the commit happens at a later iteration's end
(``async_save.py``).

Client state saved with the engine (``mp_rank_XX_model_states.pt``): ``iteration``, ``consumed_train_samples``,
``consumed_train_tokens``, ``consumed_valid_samples``, ``consumed_valid_tokens``, ``skipped_iterations``,
``lr_scheduler`` (``OptimizerParamScheduler.state_dict()``), ``trident_model_config`` and DeepSpeed's
``universal_checkpoint_info`` (``megatron/layout/universal_info.py``).

The start-up checks that make a load safe run before any process group exists: :mod:`megatron.checkpointing.rules`.
A checkpoint of another TP / PP / DP size or ZeRO stage is converted on the way in where those rules allow it
(``rules.converts_on_load``; :mod:`megatron.checkpointing.relayout`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

from megatron.checkpointing.async_save import AsyncSaves, FileJob, Writers, snapshot
from megatron.checkpointing.checksums import ChecksumRecorder
from megatron.checkpointing.commit import (
    CheckpointSaveError,
    SaveCommit,
    commit,
    is_write_error,
    prepare_tag,
    save_failed_message,
    wait_for_all_ranks,
)
from megatron.checkpointing.lora import LORA_BASE_KEY, check_adapter_resume
from megatron.checkpointing.meta import (
    META_VERSION,
    check_model_matches,
    check_universal_kind,
)
from megatron.checkpointing.pointers import find_checkpoint, tag_for_iteration
from megatron.checkpointing.relayout import (
    convert_for_load,
    layout_words,
    relayout_dir,
    remove_relayout_dir,
    saved_param_groups,
)
from megatron.checkpointing.rng import (
    load_rng_file,
    rng_file_bytes,
    rng_file_name,
    write_rng_file,
)
from megatron.checkpointing.rules import ResumeCase, converts_on_load, resume_case
from megatron.checkpointing.weights_only import (
    assign_weights,
    needs_own_weight_loader,
    read_tp_rank_weights,
    refresh_master_weights,
    saved_zero_stage,
)
from megatron.checkpointing.zero3 import read_zero3_client_state
from megatron.config import CheckpointConfig, ModelConfig, RunPlan
from megatron.deepspeed_internals import (
    checkpoint_saves_through,
    hold_optimizer_steps,
    loading_universal,
)
from megatron.launch.exit_codes import ConfigError
from megatron.layout.universal_info import universal_checkpoint_info, used_patterns
from megatron.log import global_rank
from megatron.mpu.mappings import all_gather_object

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
        ds_sequence_parallel_size: --ds-sequence-parallel-size (the ZeRO partition count of the run, compared
            with the checkpoint's to decide whether the load converts it: ``rules.converts_on_load``).
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
        ds_sequence_parallel_size: int = 1,
    ) -> None:
        self.checkpoint = checkpoint
        self.record_checksums = record_checksums
        self.plan = plan
        self.tokenizer = tokenizer
        self.tensor_model_parallel_rank = tensor_model_parallel_rank
        self.expert_parallel_size = expert_parallel_size
        self.ds_sequence_parallel_size = ds_sequence_parallel_size
        self.model = dataclasses.replace(model, vocab_size=plan.true_vocab_size)
        self.last_save_seconds: float | None = None
        self.last_load_seconds: float | None = None
        self.last_conversion_seconds: float | None = None
        """Seconds the last load spent converting the checkpoint to the run's layout (None: not converted)."""
        self._pending_rng: Path | None = None
        self._async = AsyncSaves()
        """--async-save: the save whose files a thread is writing (at most one)."""
        self.extra_meta: dict[str, Any] = {}
        """Merged into ``trident_meta.json`` (the HF importer sets ``{"weights_only": True, ...}``; a LoRA run
        its base, ``lora.LORA_BASE_KEY``)."""
        self.lora = self.model.lora.enabled
        """--lora-rank: the files hold the trainable adapters only; the base is --pretrained-checkpoint's."""

    # ------------------------------------------------------------------ save
    def save(self, engine: Any, scheduler: Any, state: Any) -> None:
        """Write iteration ``state.iteration`` to --save, then move the pointers (see the module docstring); with
        --async-save, copy the state and return while a thread writes it (:meth:`finalize_save` commits it).

        Raises:
            CheckpointSaveError: a file could not be written (disk full, quota, permissions): one line naming the
                file and the checkpoint 'latest' still points to.
        """
        try:
            self._save(engine, scheduler, state)
        except (OSError, RuntimeError) as err:  # torch.save wraps the OSError of a failed write
            if not is_write_error(err):
                raise
            save_dir = Path(self.checkpoint.save or "")
            raise CheckpointSaveError(save_failed_message(save_dir, state.iteration, err)) from None

    def finalize_save(self, *, blocking: bool) -> None:
        """--async-save: commit the save in flight once every rank wrote its files (a collective: every rank calls
        it at the same points, each iteration's end and, ``blocking``, before the run exits). No-op otherwise.

        Raises:
            CheckpointSaveError: a rank's background write failed; 'latest' still names the previous checkpoint.
        """
        self._async.finalize(blocking=blocking)

    @property
    def save_in_flight(self) -> bool:
        """--async-save: a save is being written (not yet committed by :meth:`finalize_save`)."""
        return self._async.in_flight

    @property
    def step_wait_seconds(self) -> float:
        """--async-save: seconds the optimizer steps since the last save waited for its copy (training blocked
        beyond :attr:`last_save_seconds`)."""
        return self._async.step_wait_seconds

    def _save(self, engine: Any, scheduler: Any, state: Any) -> None:
        start = time.perf_counter()
        self._async.wait_previous(state.iteration)
        save_dir = Path(self.checkpoint.save or "")
        tag_dir = prepare_tag(save_dir, tag_for_iteration(state.iteration))
        recorder = ChecksumRecorder(tag_dir)
        rng = rng_file_bytes()
        client_state = self._client_state(engine, scheduler, state)
        save = SaveCommit(tag_dir, int(state.iteration), self._meta_record(engine, state))
        if self.checkpoint.async_save:
            self._save_in_background(engine, recorder, client_state, save, rng)
        else:
            write_rng_file(tag_dir / rng_file_name(global_rank()), rng, recorder.write_bytes)
            # Ends with a barrier over all ranks: after it, every rank's files are written.
            route = (
                checkpoint_saves_through(engine, recorder.torch_save)
                if self.record_checksums
                else contextlib.nullcontext(False)
            )
            with route as hashed:
                engine.save_checkpoint(
                    str(save_dir),
                    tag=tag_dir.name,
                    client_state=client_state,
                    save_latest=False,
                    exclude_frozen_parameters=self.lora,
                )
            if hashed:
                recorder.write_sidecar(global_rank())
                wait_for_all_ranks()  # every rank's record is on disk before rank 0 merges them
            save.hashed = hashed
            commit(save)
        self.last_save_seconds = time.perf_counter() - start
        if global_rank() == 0:
            logger.info(
                "checkpoint %s: state of iteration %d captured in %.2f s (training blocked); copying and "
                "writing it in the background (--async-save)"
                if self.checkpoint.async_save
                else "saved checkpoint %s at iteration %d in %.2f s",
                tag_dir,
                state.iteration,
                self.last_save_seconds,
            )

    def _save_in_background(
        self,
        engine: Any,
        recorder: ChecksumRecorder,
        client_state: dict[str, Any],
        save: SaveCommit,
        rng: bytes,
    ) -> None:
        """--async-save: DeepSpeed's files as snapshots (``async_save.py``: the structure now, the tensors copied
        to host memory by a thread before the next optimizer step), written by that thread."""
        jobs = [FileJob(save.tag_dir / rng_file_name(global_rank()), rng)]
        pin = self.plan.device_type == "cuda"

        buffers = self._async.buffers

        def keep(state_dict: Any, path: str, zipped: bool) -> None:
            name = Path(path).name
            snap = snapshot(state_dict, pin=pin, buffers=buffers.get(name))
            buffers[name] = snap.buffers
            jobs.append(FileJob(Path(path), snap, zipped))

        # Ends with DeepSpeed's barrier; the files are then snapshots in ``jobs``, not yet on disk.
        with checkpoint_saves_through(engine, keep) as routed:
            engine.save_checkpoint(
                str(save.tag_dir.parent),
                tag=save.tag_dir.name,
                client_state=client_state,
                save_latest=False,
                exclude_frozen_parameters=self.lora,
            )
        # Not routed (another DeepSpeed checkpoint engine): it wrote its files itself, unhashed.
        save.hashed = routed and self.record_checksums
        # The thread copies the tensors while training runs forward and backward; the next optimizer step waits.
        hold_optimizer_steps(engine, self._async.before_optimizer_step)
        self._async.start(jobs, self._writers(recorder, save.hashed), save)

    @staticmethod
    def _writers(recorder: ChecksumRecorder, hashed: bool) -> Writers:
        """The background thread's writers: the checksum recorder's (or plain ones without checksums)."""
        rank = global_rank()

        def write_bytes(path: Path, data: bytes) -> None:
            write_rng_file(path, data, recorder.write_bytes if hashed else None)

        if hashed:
            return Writers(recorder.torch_save, write_bytes, lambda: recorder.write_sidecar(rank))
        return Writers(_plain_torch_save, write_bytes, lambda: None)

    def _client_state(self, engine: Any, scheduler: Any, state: Any) -> dict[str, Any]:
        """What ``engine.save_checkpoint`` saves beside the engine's states (see the module docstring)."""
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
        return client_state

    def _meta_record(self, engine: Any, state: Any) -> dict[str, Any]:
        """``trident_meta.json`` of this save, less the checksums (``meta.py``)."""
        plan = self.plan
        moe = getattr(engine, "has_moe_layers", False)
        return {
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
            **({"moe_expert_parallel_size": self.expert_parallel_size} if moe else {}),
            **({"tokenizer": self.tokenizer} if self.tokenizer else {}),
            **self.extra_meta,
        }

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
        if self.lora:
            base = self.extra_meta.get(LORA_BASE_KEY)
            check_adapter_resume(meta, self.model, base, f"--load {load_dir} (tag {tag})")
        # A converted (e.g. HF-imported) checkpoint carries weights only: no schedule/optimizer progress to keep.
        finetune = ck.finetune or bool(meta.get("weights_only", False))
        tag_dir = Path(load_dir) / tag
        case = resume_case(
            meta,
            ck,
            self.plan,
            tag,
            ds_sequence_parallel_size=self.ds_sequence_parallel_size,
            expert_parallel_size=self.expert_parallel_size,
        )
        if converts_on_load(case) and case is not None and self.lora:
            raise ValueError(
                f"--load {load_dir} (tag {tag}): an adapter checkpoint resumes at the layout it was saved at "
                "(TP, PP, DP, ZeRO stage); run at that layout, or export the merged model and start anew."
            )
        if converts_on_load(case) and case is not None:
            client = self._load_converted(engine, meta, tag, case)
        else:
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
                load_module_strict=not self.lora,  # LoRA: the adapters only (their keys: check_adapter_resume)
                load_optimizer_states=load_optim,
                load_lr_scheduler_states=False,
                load_module_only=finetune,
            )
            if not load_optim:
                refresh_master_weights(engine)
        if client is None:
            raise RuntimeError(f"DeepSpeed could not load {tag_dir}.")
        return client

    def _load_converted(
        self, engine: Any, meta: dict[str, Any], tag: str, case: ResumeCase
    ) -> dict[str, Any]:
        """Load ``tag`` saved at another layout: rank 0 writes its universal form beside (``relayout.py``), every
        rank loads that with DeepSpeed's universal loader, rank 0 removes it; returns the client state.

        Raises:
            ConfigError: on every rank, when rank 0 could not convert (a file failed its checks, DeepSpeed
                refused the checkpoint, the folder could not be written).
        """
        ck = self.checkpoint
        load_dir = ck.load or ""
        work = relayout_dir(ck.save, load_dir, tag)
        saved = layout_words(
            tp=case.saved_tp, pp=case.saved_pp, dp=case.saved_dp, stage=case.saved_stage
        )
        run = layout_words(tp=case.run_tp, pp=case.run_pp, dp=case.run_dp, stage=case.run_stage)
        error, seconds = None, 0.0
        if global_rank() == 0:
            logger.info(
                "converting checkpoint %s/%s from %s to %s (in %s)", load_dir, tag, saved, run, work
            )
            error, seconds = self._convert(meta, tag, work, case)
        errors = [e for e in all_gather_object(error, group=dist.group.WORLD) if e]
        if errors:
            if global_rank() == 0:
                remove_relayout_dir(work)
            raise ConfigError(
                f"--load {load_dir} (tag {tag}): converting it from {saved} to this run's {run} failed: "
                f"{errors[0]}"
            )
        start = time.perf_counter()
        with loading_universal(engine, saved_param_groups(work, tag)):
            _, client = engine.load_checkpoint(
                str(work),
                tag=tag,
                load_module_strict=True,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
                load_module_only=False,
            )
        wait_for_all_ranks()  # every rank read the converted copy before it goes
        self.last_conversion_seconds = seconds
        if global_rank() == 0:
            remove_relayout_dir(work)
            logger.info(
                "converted checkpoint %s/%s from %s to %s in %.2f s; loaded in %.2f s (source unchanged)",
                load_dir,
                tag,
                saved,
                run,
                seconds,
                time.perf_counter() - start,
            )
        if client is None:
            raise RuntimeError(f"DeepSpeed could not load the converted copy of {load_dir}/{tag}.")
        return client

    def _convert(
        self, meta: dict[str, Any], tag: str, work: Path, case: ResumeCase
    ) -> tuple[str | None, float]:
        """Rank 0: write the universal form of ``tag`` into ``work``; (the error, if any; the seconds taken)."""
        ck = self.checkpoint
        try:
            _, seconds = convert_for_load(
                ck.load or "",
                tag,
                meta,
                work,
                zero3_vocab_rows=self.plan.padded_vocab_size if case.run_stage == 3 else None,
                hashes=ck.verify_checkpoint_checksums,
            )
        # RuntimeError: torch.save into a full disk
        except (OSError, ValueError, RuntimeError) as err:
            return str(err), 0.0
        return None, seconds

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
        plan = self.plan
        same_world = (
            meta.get("world_size") == plan.world_size
            and meta.get("tensor_model_parallel_size") == plan.tensor_model_parallel_size
            and meta.get("pipeline_model_parallel_size") == plan.pipeline_model_parallel_size
            and not self.checkpoint.universal_checkpoint
        )
        if same_world:
            self._pending_rng = tag_dir / rng_file_name(global_rank())
            if not self._pending_rng.is_file():
                load_rng_file(self._pending_rng)  # raises the missing-file error now
        elif global_rank() == 0:
            logger.info("checkpoint saved on another layout: fresh RNG states")


def _plain_torch_save(state_dict: Any, path: Path, zipped: bool) -> None:
    torch.save(state_dict, path, _use_new_zipfile_serialization=zipped)


__all__ = ["CheckpointSaveError", "DeepSpeedCheckpointer"]
