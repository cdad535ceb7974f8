"""Offline reshard of a Trident checkpoint's weights: (TP, PP, EP) -> (TP', PP', EP') (iteration 0, weights only).

    python -m tools.checkpoint.reshard --load ckpt_tp2pp2/ --save ckpt_tp1pp4/ --tp 1 --pp 4 [--no-verify]
    python -m tools.checkpoint.reshard --load moe_ep2/ --save moe_ep1/ --tp 1 --pp 1 --ep 1   (MoE experts)

For resuming training WITH optimizer state at another layout use tools/checkpoint/to_universal.py instead.
Exit codes: 0 done (and verified); 2 bad input (one ``error:`` line); 3 verification over tolerance (then
nothing is written to --save: the unverified checkpoint is left in ``<save>.unverified/`` for inspection).
"""

from __future__ import annotations

import argparse
import sys

from megatron.conversion.rewrite import reshard_checkpoint
from tools.checkpoint._common import add_checksum_args, add_verify_args, run_checkpoint_writer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="source Trident checkpoint directory")
    p.add_argument("--tag", default=None, help="source tag (default: 'latest')")
    p.add_argument("--save", required=True, help="output Trident checkpoint directory")
    p.add_argument("--tp", type=int, required=True, help="target tensor-parallel size")
    p.add_argument("--pp", type=int, required=True, help="target pipeline-parallel size")
    p.add_argument(
        "--ep",
        "--moe-expert-parallel-size",
        dest="ep",
        type=int,
        default=1,
        help="target expert-parallel size of an MoE model's experts (TP x PP x EP ranks write it)",
    )
    add_verify_args(p)
    add_checksum_args(p)
    a = p.parse_args(argv)
    return run_checkpoint_writer(
        reshard_checkpoint,
        a,
        a.load,
        a.save,
        tag=a.tag,
        ep=a.ep,
        verify_checksums=a.verify_checkpoint_checksums,
    )


if __name__ == "__main__":
    sys.exit(main())
