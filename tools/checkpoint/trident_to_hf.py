"""Trident checkpoint (any TP/PP) -> Hugging Face directory (config.json + model.safetensors).

    python -m tools.checkpoint.trident_to_hf --load ckpt/ --out hf_model/ [--tag global_step1000] [--no-verify]

Exit codes: 0 converted (and verified); 2 bad input (one ``error:`` line); 3 verification over tolerance.
"""

from __future__ import annotations

import argparse
import sys

from megatron.checkpointing.convert import export_to_hf
from tools.checkpoint._common import EXIT_INPUT_ERROR, Bar, add_verify_args, report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="Trident checkpoint directory (a --save dir)")
    p.add_argument("--tag", default=None, help="tag to convert (default: 'latest')")
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument("--bos-token-id", type=int, default=None)
    p.add_argument("--eos-token-id", type=int, default=None)
    add_verify_args(p)
    a = p.parse_args(argv)
    try:
        result = export_to_hf(
            a.load,
            a.out,
            tag=a.tag,
            verify=not a.no_verify,
            steps=a.verify_steps,
            progress=Bar(not a.no_progress),
            bos_token_id=a.bos_token_id,
            eos_token_id=a.eos_token_id,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    print(f"wrote {a.out}/config.json and {a.out}/model.safetensors")
    return report(result, a.tolerance)


if __name__ == "__main__":
    sys.exit(main())
