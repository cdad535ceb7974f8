"""LoRA adapters on the model's tensor-parallel linears: building them, freezing the base, naming them.

Legend: ``h`` input features, ``o`` output features, ``r`` LoRA rank, ``p`` TP size.

Each targeted linear (``--lora-target-modules``, ``megatron.config.lora.LORA_TARGETS``) gets two parameters,
state-dict keys ``<linear>.lora_a`` and ``<linear>.lora_b`` (e.g.
``language_model.encoder.layers.0.self_attention.query_key_value.lora_a``); the forward is
``megatron/mpu/lora.py``'s. Full (TP-merged) shapes ``lora_a [r, h]``, ``lora_b [o, r]``; how they split::

    column-parallel (qkv, fc1)   lora_a [r, h]      replicated    lora_b [o/p, r]  dim 0, the weight's stride
    row-parallel (dense, fc2)    lora_a [r, h/p]    dim 1         lora_b [o, r]    replicated

Initialization does not depend on the layout: the FULL ``lora_a`` is drawn from ``param_seed(seed, name)`` (its
global name) as ``U(-1/sqrt(h), 1/sqrt(h))`` (PEFT's default, kaiming-uniform with a = sqrt(5)) and split;
``lora_b`` starts at zero, so a fresh adapter leaves the base model's output unchanged.

With ``--lora-rank 0`` nothing is built: no parameter, no state-dict key, one ``is None`` test per linear forward.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megatron.config.lora import LoraConfig
from megatron.mpu.context import ParallelContext
from megatron.mpu.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
    shard_master_weight,
)
from megatron.mpu.lora import LoraSpec
from megatron.mpu.random import param_seed

LORA_PARAMETER_SUFFIXES = (".lora_a", ".lora_b")
"""State-dict keys of the adapters end so (in both the ``GPTModel`` and the ``GPTModelPipe`` naming)."""


def is_lora_parameter(name: str) -> bool:
    """Whether the parameter/state-dict key ``name`` is a LoRA adapter."""
    return name.endswith(LORA_PARAMETER_SUFFIXES)


def full_lora_a(seed: int, name: str, rank: int, in_features: int) -> torch.Tensor:
    """The initial FULL ``lora_a [r, h]`` (fp32) of the adapter whose ``lora_a`` is called ``name`` globally."""
    bound = 1.0 / math.sqrt(in_features)
    generator = torch.Generator().manual_seed(param_seed(seed, name))
    full = torch.empty(rank, in_features, dtype=torch.float32)
    return full.uniform_(-bound, bound, generator=generator)


def add_lora(
    linear: ColumnParallelLinear | RowParallelLinear,
    lora: LoraConfig,
    *,
    name: str,
    parallel: ParallelContext,
) -> None:
    """Give ``linear`` its adapter: registers ``lora_a`` and ``lora_b`` and sets ``linear.lora``.

    Args:
        linear: a TP linear of the model (its group, stride, dtype and device are the adapter's).
        lora: ``--lora-rank``, ``--lora-alpha``, ``--lora-dropout``.
        name: the linear's global Megatron name (``language_model.encoder.layers.0.self_attention.dense``).
        parallel: the model's context: the TP rank and size (those ``linear`` was built with) and the seed
            (``lora_a`` is drawn from ``param_seed(parallel.seed, name + ".lora_a")``).
    """
    r, world, rank = lora.lora_rank, parallel.tp_size, parallel.tp_rank
    dtype, device = linear.weight.dtype, linear.weight.device
    full_a = full_lora_a(parallel.seed, f"{name}.lora_a", r, linear.input_size)  # [r, h]
    if isinstance(linear, ColumnParallelLinear):
        a, a_layout = full_a, (False, -1, 1)
        b_rows, b_layout = linear.output_size_per_partition, (True, 0, linear.stride)
    else:
        a = shard_master_weight(full_a, 1, linear.stride, rank, world)  # [r, h] -> [r, h/p]
        a_layout = (True, 1, linear.stride)
        b_rows, b_layout = linear.output_size, (False, -1, 1)
    lora_a = nn.Parameter(a.to(dtype=dtype, device=device))
    lora_b = nn.Parameter(torch.zeros(b_rows, r, dtype=dtype, device=device))
    set_tensor_model_parallel_attributes(lora_a, *a_layout)
    set_tensor_model_parallel_attributes(lora_b, *b_layout)
    linear.register_parameter("lora_a", lora_a)
    linear.register_parameter("lora_b", lora_b)
    linear.lora = LoraSpec(rank=r, scaling=lora.scaling, dropout=lora.lora_dropout)


def maybe_add_lora(
    linear: ColumnParallelLinear | RowParallelLinear,
    lora: LoraConfig,
    target: str,
    *,
    name: str,
    parallel: ParallelContext,
) -> None:
    """:func:`add_lora` when ``target`` (``qkv``, ``dense``, ``fc1``, ``fc2``) is one of ``--lora-target-modules``."""
    if lora.targets(target):
        add_lora(linear, lora, name=name, parallel=parallel)


def freeze_base(model: nn.Module) -> tuple[int, int]:
    """Make every parameter but the LoRA adapters ``requires_grad=False``.

    Returns:
        ``(trainable, frozen)`` element counts of this rank's parameters.

    Raises:
        ValueError: the model has no adapter (``--lora-rank`` 0, or no targeted linear on this stage).
    """
    trainable = frozen = 0
    for pname, param in model.named_parameters():
        param.requires_grad_(is_lora_parameter(pname))
        if param.requires_grad:
            trainable += param.numel()
        else:
            frozen += param.numel()
    if trainable == 0:
        raise ValueError(
            "freeze_base: the model has no LoRA adapter to train; build it with --lora-rank > 0 and "
            "--lora-target-modules naming linears this pipeline stage holds."
        )
    return trainable, frozen
