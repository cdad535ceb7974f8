"""ZeRO-3 construction: build ``GPTModel`` inside ``deepspeed.zero.Init`` so no rank ever holds the whole model.

Under ZeRO-3 without a pipeline (PP = 1, --zero-stage 3), :func:`zero3_init` wraps the model's construction.
DeepSpeed patches every ``nn.Module.__init__``; when one returns, that module's own parameters are split over the
data-parallel group (each rank keeps ``1/dp`` of every TP shard, on the device of
``zero_optimization.offload_param``: the accelerator, ``cpu`` or ``nvme``). A rank's peak during construction is
therefore its share of what is already built + the module being built (for a layer whose init draws a full fp32
master, that master too), never the whole model::

    rank r, dp 4:  embedding -> [1/4 kept] | layer 0 -> [1/4 kept] | layer 1 -> ... | output_layer -> [1/4 kept]
                   (full while its __init__ runs, then partitioned)

Layout-invariant init still holds: every parameter is drawn from ``(seed, global name)`` INSIDE its module's
``__init__`` (``megatron.mpu.layers``), so the values partitioned are exactly those built without ``zero.Init``. A
write to a parameter after its module's ``__init__`` returned would see a placeholder; none is left in
``megatron/model`` (the padded-vocabulary rows of the output layer are zeroed by its init method).

What we pass: ``data_parallel_group`` = our sequence-data-parallel group (``megatron.mpu``: the DP group, times the
Ulysses group under --ds-sequence-parallel-size, as the engine partitions over it), ``config_dict_or_path`` = the run's
DeepSpeed config (``offload_param`` gives the remote device, ``bf16`` the parameter dtype), ``mpu=megatron.mpu``
(the run's ``ParallelState``; DeepSpeed's config reads the DP size from it). ``tensor_overrides=[]``: DeepSpeed's default would also cast every
floating tensor created inside the context to the run's dtype, including the fp32 masters the init draws from,
which would change the drawn numbers under --bf16; the model is instead built directly in the run's dtype (the
fp32 draw is cast as the engine would) and on the run's device.

NVMe offload (``"device": "nvme"`` in ``offload_param`` or ``offload_optimizer``) needs DeepSpeed's ``async_io`` op,
which links libaio; :func:`check_nvme_offload` refuses it in one line where libaio is missing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from megatron.config import RunPlan
from megatron.mpu.parallel_state import ParallelState

_NVME_KEYS = ("offload_param", "offload_optimizer")


def uses_zero3_init(plan: RunPlan) -> bool:
    """The model is built inside ``deepspeed.zero.Init``: ZeRO-3 without the pipeline engine."""
    return plan.zero_stage == 3 and not plan.pipeline_engine


def zero3_params_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    """The dtype ZeRO-3 parameters have in the engine (what ``zero.Init`` must build): bf16, fp16 or fp32."""
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


@contextlib.contextmanager
def zero3_init(
    ds_config: dict[str, Any], state: ParallelState, *, params_dtype: torch.dtype
) -> Iterator[None]:
    """Context in which every module's parameters are partitioned over our DP group as its ``__init__`` returns.

    Args:
        ds_config: the run's DeepSpeed config (ZeRO-3; ``zero_optimization.offload_param`` sets the remote device).
        state: the run's model-parallel groups (``initialize_model_parallel``'s result).
        params_dtype: the dtype the model builds its parameters in (:func:`zero3_params_dtype`).
    """
    import deepspeed

    with deepspeed.zero.Init(
        # DP x Ulysses SP (= DP at sp 1): the group the engine shards ZeRO-3 parameters over.
        data_parallel_group=state.get_sequence_data_parallel_group(),
        config_dict_or_path=ds_config,
        mpu=state,
        dtype=params_dtype,
        tensor_overrides=[],
    ):
        yield


@functools.cache
def async_io_available() -> bool:
    """DeepSpeed's ``async_io`` op can be built here (a test program links ``io_submit`` from libaio)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def check_nvme_offload(ds_config: dict[str, Any], source: str) -> None:
    """Refuse ZeRO NVMe offload in one line where DeepSpeed's ``async_io`` op cannot be built.

    Raises:
        ValueError: ``zero_optimization.<offload_param|offload_optimizer>.device`` is ``nvme`` but libaio is
            missing (naming the key, the source and the fixes), or ``nvme_path`` is not set.
    """
    zero = ds_config.get("zero_optimization") or {}
    for key in _NVME_KEYS:
        section = zero.get(key)
        if not isinstance(section, dict) or section.get("device") != "nvme":
            continue
        if not section.get("nvme_path"):
            raise ValueError(
                f"{source} has zero_optimization.{key}.device = nvme but no nvme_path; add "
                f'"nvme_path": "/local/nvme" (a directory on a fast local disk) to zero_optimization.{key}.'
            )
        if not async_io_available():
            raise ValueError(
                f"{source} has zero_optimization.{key}.device = nvme, which needs DeepSpeed's async_io op, and "
                "it cannot be built here: libaio is missing; install it (Debian/Ubuntu: apt-get install "
                f'libaio-dev; RHEL: yum install libaio-devel) or set zero_optimization.{key}.device to "cpu".'
            )
