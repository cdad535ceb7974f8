"""Hugging Face GPT-2 / LLaMA / Mixtral directory -> Trident checkpoint for a target TP x PP (x EP for Mixtral).

    python -m tools.checkpoint.hf_to_trident --hf-dir gpt2/ --save ckpt/ --tp 2 --pp 2 [--no-verify]
    python -m tools.checkpoint.hf_to_trident --hf-dir mixtral/ --save ckpt/ --tp 2 --ep 2

Spawns TP x PP (x EP) local processes that build the model at the target layout inside a DeepSpeed engine and save it,
so training reads it with ``--load ckpt/`` (it loads like --finetune: weights only, iteration 0).
Exit codes: 0 converted (and verified); 2 bad input (one ``error:`` line); 3 verification over tolerance (then
nothing is written to --save: the unverified checkpoint is left in ``<save>.unverified/`` for inspection).
"""

from __future__ import annotations

import argparse
import sys

from megatron.conversion.hf_import import import_from_hf
from tools.checkpoint._common import add_verify_args, run_checkpoint_writer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--hf-dir", required=True, help="local HF model directory (save_pretrained output)"
    )
    p.add_argument("--save", required=True, help="output Trident checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="target tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="target pipeline-parallel size")
    p.add_argument(
        "--ep",
        "--moe-expert-parallel-size",
        dest="ep",
        type=int,
        default=1,
        help="target expert-parallel size of a Mixtral's experts (TP x PP x EP ranks write it)",
    )
    add_verify_args(p)
    a = p.parse_args(argv)
    return run_checkpoint_writer(import_from_hf, a, a.hf_dir, a.save, ep=a.ep)


if __name__ == "__main__":
    sys.exit(main())
