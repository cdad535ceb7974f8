"""Offline conversions of checkpoints, each verified by comparing logits with its source.

- :mod:`~megatron.conversion.hf_import` / :mod:`~megatron.conversion.hf_export`: Hugging Face GPT-2 / LLaMA /
  Mixtral <-> Trident (weight mappings in ``hf_gpt2``, ``hf_llama``, ``hf_mixtral``; tokenizers in ``hf_tokenizer``).
- :mod:`~megatron.conversion.megatron_ds`: Megatron-DeepSpeed (and Megatron-native) checkpoints -> Trident.
- :mod:`~megatron.conversion.universal`: DeepSpeed universal checkpoints (resume at another TP/PP/DP).
- :mod:`~megatron.conversion.rewrite`: write a Trident checkpoint at any TP/PP (and EP) through a real DeepSpeed
  engine; ``reshard_checkpoint``.
- :mod:`~megatron.conversion.verify`: logit and greedy-decode comparison.

Above training in the package order: conversions build engines the way training does.
"""
