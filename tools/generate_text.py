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
import os
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

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
    out.add_argument(
        "--beam-width",
        type=int,
        default=None,
        help="beam search with this many beams (Megatron's semantics; --num-samples best hypotheses per prompt)",
    )
    out.add_argument(
        "--length-penalty",
        type=float,
        default=1.0,
        help="beam search: score = sum log p / len**this, a finite number in [-10, 10]",
    )
    out.add_argument(
        "--return-log-probs",
        action="store_true",
        help="add per-token log-probs of the prompt and of the output to each JSON line",
    )
    out.add_argument(
        "--batch-size", type=int, default=8, help="samples generated together (one batch)"
    )
    return p.parse_args(argv)


def _prompts(a: argparse.Namespace) -> list[str]:
    """--prompt values, then one prompt per line of --sample-input-file; none: one unconditional sample.

    Raises:
        FileNotFoundError / ValueError: the input file is missing, not UTF-8 text, or empty (an empty file is a
            mistake, not a request for nothing: refusing it keeps a previous --sample-output-file intact).
    """
    prompts = list(a.prompt)
    if a.sample_input_file:
        path = Path(a.sample_input_file)
        if not path.is_file():
            raise FileNotFoundError(f"--sample-input-file {path} does not exist.")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as err:
            raise ValueError(
                f"--sample-input-file {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                f"{err.start}); give a text file with one prompt per line."
            ) from None
        if not lines:
            raise ValueError(
                f"--sample-input-file {path} is empty: it holds no prompts. Put one prompt per line (an empty "
                "line is an unconditional sample), or leave the flag out for one unconditional sample."
            )
        prompts += lines
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


def _check_counts(a: argparse.Namespace) -> None:
    """--batch-size, --length-penalty, --num-samples and --beam-width, before anything is loaded."""
    from megatron.text_generation.engine import check_length_penalty

    if a.batch_size < 1:
        raise ValueError(f"--batch-size ({a.batch_size}) must be >= 1.")
    check_length_penalty(a.length_penalty)
    if a.beam_width is not None and not 1 <= a.num_samples <= a.beam_width:
        raise ValueError(
            f"--num-samples ({a.num_samples}) must be in [1, --beam-width ({a.beam_width})] with beam "
            "search (it is the number of best hypotheses printed)."
        )
    if a.num_samples < 1:
        raise ValueError(
            f"--num-samples ({a.num_samples}) must be >= 1 (Megatron's interactive mode, 0, is not "
            "supported; pass prompts with --prompt or --sample-input-file)."
        )


def _new_tokens(gen: Any, prompts: list[str], out_seq_length: int | None) -> dict[str, int]:
    """New tokens per prompt, every prompt checked to fit before anything is generated or written."""
    from megatron.text_generation.generation import TooManyTokensError

    lengths = {}
    for prompt in prompts:
        n = out_seq_length
        if n is None:  # the default: as many as fit, up to DEFAULT_NEW_TOKENS (at least 1)
            n = max(1, min(DEFAULT_NEW_TOKENS, gen.max_positions - len(gen.prompt_ids(prompt))))
        try:
            gen.check_request(prompt, n)
        except TooManyTokensError as err:
            raise _too_long(prompt, err) from None
        lengths[prompt] = n
    return lengths


def _write_rows(rows: list[dict[str, Any]], path: str | None) -> None:
    """JSON lines into --sample-output-file, or each sample printed with a separator line."""
    sink = _open_output(path)
    try:
        for row in rows:
            if sink is not None:
                sink.write(json.dumps(row, ensure_ascii=False) + "\n")
            else:
                print(f"{row['prompt']}{row['text']}\n{'-' * 40}")
    finally:
        if sink is not None:
            sink.close()


ERROR_GRACE_SECONDS = 2.0
"""How long ranks other than 0 wait before exiting on a user-input error (rank 0 prints it)."""


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    from megatron.text_generation import SamplingParams

    try:
        _check_counts(a)
        params = SamplingParams(
            greedy=a.greedy, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p
        )
        prompts = _prompts(a)
        _check_output_file(a.sample_output_file)
        gen = build_generator(a)
        lengths = _new_tokens(gen, prompts, a.out_seq_length)
        rows = _generate(gen, a, prompts, lengths, params)
        if gen.is_server_rank:  # every rank generated; one writes
            _write_rows(rows, a.sample_output_file)
    except (ValueError, FileNotFoundError) as e:
        if _is_rank_zero():
            print(f"error: {e}", file=sys.stderr)
        else:
            # Every rank finds the same error; a launcher (torchrun) stops the whole job at the first rank that
            # exits, so the others give rank 0 a moment to write the one error line first.
            time.sleep(ERROR_GRACE_SECONDS)
        return EXIT_INPUT_ERROR
    finally:
        from megatron.text_generation.distributed import destroy_inference_distributed

        destroy_inference_distributed()
    return 0


def _is_rank_zero() -> bool:
    """Global rank 0 (before the process group exists: the launcher's RANK), which alone prints errors."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def _generate(
    gen: Any,
    a: argparse.Namespace,
    prompts: list[str],
    lengths: dict[str, int],
    params: Any,
) -> list[dict[str, Any]]:
    """Every sample as a JSON row: ``--num-samples`` per prompt (sample ``k`` of the run seeded with
    ``prompt_seed(--seed, k)``), in batches of ``--batch-size``; or the best beam-search hypotheses."""
    from megatron.text_generation import PromptRequest, prompt_seed

    if a.beam_width is not None:
        rows = []
        for prompt in prompts:
            for g in gen.beam_search(
                prompt,
                beam_width=a.beam_width,
                max_new_tokens=lengths[prompt],
                stop_token=None,
                length_penalty=a.length_penalty,
                num_return_gen=a.num_samples,
            ):
                rows.append(
                    {"prompt": g.prompt, "text": g.text, "tokens": g.tokens, "score": g.score}
                )
        return rows
    requests = [
        PromptRequest(
            prompt,
            lengths[prompt],
            params,
            seed=prompt_seed(a.seed, i * a.num_samples + k),
            stop_at_eod=not a.no_stop_at_eod,
            return_log_probs=a.return_log_probs,
        )
        for i, prompt in enumerate(prompts)
        for k in range(a.num_samples)
    ]
    rows = []
    for start in range(0, len(requests), a.batch_size):
        for g in gen.generate_requests(requests[start : start + a.batch_size]):
            row = {"prompt": g.prompt, "text": g.text, "tokens": g.tokens}
            if a.return_log_probs:
                row["prompt_log_probs"] = g.prompt_log_probs
                row["log_probs"] = g.log_probs
            rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
