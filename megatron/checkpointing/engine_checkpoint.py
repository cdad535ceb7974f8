"""Training checkpoints through the DeepSpeed engine: save, load, auto-resume, crash-safe pointers.

Layout of ``--save DIR`` (DeepSpeed's, plus Megatron's iteration file)::

    DIR/latest                              tag of the newest COMPLETE checkpoint (DeepSpeed reads it)
    DIR/latest_checkpointed_iteration.txt   its iteration (Megatron's file)
    DIR/global_step{N}/                     DeepSpeed's files (mp_rank_XX_model_states.pt, zero_*_optim_states.pt,
                                            layer_XX-model_YY-model_states.pt with pipelines)
    DIR/global_step{N}/rng_state_rank{R:05d}.safetensors   per-rank RNG states (``rng.py``)
    DIR/global_step{N}/trident_meta.json    model config, layout, iteration: written last = completion marker

Save protocol (crash safety): every rank writes its RNG file, then ``engine.save_checkpoint(tag=...,
save_latest=False)`` (which ends with a barrier over all ranks), then rank 0 writes ``trident_meta.json`` and moves
both pointers with temp file + ``os.replace``. A process killed at any point leaves the pointers at the previous
complete checkpoint; a tag directory without ``trident_meta.json`` is incomplete and never loaded.

Client state saved with the engine (``mp_rank_XX_model_states.pt``): ``iteration``, ``consumed_train_samples``,
``consumed_train_tokens``, ``consumed_valid_samples``, ``consumed_valid_tokens``, ``skipped_iterations``, ``lr_scheduler`` (``OptimizerParamScheduler.state_dict()``),
``trident_model_config`` and DeepSpeed's ``universal_checkpoint_info`` (``megatron/model/checkpoint_info.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

from megatron import mpu
from megatron.checkpointing.hf_tokenizer import tokenizer_info
from megatron.checkpointing.rng import load_rng_file, rng_file_name, save_rng_file
from megatron.checkpointing.weights_only import (
    assign_weights,
    needs_own_weight_loader,
    read_tp_rank_weights,
    refresh_master_weights,
    saved_zero_stage,
    stage_family,
)
from megatron.checkpointing.zero3 import read_zero3_client_state
from megatron.config import ModelConfig, TridentConfig
from megatron.log import global_rank
from megatron.model.checkpoint_info import universal_checkpoint_info
from megatron.mpu.mappings import all_reduce_max_, communication_device

logger = logging.getLogger(__name__)

LATEST_FILE = "latest"
ITERATION_FILE = "latest_checkpointed_iteration.txt"
LATEST_UNIVERSAL_FILE = "latest_universal"
META_FILE = "trident_meta.json"
META_VERSION = 1

SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "ffn_size",
    "max_positions",
    "normalization",
    "swiglu",
    "use_rotary_position_embeddings",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "vocab_size",
)
"""Resolved ModelConfig values that determine parameter names and shapes (a checkpoint must agree on all of them;
``max_positions`` only with learned positions)."""


CRASH_ENV = "TRIDENT_TEST_CRASH_AT"
"""Fault injection for the crash-safety tests: ``"<point>:<iteration>"`` makes the saving process SIGKILL itself
at that point of the save of that iteration. Points: ``before_engine_save`` (RNG file written),
``after_engine_save`` (all DeepSpeed files written), ``after_meta`` (marker written, pointers not moved),
``after_latest`` (``latest`` moved, iteration file not yet). Unset in normal runs."""


def _crash_point(point: str, iteration: int) -> None:
    if os.environ.get(CRASH_ENV) == f"{point}:{iteration}":
        os.kill(os.getpid(), signal.SIGKILL)


def tag_for_iteration(iteration: int) -> str:
    """DeepSpeed's tag name for ``iteration``."""
    return f"global_step{iteration}"


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


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_complete(load_dir: str | Path, tag: str) -> bool:
    """True when ``load_dir/tag`` was fully written (its ``trident_meta.json`` exists)."""
    return (Path(load_dir) / tag / META_FILE).is_file()


