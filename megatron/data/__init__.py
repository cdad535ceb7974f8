"""Data pipeline: Megatron's mmap indexed datasets, GPT sample indexing, blending and samplers."""
