"""Layout arithmetic: parameter names and how tensors are split over TP ranks and PP stages, as pure functions.

Nothing here builds a model, creates a process group or reads a file; the model, runtime checkpointing and the
offline conversions all use it.

- :mod:`~megatron.layout.names`: Megatron state-dict names, ``GPTModelPipe`` names and layer files.
- :mod:`~megatron.layout.qkv`: the fused QKV row layout (``fuse_qkv`` / ``split_qkv``).
- :mod:`~megatron.layout.vocab`: vocabulary re-padding of state dicts.
- :mod:`~megatron.layout.tensor_parallel`: which dim each parameter is split on; ``shard_state_dict`` /
  ``merge_tp_shards``.
- :mod:`~megatron.layout.pipeline`: layers per pipeline stage; Megatron <-> pipeline layer state dicts.
- :mod:`~megatron.layout.universal_info`: DeepSpeed's ``universal_checkpoint_info`` for this model.
- :mod:`~megatron.layout.experts`: DeepSpeed-MoE expert names, local <-> global expert ids per EP rank, their TP rule.
"""

from megatron.layout.names import (
    FINAL_NORM,
    OUTPUT_LAYER,
    POSITION_EMBEDDINGS,
    WORD_EMBEDDINGS,
    layer_param_name,
    layer_prefix,
    pipe_layer_file_name,
    pipe_layer_key,
    pipe_to_megatron_name,
)
from megatron.layout.pipeline import (
    megatron_to_pipe_layers,
    pipe_layers_to_megatron,
    split_layers_for_pp,
)
from megatron.layout.qkv import fuse_qkv, split_qkv
from megatron.layout.tensor_parallel import (
    merge_tp_shards,
    param_layout,
    shard_state_dict,
    tp_partition,
)
from megatron.layout.vocab import pad_vocab_for_tp, repad_vocab

__all__ = [
    "FINAL_NORM",
    "OUTPUT_LAYER",
    "POSITION_EMBEDDINGS",
    "WORD_EMBEDDINGS",
    "fuse_qkv",
    "layer_param_name",
    "layer_prefix",
    "megatron_to_pipe_layers",
    "merge_tp_shards",
    "pad_vocab_for_tp",
    "param_layout",
    "pipe_layer_file_name",
    "pipe_layer_key",
    "pipe_layers_to_megatron",
    "pipe_to_megatron_name",
    "repad_vocab",
    "shard_state_dict",
    "split_layers_for_pp",
    "split_qkv",
    "tp_partition",
]
