"""Checkpoint weight mappings: Hugging Face GPT-2/LLaMA <-> Megatron names, TP/PP resharding, safe loading.

Pure functions over ``{name: tensor}`` dicts of the full (TP=1, PP=1) model; the DeepSpeed save/load code and the
``tools/`` converters are thin layers over them.
"""

from megatron.checkpointing.hf_gpt2 import gpt2_hf_to_megatron, megatron_to_gpt2_hf
from megatron.checkpointing.hf_llama import llama_hf_to_megatron, megatron_to_llama_hf
from megatron.checkpointing.layout import fuse_qkv, padded_vocab_size, repad_vocab, split_qkv
from megatron.checkpointing.pipe_layout import (
    megatron_to_pipe_layers,
    pipe_layer_file_name,
    pipe_layer_key,
    pipe_layers_to_megatron,
)
from megatron.checkpointing.reshard import (
    merge_tp_shards,
    pad_vocab_for_tp,
    shard_state_dict,
    split_layers_for_pp,
    tp_partition,
)
from megatron.checkpointing.safe_load import load_hf_directory, load_state_dict_file
from megatron.checkpointing.verify import LogitComparison, compare_logits

__all__ = [
    "LogitComparison",
    "compare_logits",
    "fuse_qkv",
    "gpt2_hf_to_megatron",
    "llama_hf_to_megatron",
    "load_hf_directory",
    "load_state_dict_file",
    "megatron_to_gpt2_hf",
    "megatron_to_llama_hf",
    "megatron_to_pipe_layers",
    "merge_tp_shards",
    "pad_vocab_for_tp",
    "padded_vocab_size",
    "pipe_layer_file_name",
    "pipe_layer_key",
    "pipe_layers_to_megatron",
    "repad_vocab",
    "shard_state_dict",
    "split_layers_for_pp",
    "split_qkv",
    "tp_partition",
]