def find_checkpoint(
    load_dir: str, load_tag: str | None = None, *, universal: bool = False
) -> str | None:
    """The tag to resume from in ``load_dir``: ``load_tag`` if given, else the ``latest`` pointer; None = no checkpoint.

    Raises:
        FileNotFoundError: --load-tag names a tag that is missing or incomplete.
        ValueError: ``latest`` points to an incomplete or missing tag (the directory was tampered with).
    """
    root = Path(load_dir)
    if load_tag is not None:
        if not is_complete(root, load_tag):
            raise FileNotFoundError(
                f"--load-tag {load_tag}: {root / load_tag} is not a complete checkpoint "
                f"(no {META_FILE}); pick a tag listed in {root} or drop --load-tag to use 'latest'."
            )
        return load_tag
    latest = root / (LATEST_UNIVERSAL_FILE if universal else LATEST_FILE)
    if not latest.is_file():
        if universal and (root / LATEST_FILE).is_file():
            raise FileNotFoundError(
                f"--universal-checkpoint: {root} has no {LATEST_UNIVERSAL_FILE}; convert it first with "
                f"python -m tools.checkpoint.to_universal --load {load_dir}"
            )
        return None
    tag = latest.read_text(encoding="utf-8").strip()
    if not is_complete(root, tag):
        raise ValueError(
            f"--load {load_dir}: '{latest.name}' points to {tag!r}, which is not a complete checkpoint "
            f"(no {root / tag / META_FILE}); fix 'latest' or pass --load-tag with a complete tag."
        )
    if universal:
        _refuse_stale_universal(root, tag)
    return tag


def _refuse_stale_universal(root: Path, universal_tag: str) -> None:
    """--universal-checkpoint is for the first resume only: refuse it once training saved past the conversion."""
    regular = root / LATEST_FILE
    if not regular.is_file():
        return
    newest = regular.read_text(encoding="utf-8").strip()
    if not is_complete(root, newest):
        return
    done = int(read_meta(root, newest).get("iteration", 0))
    converted = int(read_meta(root, universal_tag).get("iteration", 0))
    if done > converted:
        raise ValueError(
            f"--universal-checkpoint: {root} holds a newer regular checkpoint ({newest}, iteration {done}) than "
            f"'{LATEST_UNIVERSAL_FILE}' ({universal_tag}, iteration {converted}); drop --universal-checkpoint "
            "to resume from it (the flag is for the first resume after a layout change)."
        )


def read_meta(load_dir: str | Path, tag: str) -> dict[str, Any]:
    """The ``trident_meta.json`` of a checkpoint (plain JSON, safe to read)."""
    return json.loads((Path(load_dir) / tag / META_FILE).read_text(encoding="utf-8"))


def model_config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """A ``ModelConfig`` from its saved ``dataclasses.asdict`` form (unknown keys ignored)."""
    fields = set(ModelConfig.__dataclass_fields__)
    return ModelConfig(**{k: v for k, v in d.items() if k in fields})


def model_mismatches(saved: dict[str, Any], current: ModelConfig) -> list[str]:
    """``"field: checkpoint X, flags Y"`` for every :data:`SHAPE_FIELDS` value that differs."""
    theirs_cfg = model_config_from_dict(saved)
    rotary = current.use_rotary_position_embeddings and theirs_cfg.use_rotary_position_embeddings
    out = []
    for name in SHAPE_FIELDS:
        if name == "max_positions" and rotary:
            continue
        mine, theirs = getattr(current, name), getattr(theirs_cfg, name)
        if theirs != mine:
            out.append(f"{name}: checkpoint {theirs!r}, flags {mine!r}")
    return out


def check_model_matches(load_dir: str, tag: str, current: ModelConfig) -> dict[str, Any]:
    """Read the checkpoint's meta and refuse a model whose shape disagrees with the flags.

    Raises:
        ValueError: listing every differing field.
    """
    meta = read_meta(load_dir, tag)
    diffs = model_mismatches(meta["model"], current)
    if diffs:
        raise ValueError(
            f"--load {load_dir} (tag {tag}): the checkpoint's model differs from the flags in "
            f"{len(diffs)} field(s): " + "; ".join(diffs) + ". Pass the checkpoint's model flags "
            "(or --load another checkpoint)."
        )
    return meta


