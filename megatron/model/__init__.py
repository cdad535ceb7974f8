"""GPT/LLaMA model on the tensor-parallel ``megatron.mpu`` layers, ``[s, b, h]`` layout, Megatron names.

- :class:`GPTModel`: whole model on one stage (no pipeline; the ZeRO-2/3 path).
- :class:`GPTModelPipe`: the same model as a DeepSpeed ``PipelineModule`` (pipeline + ZeRO-0/1); it and
  :func:`pipe_loss_fn` are imported on first use (``megatron.model.gpt_model_pipe``), so this package and the
  whole-model path import without DeepSpeed (GPU kernel and model tests run where DeepSpeed does not import).
- :func:`loss_func`: masked mean of a per-token loss.
- :func:`num_parameters`; :mod:`megatron.model.presets` (flag lists).
- :class:`InferenceParams`: the KV cache ``GPTModel`` takes for generation.

Parameter names and how each parameter is split over TP/PP: :mod:`megatron.layout`; the padded vocabulary:
:func:`megatron.config.rules.padded_vocab_size`.
"""

from __future__ import annotations

from typing import Any

from megatron.model import presets
from megatron.model.gpt_model import GPTModel
from megatron.model.inference import InferenceParams
from megatron.model.utils import loss_func, num_parameters

_PIPE_NAMES = ("GPTModelPipe", "pipe_loss_fn")

__all__ = [
    "GPTModel",
    "GPTModelPipe",
    "InferenceParams",
    "loss_func",
    "num_parameters",
    "pipe_loss_fn",
    "presets",
]


def __getattr__(name: str) -> Any:
    """``GPTModelPipe`` and ``pipe_loss_fn`` on first use: their module imports ``deepspeed.pipe``."""
    if name in _PIPE_NAMES:
        from megatron.model import gpt_model_pipe

        return getattr(gpt_model_pipe, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
