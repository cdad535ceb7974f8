"""GPT/LLaMA model on the tensor-parallel ``megatron.mpu`` layers, ``[s, b, h]`` layout, Megatron names.

- :class:`GPTModel`: whole model on one stage (no pipeline; the ZeRO-2/3 path).
- :class:`GPTModelPipe`: the same model as a DeepSpeed ``PipelineModule`` (pipeline + ZeRO-0/1).
- :func:`loss_func`: masked mean of a per-token loss.
- :func:`num_parameters`; :mod:`megatron.model.presets` (flag lists).
- :class:`InferenceParams`: the KV cache ``GPTModel`` takes for generation.

Parameter names and how each parameter is split over TP/PP: :mod:`megatron.layout`; the padded vocabulary:
:func:`megatron.config.rules.padded_vocab_size`.
"""

from megatron.model import presets
from megatron.model.gpt_model import GPTModel
from megatron.model.gpt_model_pipe import GPTModelPipe, pipe_loss_fn
from megatron.model.inference import InferenceParams
from megatron.model.utils import loss_func, num_parameters

__all__ = [
    "GPTModel",
    "GPTModelPipe",
    "InferenceParams",
    "loss_func",
    "num_parameters",
    "pipe_loss_fn",
    "presets",
]
