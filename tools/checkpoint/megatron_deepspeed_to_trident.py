"""Megatron-DeepSpeed checkpoint (DeepSpeed format, ``--deepspeed`` runs) -> Trident checkpoint at any TP/PP.

    python -m tools.checkpoint.megatron_deepspeed_to_trident --load mds_ckpt/ --save trident_ckpt/ --tp 2 --pp 1
        [--tag global_step1000] [--qkv-layout grouped|thirds] [--no-verify]

The model shape, tokenizer and parallel layout come from the run's saved ``args``; the result holds weights only
(training continues from it like --finetune: iteration 0, fresh optimizer). ``--qkv-layout thirds`` is for
checkpoints of Megatron-DeepSpeed's FPDT-era code, which split the fused QKV as ``[q | k | v]``. Exit codes: 0 done
(and verified); 2 bad input (one ``error:`` line); 3 verification over tolerance.
"""

from __future__ import annotations

import argparse
import sys

from megatron.conversion.megatron_ds import import_megatron_deepspeed
from tools.checkpoint._common import add_verify_args, run_checkpoint_writer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="the Megatron-DeepSpeed --save directory")
    p.add_argument("--tag", default=None, help="tag to import (default: 'latest')")
    p.add_argument("--save", required=True, help="new Trident checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="target tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="target pipeline-parallel size")
    p.add_argument(
        "--qkv-layout",
        choices=("grouped", "thirds"),
        default="grouped",
        help="fused QKV rows: per-KV-group interleave (Megatron-DeepSpeed before FPDT) or [q|k|v]",
    )
    add_verify_args(p)
    a = p.parse_args(argv)
    return run_checkpoint_writer(
        import_megatron_deepspeed, a, a.load, a.save, tag=a.tag, qkv_layout=a.qkv_layout
    )


if __name__ == "__main__":
    sys.exit(main())