class DeepSpeedCheckpointer:
    """``CheckpointHooks`` implementation over ``engine.save_checkpoint`` / ``engine.load_checkpoint``.

    Args:
        cfg: the run's config (``checkpoint`` flags; ``model`` for the shape check and the saved config).
        true_vocab: the tokenizer's vocabulary size (``cfg.model.vocab_size`` may be 0 before it is known).
        padded_vocab: the run's padded vocabulary (for ``universal_checkpoint_info``).
        world_size: number of ranks of the run.
        tokenizer_fingerprint: ``megatron.tokenizer.encoding_fingerprint`` of the run's tokenizer (recorded in
            the meta, checked when a run loads the checkpoint).
    """

    def __init__(
        self,
        cfg: TridentConfig,
        *,
        true_vocab: int,
        padded_vocab: int,
        world_size: int,
        tokenizer_fingerprint: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.model = dataclasses.replace(cfg.model, vocab_size=true_vocab)
        self.padded_vocab = padded_vocab
        self.world_size = world_size
        self.last_save_seconds: float | None = None
        self.last_load_seconds: float | None = None
        self._pending_rng: Path | None = None
        self.extra_meta: dict[str, Any] = {}
        """Merged into ``trident_meta.json`` (the HF importer sets ``{"weights_only": True, ...}``)."""

    # ------------------------------------------------------------------ save
    def save(self, engine: Any, scheduler: Any, state: Any) -> None:
        """Write iteration ``state.iteration`` to --save, then move the pointers (see the module docstring)."""
        start = time.perf_counter()
        save_dir = Path(self.cfg.checkpoint.save or "")
        tag = tag_for_iteration(state.iteration)
        tag_dir = save_dir / tag
        tag_dir.mkdir(parents=True, exist_ok=True)
        marker = tag_dir / META_FILE
        if global_rank() == 0:
            _retreat_latest(save_dir, tag)
            if marker.exists():
                marker.unlink()  # re-saving an iteration: incomplete until this save finishes
        _wait_for_all_ranks()  # no rank overwrites files of the tag before 'latest' left it
        save_rng_file(tag_dir / rng_file_name(global_rank()))
        _crash_point("before_engine_save", state.iteration)
        seq = self.cfg.model.seq_length
        client_state = {
            "iteration": int(state.iteration),
            "consumed_train_samples": int(state.consumed_train_samples),
            "consumed_train_tokens": int(state.consumed_train_samples) * seq,
            "consumed_valid_samples": int(state.consumed_valid_samples),
            "consumed_valid_tokens": int(state.consumed_valid_samples) * seq,
            "skipped_iterations": int(state.skipped_iterations),
            "lr_scheduler": scheduler.state_dict(),
            "trident_model_config": dataclasses.asdict(self.model),
            UNIVERSAL_CHECKPOINT_INFO: _used_patterns(
                universal_checkpoint_info(self.model, self.padded_vocab), engine.module
            ),
        }
        # Ends with a barrier over all ranks: after it, every rank's files are written.
        engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state, save_latest=False)
        _crash_point("after_engine_save", state.iteration)
        if global_rank() == 0:
            p, d = self.cfg.parallel, self.cfg.data
            tokenizer = tokenizer_info(
                tokenizer_type=d.tokenizer_type,
                vocab_file=d.vocab_file,
                merge_file=d.merge_file,
                tokenizer_model=d.tokenizer_model,
                fingerprint=self.tokenizer_fingerprint,
            )
            meta = {
                "version": META_VERSION,
                "iteration": int(state.iteration),
                "consumed_train_samples": int(state.consumed_train_samples),
                "consumed_valid_samples": int(state.consumed_valid_samples),
                "model": dataclasses.asdict(self.model),
                "padded_vocab_size": self.padded_vocab,
                "tensor_model_parallel_size": p.tensor_model_parallel_size,
                "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
                "world_size": self.world_size,
                "zero_stage": int(engine.zero_optimization_stage()),
                "precision": _precision(self.cfg),
                **({"tokenizer": tokenizer} if tokenizer else {}),
                **self.extra_meta,
            }
            _atomic_write(marker, json.dumps(meta, indent=1, sort_keys=True) + "\n")
            _crash_point("after_meta", state.iteration)
            _atomic_write(save_dir / LATEST_FILE, tag)
            _crash_point("after_latest", state.iteration)
            _atomic_write(save_dir / ITERATION_FILE, f"{state.iteration}\n")
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
        ck = self.cfg.checkpoint
        load_dir = ck.load or ""
        universal = ck.universal_checkpoint
        tag = find_checkpoint(load_dir, ck.load_tag, universal=universal)
        if tag is None:
            if global_rank() == 0:
                logger.info("no checkpoint in --load %s: starting from scratch", load_dir)
            return
        start = time.perf_counter()
        meta = check_model_matches(load_dir, tag, self.model)
        _check_universal_kind(meta, universal, load_dir, tag)
        # A converted (e.g. HF-imported) checkpoint carries weights only: no schedule/optimizer progress to keep.
        finetune = ck.finetune or bool(meta.get("weights_only", False))
        load_optim = not (ck.no_load_optim or finetune)
        client: dict[str, Any] | None
        tag_dir = Path(load_dir) / tag
        if not universal and self._own_weight_loader(engine, meta, tag_dir, load_optim):
            tp_rank = mpu.get_tensor_model_parallel_rank()
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
            raise RuntimeError(f"DeepSpeed could not load {Path(load_dir) / tag}.")
        if not finetune:
            state.iteration = int(client["iteration"])
            state.consumed_train_samples = int(client["consumed_train_samples"])
            state.consumed_valid_samples = int(client.get("consumed_valid_samples", 0))
            state.skipped_iterations = int(client.get("skipped_iterations", 0))
            scheduler.load_state_dict(client["lr_scheduler"])
        same_world = meta.get("world_size") == self.world_size and not universal
        if not (ck.no_load_rng or finetune):
            if same_world:
                self._pending_rng = Path(load_dir) / tag / rng_file_name(global_rank())
                if not self._pending_rng.is_file():
                    load_rng_file(self._pending_rng)  # raises the missing-file error now
            elif global_rank() == 0:
                logger.info("checkpoint saved on another layout: fresh RNG states")
        self.last_load_seconds = time.perf_counter() - start
        if global_rank() == 0:
            logger.info(
                "loaded checkpoint %s (iteration %d%s) in %.2f s",
                Path(load_dir) / tag,
                int(client.get("iteration", 0)),
                ", --finetune: weights only, iteration 0" if finetune else "",
                self.last_load_seconds,
            )


