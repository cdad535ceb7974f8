"""Generate text from a Trident checkpoint (any TP/PP/ZeRO layout; runs on one device).

    python tools/generate_text.py --load ckpt/ --prompt "In the beginning" --out-seq-length 64 --top_p 0.9
    python tools/generate_text.py --load ckpt/ --sample-input-file prompts.txt --sample-output-file out.jsonl --greedy

Flags follow Megatron's text-generation tools (``--out-seq-length`` = new tokens per sample, ``--temperature``,
``--top_k``, ``--top_p``, ``--greedy``, ``--num-samples``, ``--sample-input-file`` one prompt per line,
``--sample-output-file`` JSON lines). The tokenizer is the one recorded in the checkpoint unless
``--tokenizer-type`` and its file flags name another. As in Megatron, a prompt plus ``--out-seq-length`` that
does not fit in the model's context is an error (nothing is cut short silently); every prompt is checked before
anything is generated. Exit codes: 0 ok, 2 bad input (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING

from tools._textgen_common import add_load_args, build_generator

if TYPE_CHECKING:
    from megatron.text_generation.generation import TooManyTokensError

EXIT_INPUT_ERROR = 2
DEFAULT_NEW_TOKENS = 64


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_args(p)
    src = p.add_argument_group("prompts (default: one unconditional sample, started from EOD)")
    src.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    src.add_argument("--sample-input-file", default=None, help="one prompt per line")
    out = p.add_argument_group("sampling")
    out.add_argument(
        "--out-seq-length",
        type=int,
        default=None,
        help=f"new tokens per sample (default: {DEFAULT_NEW_TOKENS}, or what fits the context); an "
        "explicit value that does not fit is an error",
    )
    out.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    out.add_argument("--greedy", action="store_true", help="argmax decoding")
    out.add_argument("--temperature", type=float, default=1.0)
    out.add_argument("--top_k", "--top-k", dest="top_k", type=int, default=0, help="0 = off")
    out.add_argument("--top_p", "--top-p", dest="top_p", type=float, default=0.0, help="0 = off")
    out.add_argument("--seed", type=int, default=1234)
    out.add_argument("--no-stop-at-eod", action="store_true", help="keep going after EOD")
    out.add_argument("--sample-output-file", default=None, help="write JSON lines here")
    return p.parse_args(argv)


def _prompts(a: argparse.Namespace) -> list[str]:
    prompts = list(a.prompt)
    if a.sample_input_file:
        path = Path(a.sample_input_file)
        if not path.is_file():
            raise FileNotFoundError(f"--sample-input-file {path} does not exist.")
        prompts += [ln.rstrip("\n") for ln in path.read_text(encoding="utf-8").splitlines()]
    return prompts or [""]


def _check_output_file(path: str | None) -> None:
    """Refuse an unwritable --sample-output-file before the model is loaded."""
    if path is None:
        return
    out = Path(path)
    if out.is_dir():
        raise ValueError(
            f"--sample-output-file {out} is a directory; give a file path, e.g. {out / 'samples.jsonl'}."
        )
    parent = out.parent
    if not parent.is_dir():
        raise FileNotFoundError(
            f"--sample-output-file {out}: the directory {parent} does not exist; create it first."
        )


def _open_output(path: str | None) -> IO[str] | None:
    """--sample-output-file opened for writing (None: print to stdout)."""
    if path is None:
        return None
    try:
        return open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed by main)
    except OSError as err:
        raise ValueError(
            f"--sample-output-file {path}: cannot write it ({err.strerror})."
        ) from None


def _too_long(prompt: str, err: TooManyTokensError) -> ValueError:
    """A ``TooManyTokensError`` in this tool's terms (the flag, the prompt, the fix)."""
    if prompt:
        shown = prompt if len(prompt) <= 40 else prompt[:40] + "..."
        which = f"the prompt {shown!r}"
    else:
        which = "an unconditional sample (it starts from the EOD token)"
    room = err.context - err.prompt_tokens
    return ValueError(
        f"--out-seq-length ({err.max_new_tokens}) is too long: {which} has {err.prompt_tokens} token(s) and the "
        f"model's context is {err.context}, so at most {room} new tokens fit; use --out-seq-length {room} or less."
    )


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    import torch

    from megatron.text_generation import SamplingParams
    from megatron.text_generation.generation import TooManyTokensError

    try:
        if a.num_samples < 1:
            raise ValueError(
                f"--num-samples ({a.num_samples}) must be >= 1 (Megatron's interactive mode, 0, is not "
                "supported; pass prompts with --prompt or --sample-input-file)."
            )
        params = SamplingParams(
            greedy=a.greedy, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p
        )
        prompts = _prompts(a)
        _check_output_file(a.sample_output_file)
        gen = build_generator(a)
        lengths = {}
        for prompt in prompts:  # every prompt fits before anything is generated or written
            n = a.out_seq_length
            if n is None:  # the default: as many as fit, up to DEFAULT_NEW_TOKENS (at least 1)
                n = max(1, min(DEFAULT_NEW_TOKENS, gen.max_positions - len(gen.prompt_ids(prompt))))
            try:
                gen.check_request(prompt, n)
            except TooManyTokensError as err:
                raise _too_long(prompt, err) from None
            lengths[prompt] = n
        generator = torch.Generator().manual_seed(a.seed)
        sink = _open_output(a.sample_output_file)
        try:
            for prompt in prompts:
                for _ in range(a.num_samples):
                    g = gen.generate(
                        prompt,
                        max_new_tokens=lengths[prompt],
                        params=params,
                        generator=generator,
                        stop_at_eod=not a.no_stop_at_eod,
                    )
                    row = {"prompt": g.prompt, "text": g.text, "tokens": g.tokens}
                    if sink is not None:
                        sink.write(json.dumps(row, ensure_ascii=False) + "\n")
                    else:
                        print(f"{g.prompt}{g.text}\n{'-' * 40}")
        finally:
            if sink is not None:
                sink.close()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
