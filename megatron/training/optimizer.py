"""The torch optimizer handed to DeepSpeed, with Megatron's parameter groups.

Megatron's groups: no weight decay for biases and for every 1-D parameter (norm weights), decay for the rest.
``--optimizer adam`` is ``torch.optim.AdamW`` (decoupled weight decay, like apex FusedAdam's default on CUDA);
``--optimizer sgd`` is ``torch.optim.SGD`` with ``--sgd-momentum``. A torch optimizer means no DeepSpeed op is
compiled, on CPU or GPU. The LR in the groups is overwritten every iteration by the schedule.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.config import TrainingConfig


def no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's rule: biases and 1-D parameters (norm weights) get no weight decay."""
    return name.endswith(".bias") or param.dim() == 1


def get_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups (decay, no decay), each holding parameters in ``named_parameters`` order; empty groups dropped.

    Every group carries ``wd_mult`` and ``lr_mult`` like Megatron's; trainable parameters only.
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
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, t: TrainingConfig) -> torch.optim.Optimizer:
    """AdamW or SGD over :func:`get_param_groups` of ``model``.

    Raises:
        ValueError: the model has no trainable parameter.
    """
    groups = get_param_groups(model, t.weight_decay)
    if not groups:
        raise ValueError("the model has no trainable parameters; nothing to optimize.")
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr, momentum=t.sgd_momentum)
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