def _complete_tags(root: Path) -> list[tuple[int, str]]:
    """``(iteration, tag)`` of every complete ``global_step{N}`` checkpoint in ``root``, ascending."""
    out = []
    for path in root.glob("global_step*"):
        m = re.fullmatch(r"global_step(\d+)", path.name)
        if m is not None and (path / META_FILE).is_file():
            out.append((int(m.group(1)), path.name))
    return sorted(out)


def _retreat_latest(save_dir: Path, tag: str) -> None:
    """Before ``tag`` is overwritten in place, move 'latest' off it (to the newest other complete checkpoint, or
    remove it when there is none), so a crash during the re-save never leaves 'latest' on a half-written tag."""
    latest = save_dir / LATEST_FILE
    if not latest.is_file() or latest.read_text(encoding="utf-8").strip() != tag:
        return
    # Only an older tag: a newer complete one belongs to the branch the run left with --load-tag.
    m = re.fullmatch(r"global_step(\d+)", tag)
    resaved = int(m.group(1)) if m else None
    older = [
        (it, t)
        for it, t in _complete_tags(save_dir)
        if t != tag and (resaved is None or it < resaved)
    ]
    if older:
        iteration, previous = older[-1]
        _atomic_write(latest, previous)
        _atomic_write(save_dir / ITERATION_FILE, f"{iteration}\n")
        logger.info("re-saving %s: 'latest' points to %s until the save completes", tag, previous)
    else:
        latest.unlink()
        (save_dir / ITERATION_FILE).unlink(missing_ok=True)
        logger.warning(
            "re-saving %s in place with no older complete checkpoint in %s: until this save completes, "
            "the directory has no 'latest' (a crash now would make the next launch start from scratch)",
            tag,
            save_dir,
        )


