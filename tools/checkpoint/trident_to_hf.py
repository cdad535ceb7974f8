"""Trident checkpoint (any TP/PP/ZeRO stage) -> Hugging Face directory (config.json, model.safetensors, tokenizer).

    python -m tools.checkpoint.trident_to_hf --load ckpt/ --out hf_model/ [--tag global_step1000] [--no-verify]

The tokenizer recorded at training time is exported too (``--no-tokenizer`` to skip; ``--tokenizer-type`` and its
file flags to name another). --out must be new or empty unless ``--overwrite`` is given.

A LoRA run's checkpoint (adapters on a recorded base) exports with ``--merge-lora`` (--out: the merged model) or
``--peft-output DIR`` (--out: the base model; DIR: a PEFT adapter folder for it), each verified against the LoRA
model.

Exit codes: 0 converted (and verified); 2 bad input (one ``error:`` line); 3 verification over tolerance (then
nothing is written to --out: the unverified files are left in ``<out>.unverified/`` for inspection).
"""

from __future__ import annotations

import argparse
import sys

from megatron.checkpointing.readers import CheckpointRead
from megatron.conversion.hf_export import TokenizerExport, export_to_hf
from megatron.conversion.lora_export import LoraOutput
from megatron.tokenizer.info import tokenizer_info
from tools.checkpoint._common import (
    EXIT_INPUT_ERROR,
    Bar,
    add_checksum_args,
    add_verify_args,
    report,
    verification_from_args,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="Trident checkpoint directory (a --save dir)")
    p.add_argument("--tag", default=None, help="tag to convert (default: 'latest')")
    p.add_argument(
        "--out", required=True, help="output HF directory (new or empty, or see --overwrite)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into an existing --out: first delete its config, weights and tokenizer files "
        "(config.json, model*.safetensors*, tokenizer.json, vocab.json, merges.txt, ...) so none of "
        "another model's are mixed with this one's",
    )
    p.add_argument("--bos-token-id", type=int, default=None)
    p.add_argument("--eos-token-id", type=int, default=None)
    g = p.add_argument_group(
        "tokenizer (default: the one recorded in the checkpoint; these flags replace it)"
    )
    g.add_argument("--tokenizer-type", default=None, help="as in training, e.g. GPT2BPETokenizer")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    g = p.add_argument_group("LoRA (a --lora-rank run's checkpoint: adapters on a recorded base)")
    g.add_argument(
        "--merge-lora",
        action="store_true",
        help="write the model with the adapters merged in (W + alpha/r * B A): a plain HF model",
    )
    g.add_argument(
        "--peft-output",
        default=None,
        metavar="DIR",
        help="write the base model to --out and a PEFT adapter folder (adapter_config.json, "
        "adapter_model.safetensors) for it to DIR (LLaMA family and GPT-2)",
    )
    add_verify_args(p)
    add_checksum_args(p)
    a = p.parse_args(argv)
    tokenizer = tokenizer_info(
        tokenizer_type=a.tokenizer_type,
        vocab_file=a.vocab_file,
        merge_file=a.merge_file,
        tokenizer_model=a.tokenizer_model,
    )
    if tokenizer is None and (a.vocab_file or a.merge_file or a.tokenizer_model):
        print(
            "error: --vocab-file/--merge-file/--tokenizer-model need --tokenizer-type.",
            file=sys.stderr,
        )
        return EXIT_INPUT_ERROR
    try:
        result = export_to_hf(
            a.load,
            a.out,
            read=CheckpointRead(tag=a.tag, verify_checksums=a.verify_checkpoint_checksums),
            tokenizer=TokenizerExport(
                info=tokenizer,
                write=not a.no_tokenizer,
                bos_token_id=a.bos_token_id,
                eos_token_id=a.eos_token_id,
            ),
            verification=verification_from_args(a),
            progress=Bar(not a.no_progress),
            overwrite=a.overwrite,
            say=print,
            lora=LoraOutput(merge=a.merge_lora, peft_dir=a.peft_output),
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    if result is None or result.passes(a.tolerance):
        print(f"wrote {a.out}/config.json and {a.out}/model.safetensors")
        if a.peft_output:
            print(
                f"wrote the PEFT adapter {a.peft_output}/adapter_config.json and adapter_model.safetensors"
            )
    return report(result, a.tolerance)


if __name__ == "__main__":
    sys.exit(main())
