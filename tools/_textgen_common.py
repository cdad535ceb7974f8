"""Flags shared by the text-generation CLIs (tools/generate_text.py, tools/run_text_generation_server.py): which
checkpoint, which device, which tokenizer; and the one function that turns them into a ``TextGenerator``."""

from __future__ import annotations

import argparse
from typing import Any


def add_load_args(p: argparse.ArgumentParser) -> None:
    """--load/--load-tag and the "model and tokenizer" group."""
    p.add_argument("--load", required=True, help="Trident checkpoint directory (a --save dir)")
    p.add_argument("--load-tag", "--tag", dest="tag", default=None, help="tag (default: 'latest')")
    p.add_argument(
        "--no-verify-checkpoint-checksums",
        dest="verify_checkpoint_checksums",
        action="store_false",
        help="compare the checkpoint files' sizes with those recorded at save, but skip their SHA-256 (huge "
        "checkpoints on trusted storage)",
    )
    run = p.add_argument_group("model and tokenizer")
    run.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if present)"
    )
    run.add_argument("--bf16", action="store_true", help="run the model in bf16")
    run.add_argument("--tokenizer-type", default=None, help="default: the checkpoint's")
    run.add_argument("--vocab-file", default=None)
    run.add_argument("--merge-file", default=None)
    run.add_argument("--tokenizer-model", default=None)
    layout = p.add_argument_group(
        "layout (launch TP x PP processes with torchrun/deepspeed; default: the checkpoint's when it fills the "
        "world, else TP = world)"
    )
    layout.add_argument("--tensor-model-parallel-size", type=int, default=None)
    layout.add_argument("--pipeline-model-parallel-size", type=int, default=None)
    layout.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="prompts per micro-batch through the pipeline (default: batch / PP)",
    )


def build_generator(a: argparse.Namespace) -> Any:
    """The ``TextGenerator`` the flags name.

    Raises:
        ValueError / FileNotFoundError: inconsistent flags, no CUDA for --device cuda, unreadable checkpoint.
    """
    import torch

    from megatron.text_generation import TextGenerator
    from megatron.text_generation.distributed import init_inference_distributed
    from megatron.tokenizer.info import tokenizer_info

    if not a.tokenizer_type and (a.vocab_file or a.merge_file or a.tokenizer_model):
        raise ValueError("--vocab-file/--merge-file/--tokenizer-model need --tokenizer-type.")
    if a.device and a.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {a.device}: this torch sees no CUDA device; use --device cpu.")
    if a.micro_batch_size is not None and a.micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size ({a.micro_batch_size}) must be >= 1.")
    layout = init_inference_distributed(
        a.tensor_model_parallel_size,
        a.pipeline_model_parallel_size,
        ckpt_dir=a.load,
        tag=a.tag,
        device=a.device,
    )
    tok = tokenizer_info(
        tokenizer_type=a.tokenizer_type,
        vocab_file=a.vocab_file,
        merge_file=a.merge_file,
        tokenizer_model=a.tokenizer_model,
    )
    return TextGenerator.from_checkpoint(
        a.load,
        tag=a.tag,
        tokenizer=tok,
        device=layout.device,
        dtype=torch.bfloat16 if a.bf16 else torch.float32,
        micro_batch_size=a.micro_batch_size,
        layout=layout,
        verify_checksums=a.verify_checkpoint_checksums,
    )