def _wait_for_all_ranks() -> None:
    """A barrier over every rank (an all-reduce of one element through ``mpu.mappings``)."""
    if dist.is_available() and dist.is_initialized():
        world = dist.group.WORLD
        all_reduce_max_(torch.zeros(1, device=communication_device(world)), group=world)


def _used_patterns(info: dict[str, Any], module: Any) -> dict[str, Any]:
    """Keep only the patterns that match a parameter of ``module`` (``ds_to_universal`` asserts every pattern is
    used; e.g. the pipeline's final-norm pattern never matches ``GPTModel`` names, nor ``output_layer`` when tied)."""
    names = [n for n, _ in module.named_parameters()]
    out: dict[str, Any] = {}
    for key, value in info.items():
        if isinstance(value, list) and all(isinstance(p, str) for p in value):
            value = [p for p in value if any(re.match(p, n) for n in names)]
        out[key] = value
    return out


def resolve_universal_flag(cfg: TridentConfig, world_size: int | None = None) -> TridentConfig:
    """``cfg`` with --universal-checkpoint dropped when --load holds a regular checkpoint newer than the universal
    conversion, saved at this run's layout (the flag is for the first resume after a layout change; relaunching the
    same command afterwards must resume the newer regular checkpoint, with one log line). A newer regular
    checkpoint of ANOTHER layout keeps the flag (and its explanation of the conflict)."""
    ck = cfg.checkpoint
    if not (ck.universal_checkpoint and ck.load and ck.load_tag is None):
        return cfg
    root = Path(ck.load)
    universal, regular = root / LATEST_UNIVERSAL_FILE, root / LATEST_FILE
    if not (universal.is_file() and regular.is_file()):
        return cfg
    u_tag = universal.read_text(encoding="utf-8").strip()
    r_tag = regular.read_text(encoding="utf-8").strip()
    if not (is_complete(root, u_tag) and is_complete(root, r_tag)):
        return cfg
    meta = read_meta(root, r_tag)
    done = int(meta.get("iteration", 0))
    if done <= int(read_meta(root, u_tag).get("iteration", 0)):
        return cfg
    p = cfg.parallel
    layout = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, world_size)
    saved = (
        meta.get("tensor_model_parallel_size"),
        meta.get("pipeline_model_parallel_size"),
        meta.get("world_size") if world_size is not None else None,
    )
    if saved != layout:
        return cfg
    if global_rank() == 0:
        logger.info(
            "--universal-checkpoint: %s holds a newer regular checkpoint (%s, iteration %d) than the universal "
            "one (%s); resuming the regular one",
            root,
            r_tag,
            done,
            u_tag,
        )
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(ck, universal_checkpoint=False))


def _same_dir(a: str, b: str) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def _check_save_holds_no_other_run(cfg: TridentConfig) -> None:
    """--save must not receive a new run's checkpoints on top of another run's (they would be overwritten and
    'latest' moved): refuse a --save holding checkpoints unless it is the --load directory being resumed."""
    ck = cfg.checkpoint
    if not ck.save or not Path(ck.save).is_dir():
        return
    tags = _complete_tags(Path(ck.save))
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


def _precision(cfg: TridentConfig) -> str:
    """The run's training precision as recorded in ``trident_meta.json``: ``bf16``, ``fp16`` or ``fp32``."""
    return "bf16" if cfg.training.bf16 else "fp16" if cfg.training.fp16 else "fp32"


