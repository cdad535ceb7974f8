"""Every use of DeepSpeed internals (private attributes, monkeypatches, non-API modules) in one place, behind a
version check.

Trident drives the real DeepSpeed engine through its public API (``deepspeed.initialize``, ``engine.backward`` /
``step`` / ``train_batch`` / ``save_checkpoint`` / ``load_checkpoint``, ``PipelineModule``, ``zero.GatheredParameters``)
everywhere else. What is here needs DeepSpeed's insides, which change between releases without notice, so it is
used only with the version it was written and tested against (:data:`TESTED_DEEPSPEED`; ``requirements.txt`` and
``setup.py`` pin the same). Another installed version is one clear error at start-up
(:func:`check_deepspeed_version`), unless ``TRIDENT_ALLOW_UNTESTED_DEEPSPEED=1`` turns it into a warning.

=====================================  =====================================================================
internal                               why
=====================================  =====================================================================
``deepspeed.comm.torch.build_shm_op``  replaced on CPU: its JIT build (30-50 s, needs a compiler) serves only
                                       DeepSpeed inference
``engine.clip_fp32_gradients``,        fp32 ZeRO-0 with clipping computes the global grad norm and drops it;
``engine._global_grad_norm``           kept so ``get_global_grad_norm()`` reports it
``engine.enable_backward_allreduce``   off where ZeRO-0's gradient all-reduce is over one rank (an identity
                                       that still copies every gradient into a bucket and back)
optimizer ``cur_scale``/``loss_scale`` the fp16 loss scale for the progress line
param ``ds_id`` / ``ds_shape``         ZeRO-3 partitioned parameters and their full shapes
param ``_hp_mapping`` +                the fp32 master copy of a parameter under ZeRO-1/2 and the bf16
``set_full_hp_param``                  optimizer (weights-only loads write it)
optimizer ``fp16_groups`` /            the unfused fp16/bf16 optimizer's per-parameter master copies (ZeRO-0)
``fp32_groups``
optimizer ``refresh_fp32_params()``    re-reads the master copy from the parameters (ZeRO-1/2/3, bf16)
``runtime.zero.config.ZeroStageEnum``, classes pickled inside ZeRO checkpoint files (allow-listed for
``runtime.fp16.loss_scaler.*``,        ``torch.load(weights_only=True)``)
``utils.tensor_fragment.fragment_address``
``checkpoint.ds_to_universal.main``    the universal-checkpoint converter, called with its argparse namespace
``engine._config.load_universal_       switched on for one load (a --load converted on the way in,
checkpoint``, optimizer param groups   ``megatron/checkpointing/relayout.py``), then restored; the groups'
                                       settings kept (ZeRO-3's loader gives all groups the first one's)
``c10d.default_pg_timeout``            set to --distributed-timeout-minutes: DeepSpeed's own groups
                                       (``deepspeed.comm.new_group(ranks)``, no timeout argument) get it
``engine.checkpoint_engine.save``      replaced on the instance during a save: each file is written through
                                       the checksum recorder (``megatron/checkpointing/checksums.py``)
``engine.optimizer.step``              wrapped on the instance (--async-save): the step waits until the save
                                       in flight has copied the states it changes in place
``checkpointing._CUDA_RNG_STATE_       set to Trident's RNG tracker: ``deepspeed.checkpointing.checkpoint`` saves
TRACKER``                              and restores the streams of the tracker dropout really draws from
pipeline ``_INSTRUCTION_MAP``          shadowed per engine instance to time the 1F1B instructions under
                                       Megatron's timer names (``training/timers.py``)
``moe.mappings._gather_tokens``        replaced: its flat all-gather buffer is refused by gloo (CPU); the same
                                       gather through ``mpu.mappings`` (MoE with TP > 1)
``utils.groups.mpu``,                  the mpu DeepSpeed's MoE layers read their TP group from, and the
``MoE.set_deepspeed_parallelism``      EP/EDP group creation, for a model used without an engine
ZeRO-1/2 optimizer ``bit16_groups``,   an MoE checkpoint of another EP / DP size: each parameter's Adam
``single_partition_of_fp32_groups``,   moments written into the run's flat partitions by name
param ``_hp_mapping`` fragment         (``megatron/checkpointing/relayout_moe.py``)
addresses, base ``optimizer.state``
=====================================  =====================================================================
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch

logger = logging.getLogger(__name__)

TESTED_DEEPSPEED = "0.19.8"
"""The DeepSpeed release the internals below were written and tested against."""
ALLOW_UNTESTED_ENV = "TRIDENT_ALLOW_UNTESTED_DEEPSPEED"

_checked = False


class DeepSpeedVersionError(ValueError):
    """The installed DeepSpeed is not the release Trident is tested with."""


def check_deepspeed_version(installed: str | None = None) -> None:
    """Refuse (or, with ``TRIDENT_ALLOW_UNTESTED_DEEPSPEED=1``, warn about) a DeepSpeed other than
    :data:`TESTED_DEEPSPEED`.

    Args:
        installed: the version to check (default: the installed ``deepspeed.__version__``).

    Raises:
        DeepSpeedVersionError: one line naming both versions and the fix.
    """
    global _checked
    if installed is None:
        if _checked:
            return
        import deepspeed

        installed = str(deepspeed.__version__)
    if installed.split("+")[0] == TESTED_DEEPSPEED:
        _checked = True
        return
    message = (
        f"DeepSpeed {installed} is installed, but Trident is tested with DeepSpeed {TESTED_DEEPSPEED} and relies "
        "on internals of it (megatron/deepspeed_internals.py); install it with pip install "
        f"deepspeed=={TESTED_DEEPSPEED} (as requirements.txt pins), or set {ALLOW_UNTESTED_ENV}=1 to try "
        "this version anyway."
    )
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        logger.warning("%s (%s=1: continuing)", message, ALLOW_UNTESTED_ENV)
        _checked = True
        return
    raise DeepSpeedVersionError(message)


def set_default_group_timeout(timeout: timedelta) -> None:
    """Make ``timeout`` the timeout of every process group created from now on without one (process-wide).

    DeepSpeed creates groups of its own (the pipeline grid's stage, data, slice and p2p groups in
    ``runtime/pipe/topology.py``; ``utils/groups.py``) through ``deepspeed.comm.new_group(ranks)``, which takes no
    timeout; torch then uses ``distributed_c10d.default_pg_timeout`` (30 minutes; ``default_pg_nccl_timeout``, 10,
    for NCCL), read at each ``new_group`` call.
    """
    import torch.distributed.distributed_c10d as c10d

    check_deepspeed_version()
    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
        c10d.default_pg_nccl_timeout = timeout


def skip_cpu_shm_build() -> None:
    """Keep DeepSpeed from JIT-building its shared-memory all-reduce op on CPU (used only by its inference)."""
    check_deepspeed_version()
    comm_torch: Any = importlib.import_module("deepspeed.comm.torch")
    comm_torch.build_shm_op = lambda: None


def patch_moe_gather_tokens(gather_first: Callable[..., torch.Tensor]) -> None:
    """Make DeepSpeed-MoE's token all-gather over TP work on gloo.

    0.19.8's ``moe.mappings._gather_tokens`` all-gathers into a FLAT buffer (``all_gather_into_tensor``), which gloo
    refuses ("invalid tensor size"); this one gathers ``[n, ...]`` shards into ``[p*n, ...]`` with ``gather_first``
    (``mpu.mappings.all_gather_first_dim`` on DeepSpeed's TP group), then concatenates along ``dim`` as DeepSpeed
    does. The same values on NCCL. Idempotent.
    """
    check_deepspeed_version()
    mappings: Any = importlib.import_module("deepspeed.moe.mappings")
    if getattr(mappings._gather_tokens, "_trident", False):
        return
    bwc: Any = importlib.import_module("deepspeed.utils.bwc")
    groups: Any = importlib.import_module("deepspeed.utils.groups")

    def gather_tokens(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
        world = bwc.bwc_tensor_model_parallel_world_size(groups.mpu)
        if world == 1:
            return input_
        group = bwc.bwc_tensor_model_parallel_group(groups.mpu)
        gathered = gather_first(input_.contiguous(), group)  # p x [n, ...] -> [p*n, ...]
        return torch.cat(gathered.chunk(world, dim=0), dim=dim).contiguous()

    gather_tokens._trident = True  # type: ignore[attr-defined]
    mappings._gather_tokens = gather_tokens


def set_moe_mpu(mpu: Any) -> None:
    """Give DeepSpeed's MoE layers our ``mpu`` (the engine does this itself; for a model used without one)."""
    import deepspeed

    groups: Any = importlib.import_module("deepspeed.utils.groups")
    if groups.mpu is None:
        groups.mpu = mpu
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed()  # wraps the torch.distributed job that already runs


def keep_fp32_clip_norm(engine: Any) -> None:
    """Make the plain fp32 ZeRO-0 path remember the grad norm it clips with.

    DeepSpeed 0.19.8's ``clip_fp32_gradients`` (fp32, ZeRO-0, clipping on) computes the global norm with
    ``runtime.utils.clip_grad_norm_`` and throws it away, so ``get_global_grad_norm()`` stays None there. This
    instance-level wrapper makes the same call and keeps the result; nothing else changes.
    """
    check_deepspeed_version()
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_and_keep() -> None:
        norm = clip_grad_norm_(
            parameters=engine.module.parameters(),
            max_norm=engine.gradient_clipping(),
            mpu=engine.mpu,
        )
        engine._global_grad_norm = norm

    engine.clip_fp32_gradients = clip_and_keep


def skip_single_rank_allreduce(engine: Any) -> bool:
    """Turn off the engine's post-backward gradient all-reduce where it reduces over one rank; True if it did.

    Without ZeRO (stage 0) and without a pipeline, DeepSpeed 0.19.8 flattens every gradient into a bucket,
    all-reduces it over the sequence-data-parallel group, scales it by ``gradient_predivide_factor / DP`` and copies
    it back, even when that group is this rank alone: at DP = 1 (and no Ulysses) a bitwise identity that costs a
    parameter-sized copy out and back every step (~2 % of a small CPU step). Skipped only there, with
    ``gradient_predivide_factor`` 1 (so no scaling is skipped); ZeRO 1-3 keep theirs (their reduce also fills the
    partitioned fp32 buffers), and so does the pipeline engine (its own reduce step, with the tied weights), and so
    does a model with MoE layers: its expert gradients are all-reduced over the expert-data-parallel groups, which
    span the TP ranks too (each TP rank routes its own slice of the tokens), so they are not one rank at DP = 1.
    """
    check_deepspeed_version()
    single = (
        not hasattr(engine, "pipeline_enable_backward_allreduce")  # PipelineEngine's attribute
        and not engine.has_moe_layers
        and engine.zero_optimization_stage() == 0
        and engine.seq_dp_world_size == 1
        and float(engine.gradient_predivide_factor()) == 1.0
    )
    if single:
        engine.enable_backward_allreduce = False
    return single


def loss_scale(engine: Any) -> float:
    """The current fp16 loss scale of the engine's optimizer (1.0 when it has none)."""
    opt = getattr(engine, "optimizer", None)
    for attr in ("cur_scale", "loss_scale"):
        value = getattr(opt, attr, None)
        if isinstance(value, (int, float, torch.Tensor)):
            return float(value)
    return 1.0


def share_rng_tracker(tracker: Any) -> None:
    """Make ``tracker`` the one ``deepspeed.checkpointing.get_cuda_rng_tracker()`` returns (one tracker, not two).

    DeepSpeed's checkpoint saves ``get_cuda_rng_tracker().get_states()`` before the forward and restores them for
    the recomputation; only ``get_states`` / ``set_states`` are called on it, which Trident's tracker has.

    Raises:
        RuntimeError: DeepSpeed still returns another tracker (its module changed).
    """
    import deepspeed

    deepspeed.checkpointing._CUDA_RNG_STATE_TRACKER = tracker
    if deepspeed.checkpointing.get_cuda_rng_tracker() is not tracker:
        raise RuntimeError(
            f"deepspeed.checkpointing.get_cuda_rng_tracker() ignores _CUDA_RNG_STATE_TRACKER in DeepSpeed "
            f"{deepspeed.__version__}; --deepspeed-activation-checkpointing needs DeepSpeed {TESTED_DEEPSPEED}."
        )


def wrap_pipe_instructions(
    engine: Any, wrap: Callable[[Callable[..., Any], type], Callable[..., Any]]
) -> None:
    """Replace, on this pipeline engine only, each instruction handler ``fn`` of its 1F1B schedule by
    ``wrap(fn, instruction_class)`` (``_exec_schedule`` looks handlers up in ``self._INSTRUCTION_MAP``; an instance
    attribute shadows the class table)."""
    table = dict(type(engine)._INSTRUCTION_MAP)
    engine._INSTRUCTION_MAP = {instr: wrap(fn, instr) for instr, fn in table.items()}


def is_zero3_partitioned(param: torch.Tensor) -> bool:
    """True for a parameter ZeRO-3 partitioned (its data is a placeholder outside ``GatheredParameters``)."""
    return hasattr(param, "ds_id")


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's full shape (ZeRO-3 keeps it in ``ds_shape``)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def per_parameter_masters(optimizer: Any) -> dict[int, torch.Tensor]:
    """``id(parameter) -> fp32 master`` for DeepSpeed's unfused low-precision optimizer (ZeRO-0 with --bf16)."""
    low, high = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    if not isinstance(low, list) or not isinstance(high, list):
        return {}
    out = {}
    for low_group, high_group in zip(low, high, strict=False):
        if isinstance(low_group, list) and isinstance(high_group, list):
            out.update({id(lp): hp for lp, hp in zip(low_group, high_group, strict=False)})
    return out


def set_linked_master(param: torch.Tensor, fp32: torch.Tensor) -> bool:
    """Write ``fp32`` into the master copy DeepSpeed links to ``param`` (ZeRO-1/2, bf16 optimizer); False when
    there is no such link."""
    if not hasattr(param, "_hp_mapping"):
        return False
    param.set_full_hp_param(fp32)  # type: ignore[attr-defined]
    return True


def refresh_master_copy(optimizer: Any) -> None:
    """Re-read the optimizer's fp32 master copy from the parameters, where DeepSpeed keeps one."""
    refresh = getattr(optimizer, "refresh_fp32_params", None)
    if callable(refresh):
        refresh()


def zero_checkpoint_classes() -> list[Any]:
    """The DeepSpeed classes pickled inside ZeRO checkpoint files (to allow-list for a weights-only load)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def ds_to_universal(input_folder: str, output_folder: str, *, workers: int) -> None:
    """Run DeepSpeed's universal-checkpoint converter on one tag directory.

    Raises:
        AssertionError: DeepSpeed refused the checkpoint (its checks are assertions).
    """
    check_deepspeed_version()
    from deepspeed.checkpoint import ds_to_universal as converter

    main: Callable[[argparse.Namespace], None] = converter.main
    main(
        argparse.Namespace(
            input_folder=input_folder,
            output_folder=output_folder,
            num_extract_workers=workers,
            num_merge_workers=workers,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=False,
        )
    )


@contextlib.contextmanager
def loading_universal(engine: Any, param_groups: list[dict[str, Any]]) -> Iterator[None]:
    """Make ``engine.load_checkpoint`` read a universal checkpoint while the block runs (the ``load_universal``
    of its DeepSpeed config, read by the engine at load time only), then restore the setting.

    ``param_groups``: the saved optimizer groups (``zero/optimizer_state.pt``). ZeRO-3's universal loader copies
    the FIRST group's settings into every group (weight decay 0.01 onto the no-decay group of biases and norms);
    under ZeRO-3 each group gets its own saved settings back, as a regular load gives them, and each sub-group its
    own Adam step tensor."""
    check_deepspeed_version()
    config: Any = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = before
    if int(engine.zero_optimization_stage()) == 3:
        optimizer: Any = getattr(engine.optimizer, "optimizer", engine.optimizer)
        for group, saved in zip(optimizer.param_groups, param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        # It also gives every sub-group the SAME step tensor, which each sub-group's step then increments (the
        # second sub-group's Adam bias correction would count two steps per iteration): one tensor each.
        for state in optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def hold_optimizer_steps(engine: Any, before: Callable[[], None]) -> None:
    """Call ``before()`` at the start of every optimizer step of ``engine`` (its ``optimizer.step``, which both
    engines, plain and pipeline, call once per global batch, wrapped on the instance; idempotent). Between two
    such steps DeepSpeed changes no parameter or optimizer state in place (forward and backward write
    activations and gradients only), which is what lets --async-save copy them while they run."""
    check_deepspeed_version()
    opt: Any = getattr(engine, "optimizer", None)
    if opt is None or getattr(opt.step, "_trident_hold", False):
        return
    step = opt.step

    def held(*args: Any, **kwargs: Any) -> Any:
        before()
        return step(*args, **kwargs)

    held._trident_hold = True  # type: ignore[attr-defined]
    opt.step = held


@contextlib.contextmanager
def checkpoint_saves_through(engine: Any, save: Callable[[Any, str, bool], None]) -> Iterator[bool]:
    """Route every file ``engine.save_checkpoint`` writes to ``save(state_dict, path, zipfile_serialization)``
    instead of its checkpoint engine's ``torch.save``; yields False (and routes nothing) when the engine is not
    DeepSpeed's plain ``TorchCheckpointEngine`` (Nebula, decoupled and fast engines write asynchronously)."""
    check_deepspeed_version()
    ce: Any = getattr(engine, "checkpoint_engine", None)
    if type(ce).__name__ != "TorchCheckpointEngine":
        yield False
        return
    zipped = bool(getattr(ce, "zipfile_serialization", True))
    ce.save = lambda state_dict, path: save(state_dict, path, zipped)
    try:
        yield True
    finally:
        del ce.save


def set_zero_partition_states(
    optimizer: Any,
    state_of: Callable[[torch.nn.Parameter], dict[str, torch.Tensor] | None],
    step: Any,
) -> int:
    """ZeRO-1/2: the base optimizer's state of every flat fp32 partition of ``optimizer`` (a
    ``DeepSpeedZeroOptimizer``), built from whole per-parameter tensors: ``state_of(param)`` gives e.g.
    ``{"exp_avg": t, "exp_avg_sq": t}`` shaped like the parameter (None: zeros), ``step`` the Adam step every
    partition takes. Each parameter's slice of this rank's partition is copied from its ``_hp_mapping`` fragment
    addresses (where in the parameter, where in the partition). Returns the parameters given a state."""
    count = 0
    groups = zip(optimizer.single_partition_of_fp32_groups, optimizer.bit16_groups, strict=True)
    for partition, params in groups:
        buffers: dict[str, torch.Tensor] = {}
        for param in params:
            mapping = getattr(param, "_hp_mapping", None)
            full = state_of(param) if mapping is not None else None
            if mapping is None or full is None:
                continue
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            for key, value in full.items():
                buffer = buffers.setdefault(key, torch.zeros_like(partition))
                # [numel of the param] -> [this rank's fragment], at its place in the partition
                piece = value.reshape(-1).narrow(0, lp.start, lp.numel)
                buffer.narrow(0, hp.start, hp.numel).copy_(piece)
            count += 1
        if buffers:
            s = step.clone() if isinstance(step, torch.Tensor) else step
            optimizer.optimizer.state[partition] = {"step": s, **buffers}
    return count
