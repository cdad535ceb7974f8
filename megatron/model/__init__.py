"""GPT/LLaMA model on the tensor-parallel ``megatron.mpu`` layers, ``[s, b, h]`` layout, Megatron names.

- :class:`GPTModel`: whole model on one stage (no pipeline; the ZeRO-2/3 path).
- :class:`GPTModelPipe`: the same model as a DeepSpeed ``PipelineModule`` (pipeline + ZeRO-0/1).
- :func:`loss_func`: masked mean of a per-token loss.
- :func:`padded_vocab_size`, :func:`num_parameters`; :mod:`megatron.model.presets` (flag lists).
- :func:`universal_checkpoint_info`, :func:`param_layout`: TP/PP layout of every parameter by name.
- :class:`InferenceParams`: the KV cache ``GPTModel`` takes for generation.
"""

from megatron.model import presets
from megatron.model.checkpoint_info import param_layout, universal_checkpoint_info
from megatron.model.gpt_model import GPTModel
from megatron.model.gpt_model_pipe import GPTModelPipe, pipe_loss_fn, pipe_to_megatron_name
from megatron.model.inference import InferenceParams
from megatron.model.utils import loss_func, num_parameters, padded_vocab_size

__all__ = [
    "GPTModel",
    "GPTModelPipe",
    "InferenceParams",
    "loss_func",
    "num_parameters",
    "padded_vocab_size",
    "param_layout",
    "pipe_loss_fn",
    "pipe_to_megatron_name",
    "presets",
    "universal_checkpoint_info",
]