def _check_layout(
    meta: dict[str, Any], cfg: TridentConfig, world_size: int, tag: str, zero_stage: int | None
) -> None:
    """TP/PP of the checkpoint must be the run's (other layouts go through a universal checkpoint or an offline
    reshard); unless only weights are loaded, so must the ZeRO stage's storage kind (:func:`stage_family`) and,
    when the optimizer state or ZeRO-3 weights are partitioned over DP, the DP size."""
    ck, p = cfg.checkpoint, cfg.parallel
    if ck.universal_checkpoint or "tensor_model_parallel_size" not in meta:
        return
    tp, pp = int(meta["tensor_model_parallel_size"]), int(meta["pipeline_model_parallel_size"])
    now_tp, now_pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    hint = (
        f"resume at another layout through a universal checkpoint (python -m tools.checkpoint.to_universal "
        f"--load {ck.load}, then add --universal-checkpoint), or reshard the weights offline "
        "(python -m tools.checkpoint.reshard)."
    )
    if (tp, pp) != (now_tp, now_pp):
        raise ValueError(
            f"--load {ck.load} (tag {tag}) was saved with --tensor-model-parallel-size {tp} and "
            f"--pipeline-model-parallel-size {pp}; this run uses {now_tp} and {now_pp}. Use the "
            f"checkpoint's sizes, or {hint}"
        )
    weights_only = ck.finetune or bool(meta.get("weights_only", False))
    run_stage = p.zero_stage if zero_stage is None else zero_stage
    stage = saved_zero_stage(Path(ck.load or "") / tag, meta, default=run_stage)
    if weights_only:
        return  # any ZeRO stage and DP size: weights_only.py reads what DeepSpeed's loader cannot
    uses = f"ZeRO-{run_stage}"
    fix = f"--zero-stage {stage}"
    if run_stage != p.zero_stage:  # ds_config.effective_zero_stage
        uses += (
            f" (--zero-stage {p.zero_stage} becomes 1 with pipeline parallelism and --clip-grad, where "
            "ZeRO-0 computes a wrong gradient norm)"
        )
        if stage == 0:
            fix = "--clip-grad 0 (as when it was saved)"
    if (stage == 3) != (run_stage == 3):
        raise ValueError(
            f"--load {ck.load} (tag {tag}) was saved with ZeRO-{stage}; this run uses {uses}, and "
            f"DeepSpeed keeps ZeRO-3's weights in other files than ZeRO-0/1/2's. Pass {fix} to resume, or "
            "--finetune to start a new run from its weights."
        )
    if not ck.no_load_optim and stage_family(stage) != stage_family(run_stage):
        other = {1: 2, 2: 1}.get(stage) if now_pp == 1 else None  # pipelines refuse ZeRO-2
        raise ValueError(
            f"--load {ck.load} (tag {tag}) was saved with ZeRO-{stage}; this run uses {uses}, whose "
            f"optimizer state DeepSpeed stores differently. Pass {fix}"
            + (f" (or {other})" if other is not None and fix.startswith("--zero-stage") else "")
            + ", or --no-load-optim (same iteration, fresh optimizer state)."
        )
    saved_precision, precision = meta.get("precision"), _precision(cfg)
    if not ck.no_load_optim and saved_precision and saved_precision != precision:
        flag = {"bf16": "--bf16", "fp16": "--fp16", "fp32": "neither --bf16 nor --fp16"}[
            saved_precision
        ]
        raise ValueError(
            f"--load {ck.load} (tag {tag}) was trained in {saved_precision}; this run uses {precision}, and "
            "DeepSpeed keeps the optimizer state of each precision in other files. Pass "
            f"{flag} as before, or --no-load-optim (same iteration, fresh optimizer state)."
        )
    dp_saved = int(meta.get("world_size", world_size)) // (tp * pp)
    dp_now = world_size // (now_tp * now_pp)
    # Without optimizer state, even ZeRO-3's weights load at another DP size (weights_only.py).
    partitioned = stage >= 1 and not ck.no_load_optim
    if dp_saved != dp_now and partitioned:
        raise ValueError(
            f"--load {ck.load} (tag {tag}) was saved by {dp_saved} data-parallel ranks with ZeRO-{stage}, "
            f"whose {'weights and ' if stage == 3 else ''}optimizer state are partitioned over them; "
            f"this run has {dp_now}. Launch {dp_saved * now_tp * now_pp} processes, "
            + "pass --no-load-optim (fresh optimizer), or "
            + hint
        )


