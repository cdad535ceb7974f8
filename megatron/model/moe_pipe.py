"""How an MoE model's loss term crosses DeepSpeed's pipeline stages (``GPTModelPipe`` with ``--num-experts``).

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``vp`` vocab / TP.

Megatron-DeepSpeed's way, kept: the running MoE loss travels WITH the activations, as a third pipe tensor::

    layer 0:          (hidden, position_ids)            -> (hidden, position_ids, moe_loss [1] fp32)
    layer i > 0:      (hidden, position_ids, moe_loss)  -> (hidden, position_ids, moe_loss + coeff * l_aux_i)
    final norm:       (hidden, position_ids, moe_loss)  -> (hidden, moe_loss)
    output layer:     (hidden, moe_loss)                -> (logits [s, b, vp], moe_loss)
    loss_fn:          LM loss + moe_loss

With packed documents (``--reset-attention-mask``) the integer ``document_ids`` travel between ``position_ids`` and
``moe_loss`` (``gpt_model_pipe.py``); the layers tell them apart by dtype.

DeepSpeed's pipeline engine sends every floating-point pipe tensor forward and its gradient back, so the gate of a
layer on stage 0 receives the gradient of the MoE term computed on the last stage through the same 1F1B schedule as
the hidden states (the loss scale and 1/gas scaling included). A dense layer (or a stage with no MoE layer) passes
the running sum on unchanged. ``GPTModelPipe`` records each micro-batch's MoE term for the log (``record_moe_loss``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron.model.moe import MoEMLP


def add_layer_moe_loss(
    mlp: nn.Module, running: torch.Tensor | None, hidden: torch.Tensor
) -> torch.Tensor:
    """The running MoE loss ``[1]`` fp32 after a layer whose MLP is ``mlp`` (``running`` None: the first layer).

    Layer 0 starts it at 0 (a leaf that requires grad, so the pipeline engine treats it as an activation).
    """
    if running is None:
        running = torch.zeros(1, dtype=torch.float32, device=hidden.device, requires_grad=True)
    if isinstance(mlp, MoEMLP) and mlp.last_aux_loss is not None:
        return running + mlp.loss_coeff * mlp.last_aux_loss.float().reshape(1)
    # a new tensor: the engine differentiates stage outputs, not its input buffers
    return running * 1.0


def with_moe_loss(hidden: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> Any:
    """``hidden`` alone for a dense model's pipe tuple ``(hidden, position_ids[, document_ids])``;
    ``(hidden, moe_loss)`` when ``inputs`` carries one (the only floating-point tensor after ``position_ids``)."""
    moe_loss = next((t for t in inputs[2:] if t.is_floating_point()), None)
    return hidden if moe_loss is None else (hidden, moe_loss)


def record_moe_loss(
    moe_loss: torch.Tensor, record: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """The MoE term of one micro-batch as a scalar, appended (detached) to ``record`` for the log."""
    value = moe_loss.reshape(())
    if record is not None:
        record.append(value.detach())
    return value
