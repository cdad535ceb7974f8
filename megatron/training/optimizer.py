"""The torch optimizer handed to DeepSpeed, with Megatron's parameter groups.

Megatron's groups: no weight decay for biases and for every 1-D parameter (norm weights), decay for the rest.
``--optimizer adam`` is ``torch.optim.AdamW`` (decoupled weight decay, like apex FusedAdam's default on CUDA);
``--optimizer sgd`` is ``torch.optim.SGD`` with ``--sgd-momentum``. A torch optimizer means no DeepSpeed op is
compiled, on CPU or GPU. The LR in the groups is overwritten every iteration by the schedule.

``--cpu-optimizer`` (Megatron-DeepSpeed's flag; Adam only, ZeRO >= 1): the fp32 master weights and Adam's moments live
on the CPU (the DeepSpeed config gets ``zero_optimization.offload_optimizer.device = "cpu"``) and the step runs
there, in DeepSpeed's ``DeepSpeedCPUAdam`` (AdamW mode, the same update as ``torch.optim.AdamW``), or with
``--cpu_torch_adam`` in ``torch.optim.AdamW`` itself. DeepSpeed's CPU Adam is a C++ op that ninja builds at first
use into ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions/py311_cpu``; ``_cuXXX`` with a CUDA
torch), then loads from there. Race-free: every rank of a node calls the build at once; torch's JIT loader takes
an ``O_CREAT | O_EXCL`` lock file in the op's build directory, one rank compiles while the others wait for the lock
to go, then all load the same library. Nothing is assumed shared between nodes: each node builds into its own
directory (or, on a shared home, waits on the same lock). A lock left by a build that was killed would make every
later run wait forever, so a lock older than :data:`STALE_LOCK_SECONDS` is reported as an error instead. A failed
build is one ``ConfigError`` line naming the cause and the fixes.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from megatron.config import TrainingConfig
from megatron.deepspeed_internals import full_shape
from megatron.launch.exit_codes import ConfigError

logger = logging.getLogger(__name__)

STALE_LOCK_SECONDS = 30 * 60
"""A build lock this old is left over from a killed build (the op compiles in about a minute)."""


def no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's rule: biases and 1-D parameters (norm weights) get no weight decay (by the full shape: a ZeRO-3
    parameter built inside ``zero.Init`` holds a 1-D placeholder)."""
    return name.endswith(".bias") or len(full_shape(param)) == 1


def get_param_groups(
    model: torch.nn.Module, weight_decay: float, *, moe_groups: bool = False
) -> list[dict[str, Any]]:
    """Two groups (decay, no decay), each holding parameters in ``named_parameters`` order; empty groups dropped.

    Every group carries ``wd_mult`` and ``lr_mult`` like Megatron's; trainable parameters only.
    ``moe_groups`` (--create-moe-param-group): DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer``
    then moves the expert parameters into groups of their own (``moe: True``, named by their expert-parallel group),
    each keeping its decay setting; DeepSpeed's ZeRO optimizer needs them.
    """
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if no_weight_decay(name, param) else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0, "lr_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0, "lr_mult": 1.0},
    ]
    if moe_groups:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        named = [{**g, "name": n} for g, n in zip(groups, ("decay", "no_decay"), strict=True)]
        groups = split_params_into_different_moe_groups_for_optimizer(named)
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: torch.nn.Module, t: TrainingConfig, *, moe_groups: bool = False
) -> torch.optim.Optimizer:
    """AdamW or SGD over :func:`get_param_groups` of ``model`` (``moe_groups``: experts in groups of their own); with ``--cpu-optimizer`` DeepSpeed's CPU Adam (AdamW
    mode), or torch's AdamW with ``--cpu_torch_adam`` (DeepSpeed's ZeRO offload moves the master weights to CPU).

    Raises:
        ValueError: the model has no trainable parameter.
        ConfigError: DeepSpeed's CPU Adam op cannot be built or loaded (one line: the cause and the fixes).
    """
    groups = get_param_groups(model, t.weight_decay, moe_groups=moe_groups)
    if not groups:
        raise ValueError("the model has no trainable parameters; nothing to optimize.")
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr, momentum=t.sgd_momentum)
    betas = (t.adam_beta1, t.adam_beta2)
    if t.cpu_optimizer and not t.cpu_torch_adam:
        load_cpu_adam_op()
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        cpu_adam: torch.optim.Optimizer = DeepSpeedCPUAdam(
            groups, lr=t.lr, betas=betas, eps=t.adam_eps, adamw_mode=True
        )
        return cpu_adam
    # torch's fused AdamW kernel (CUDA: one launch per step; CPU: one vectorized pass, ~5 % of a small model's
    # step here), the same update as the default; DeepSpeed's ZeRO wrappers step it on their flat fp32
    # partitions like any torch optimizer. It needs every parameter on one device type.
    one_device = len({p.device.type for g in groups for p in g["params"]}) == 1
    return torch.optim.AdamW(
        groups, lr=t.lr, betas=betas, eps=t.adam_eps, fused=True if one_device else None
    )


def cpu_adam_build_dir() -> Path:
    """Where torch's JIT loader builds DeepSpeed's ``cpu_adam`` op (``$TORCH_EXTENSIONS_DIR/cpu_adam`` or under the
    default ``~/.cache/torch_extensions/py<ver>_<cpu|cuXXX>``)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root) / "cpu_adam"
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory("cpu_adam", verbose=False))


def load_cpu_adam_op() -> Any:
    """Build (first use on this node) or load DeepSpeed's ``cpu_adam`` C++ op; returns the loaded module.

    Every rank calls this at once; torch's lock file in :func:`cpu_adam_build_dir` lets one rank compile while the
    others wait (module docstring).

    Raises:
        ConfigError: a stale lock file, or the build/load failed (the first line of the cause; ``ninja -C`` on the
            build directory shows the compiler's output).
    """
    build_dir = cpu_adam_build_dir()
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        age = 0.0
    if age > STALE_LOCK_SECONDS:
        raise ConfigError(
            f"--cpu-optimizer: the build lock {lock} is {age / 60:.0f} minutes old, left by a build of DeepSpeed's "
            "CPU Adam that was killed; delete that file (no build is running) and start again."
        )
    start = time.perf_counter()
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        op = CPUAdamBuilder().load(verbose=False)
    except Exception as err:  # noqa: BLE001 - ninja/compiler/import failures of every kind become one line
        cause = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise ConfigError(
            f"--cpu-optimizer: DeepSpeed's CPU Adam op could not be built or loaded in {build_dir} ({cause}); "
            f"install ninja and a C++ compiler (see the compiler's output with: ninja -C {build_dir}), or use "
            "--cpu_torch_adam (torch's AdamW on the CPU, nothing to compile)."
        ) from None
    logger.debug(
        "DeepSpeed's cpu_adam op ready in %.1f s (%s)", time.perf_counter() - start, build_dir
    )
    return op