def _check_tokenizer_matches(
    meta: dict[str, Any], cfg: TridentConfig, tag: str, fingerprint: str | None
) -> None:
    """The run's tokenizer must encode like the checkpoint's: both fingerprints known and different is an error
    (a warning with --finetune, which may change tokenizers on purpose). Without fingerprints, a warning (not an
    error: e.g. HFTokenizer and GPT2BPETokenizer over GPT-2's files give the same ids) when the tokenizer type
    differs; a different vocabulary size is a shape error already."""
    recorded = meta.get("tokenizer") or {}
    saved_print = recorded.get("fingerprint")
    if saved_print and fingerprint and saved_print != fingerprint:
        d = cfg.data
        files = [
            f"{flag} {value}"
            for flag, value in (
                ("--vocab-file", d.vocab_file),
                ("--merge-file", d.merge_file),
                ("--tokenizer-model", d.tokenizer_model),
            )
            if value
        ]
        was = [
            f"{key} {recorded[key]}"
            for key in ("vocab_file", "merge_file", "tokenizer_model")
            if key in recorded
        ]
        msg = (
            f"--load {cfg.checkpoint.load} (tag {tag}) was trained with a tokenizer that encodes text into other "
            f"ids than this run's (--tokenizer-type {d.tokenizer_type}{', ' if files else ''}{', '.join(files)}), "
            "so its embeddings would be read with the wrong tokens"
        )
        if not cfg.checkpoint.finetune:
            raise ValueError(
                f"{msg}. Pass the tokenizer it was trained with (--tokenizer-type "
                f"{recorded.get('tokenizer_type')}{', ' if was else ''}{', '.join(was)}; the files must be "
                "unchanged), or start a new run from its weights with --finetune."
            )
        if global_rank() == 0:
            logger.warning("%s (--finetune: continuing on purpose?)", msg)
        return
    saved = recorded.get("tokenizer_type")
    now = cfg.data.tokenizer_type
    if saved and now and saved != now and global_rank() == 0:
        logger.warning(
            "--load %s (tag %s) was trained with --tokenizer-type %s; this run passes %s: make sure both give the "
            "same token ids",
            cfg.checkpoint.load,
            tag,
            saved,
            now,
        )


def check_checkpoint_dirs(
    cfg: TridentConfig,
    true_vocab: int | None = None,
    world_size: int | None = None,
    tokenizer_fingerprint: str | None = None,
    zero_stage: int | None = None,
) -> None:
    """Preflight (before any process group), identical on every rank.

    --save must be writable and must not hold another run's checkpoints; --load must be a directory (a missing
    one is an error unless it is the --save of an auto-resumed run); --load-tag, --finetune,
    --universal-checkpoint need --load, and --finetune / --skip-train need a checkpoint there; with
    ``true_vocab`` (the tokenizer's) a checkpoint found in --load must match the model flags, the tokenizer
    (``tokenizer_fingerprint``, else its type), the --universal-checkpoint kind and (with ``world_size``) the
    parallel layout and ZeRO stage (``zero_stage``: the stage the run really uses; default --zero-stage). No
    checkpoint in an existing --load is fine otherwise (the run starts from scratch, with one log line).

    Raises:
        ValueError / FileNotFoundError: naming the flag, the problem and the fix.
    """
    ck = cfg.checkpoint
    if ck.save:
        if Path(ck.save).is_file():
            raise ValueError(f"--save {ck.save} is a file; give a directory.")
        check_save_dir(ck.save)
        _check_save_holds_no_other_run(cfg)
    for flag, given in (
        ("--load-tag", ck.load_tag),
        ("--finetune", ck.finetune),
        ("--universal-checkpoint", ck.universal_checkpoint),
    ):
        if given and not ck.load:
            raise ValueError(f"{flag} was given without --load; add --load DIR.")
    if not ck.load:
        return
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
        return
    if true_vocab is not None:
        meta = check_model_matches(
            ck.load, tag, dataclasses.replace(cfg.model, vocab_size=true_vocab)
        )
        _check_universal_kind(meta, ck.universal_checkpoint, ck.load, tag)
        _check_tokenizer_matches(meta, cfg, tag, tokenizer_fingerprint)
        if world_size is not None:
            _check_layout(meta, cfg, world_size, tag, zero_stage)
        _check_model_state_files(root / tag, meta)


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


def _check_universal_kind(meta: dict[str, Any], universal: bool, load_dir: str, tag: str) -> None:
    if bool(meta.get("universal", False)) != universal:
        raise ValueError(
            f"--load {load_dir} (tag {tag}): "
            + (
                "this is a universal checkpoint; add --universal-checkpoint."
                if not universal
                else "--universal-checkpoint needs a universal checkpoint; convert this one with "
                f"python -m tools.checkpoint.to_universal --load {load_dir}"
            )
        )
