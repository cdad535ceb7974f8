"""Tokenize JSONL into Megatron mmap datasets: ``{output_prefix}_{key}_document.bin/.idx`` for every --json-keys.

    python tools/preprocess_data.py --input 'data/*.jsonl.gz' --json-keys text \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --output-prefix data/my-gpt2 --workers 2

then train with ``--data-path data/my-gpt2_text_document``. Megatron's flags; differences: every key is written
(Megatron finalizes only the last), sizes include the EOD (the fixed Megatron-LM layout), the output is
byte-identical for any --workers, files appear only when the run succeeds, and a bad line stops the run with
``file:line`` (or is skipped with --skip-bad-lines), and so is a line longer than --max-line-bytes (16 MiB by
default: tokenizing takes about 40 times a line's size in memory). --partitions takes only 1 (Megatron's default): inputs are
streamed to the --workers in order, which gives the same parallelism without a merge step. An input with no documents (or a key whose values
are all empty) is an error, not an empty dataset, and --output-prefix must end with a file-name prefix, not a
path separator (``data/my-corpus``, not ``data/``).

GPT2BPETokenizer encodes through tiktoken (built from the given files, offline) when it gives exactly the ids of the
reference encoder, checked at start-up; the last lines say which encoder ran.

A tokenizer whose own configuration adds ids around a text (Llama 3's ``tokenizer.json`` adds
``<|begin_of_text|>``) gets them around every document; ``--append-eod`` appends its EOS. Token ids are stored as
uint16 below a 65,500 vocabulary, else int32 (Llama 3's 128,256, Qwen2.5's 151,665).

``--sft`` writes an SFT dataset instead (docs/preprocessing.md, "SFT / chat data"): chat lines
(``{"messages": [{"role": ..., "content": ...}, ...]}``) rendered by the tokenizer folder's chat template (or
``--chat-template FILE``), and prompt/response lines (``{"prompt": ..., "response": ...}``), into
``{output_prefix}_text_document`` (the ids of ``apply_chat_template``) and ``{output_prefix}_text_document_loss_mask``
(uint8, 1 on the tokens of the ``--sft-loss-roles`` messages: by default each assistant message's content and the
end-of-turn token(s) closing it):

    python tools/preprocess_data.py --sft --input chats.jsonl --tokenizer-type HFTokenizer \
        --tokenizer-model models/Qwen2.5-7B-Instruct --output-prefix data/chat --workers 4

then train with ``pretrain_gpt.py --sft --data-path data/chat_text_document``.

Exit codes: 0 ok, 1 bad input or a failed run (one ``error:`` line; nothing written), 2 bad flags (argparse,
--partitions other than 1, flags of --sft without it or the reverse) or tokenizer files (a missing flag or file, a
tokenizer.json that is not JSON or has an unknown model type, a chat template that is missing or does not compile),
130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from megatron.data.jsonl_input import resolve_inputs
from megatron.data.preprocess import (
    MAX_LINE_BYTES,
    Execution,
    PreprocessError,
    Summary,
    preprocess,
    rates,
)
from megatron.data.sft_examples import SftOptions
from megatron.data.sft_preprocess import SftSummary, preprocess_sft
from megatron.log import setup_logging
from megatron.tokenizer import TOKENIZER_TYPES, TokenizerFileError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("input")
    g.add_argument(
        "--input", required=True, help="a .jsonl / .jsonl.gz file, or a glob of them (quote it)"
    )
    g.add_argument("--json-keys", nargs="+", default=None, help="keys to extract (default: text)")
    g.add_argument(
        "--skip-bad-lines", action="store_true", help="skip malformed lines instead of stopping"
    )
    g.add_argument(
        "--max-line-bytes",
        type=int,
        default=MAX_LINE_BYTES,
        help="a longer JSONL line is a bad line: tokenizing takes about 40x a line's size in memory "
        f"(default {MAX_LINE_BYTES} = 16 MiB)",
    )
    g.add_argument("--split-sentences", action="store_true", help="not supported (needs NLTK data)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    g.add_argument(
        "--tokenizer-model", default=None, help="SentencePiece .model, or HF dir / tokenizer.json"
    )
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary size")
    g.add_argument(
        "--append-eod", action="store_true", help="append the EOD token to every document"
    )
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    g.add_argument("--dataset-impl", default="mmap", choices=["mmap"])
    g = p.add_argument_group(
        "SFT (--sft)",
        'chat JSONL ({"messages": [{"role": ..., "content": ...}, ...]}) or prompt/response JSONL -> '
        "{prefix}_text_document (tokens) and {prefix}_text_document_loss_mask (1 = a training target)",
    )
    g.add_argument(
        "--sft",
        action="store_true",
        help="write an SFT dataset: chats rendered by the tokenizer's chat template, with a loss mask",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template overriding the tokenizer folder's (chat_template.jinja or "
        "tokenizer_config.json's chat_template)",
    )
    g.add_argument("--messages-key", default="messages", help="key of a chat's messages")
    g.add_argument("--prompt-key", default="prompt", help="key of a pair's prompt")
    g.add_argument("--response-key", default="response", help="key of a pair's response")
    g.add_argument(
        "--sft-loss-roles",
        nargs="+",
        default=["assistant"],
        metavar="ROLE",
        help="roles whose messages are training targets (default: assistant; 'all': every token)",
    )
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    g.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="Megatron's input partitions: 1 only (use --workers for parallelism)",
    )
    g.add_argument("--log-interval", type=int, default=1000, help="progress every N documents")
    return p


_MAIN_PID = os.getpid()


def _interrupt(signum: int, frame: object) -> None:
    if os.getpid() != _MAIN_PID:  # a forked worker before its initializer ran: die as SIGTERM would
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt(f"signal {signum}")


_SFT_DEFAULTS = {
    "chat_template": None,
    "messages_key": "messages",
    "prompt_key": "prompt",
    "response_key": "response",
    "sft_loss_roles": ["assistant"],
}


def _flag_error(args: argparse.Namespace) -> tuple[int, str] | None:
    """(exit code, message) for flags that cannot run together, None when they can."""
    if args.split_sentences:
        return 1, (
            "--split-sentences is not supported (it needs NLTK punkt data, which is not available offline); "
            "give each key a list of sentence strings instead."
        )
    if args.partitions != 1:
        return 2, (
            f"--partitions {args.partitions} is not supported: the input is streamed to --workers "
            "processes in order, which gives the parallelism of partitions without the merge step and the same "
            f"bytes for any worker count; use --workers {args.partitions} (and --partitions 1)."
        )
    if args.sft:
        for flag, given in (("--json-keys", args.json_keys), ("--append-eod", args.append_eod)):
            if given:
                return 2, (
                    f"{flag} does not apply to --sft: an SFT line is a chat (--messages-key) or a prompt/response "
                    "pair (--prompt-key, --response-key), and the chat template decides the end-of-turn tokens "
                    "(pairs without a template end with EOS); drop it."
                )
        try:
            _sft_options(args).check()
        except ValueError as e:
            return 2, str(e)
        return None
    for name, default in _SFT_DEFAULTS.items():
        if getattr(args, name) != default:
            return 2, f"--{name.replace('_', '-')} is an option of --sft; add --sft or drop it."
    return None


def _sft_options(args: argparse.Namespace) -> SftOptions:
    return SftOptions(
        messages_key=args.messages_key,
        prompt_key=args.prompt_key,
        response_key=args.response_key,
        loss_roles=tuple(args.sft_loss_roles),
        chat_template=args.chat_template,
    )


def _run(args: argparse.Namespace) -> Summary:
    tokenizer_kwargs = {
        "tokenizer_type": args.tokenizer_type,
        "vocab_file": args.vocab_file,
        "merge_file": args.merge_file,
        "tokenizer_model": args.tokenizer_model,
        "vocab_size": args.vocab_size,
    }
    execution = Execution(workers=args.workers, log_interval=args.log_interval)
    if args.sft:
        return preprocess_sft(
            resolve_inputs(args.input),
            output_prefix=args.output_prefix,
            tokenizer_kwargs=tokenizer_kwargs,
            options=_sft_options(args),
            skip_bad_lines=args.skip_bad_lines,
            max_line_bytes=args.max_line_bytes,
            execution=execution,
        )
    return preprocess(
        resolve_inputs(args.input),
        json_keys=args.json_keys or ["text"],
        output_prefix=args.output_prefix,
        tokenizer_kwargs=tokenizer_kwargs,
        append_eod=args.append_eod,
        skip_bad_lines=args.skip_bad_lines,
        max_line_bytes=args.max_line_bytes,
        execution=execution,
    )


def _report(summary: Summary) -> None:
    tokens = ", ".join(f"{k} {v:,}" for k, v in summary.tokens.items())
    if isinstance(summary, SftSummary):
        total = summary.tokens["text"]
        print(
            f"done: {summary.chats:,} conversations, {summary.pairs:,} prompt/response pairs, {total:,} tokens, "
            f"{summary.target_tokens:,} targets (loss mask 1: {summary.target_tokens / max(total, 1):.1%}), "
            f"{summary.num_bytes / 1e6:.2f} MB, {summary.seconds:.2f} s ({rates(summary, summary.seconds)})",
            file=sys.stderr,
        )
        print(f"template: {summary.template}", file=sys.stderr)
    else:
        print(
            f"done: {summary.docs:,} documents, {summary.num_bytes / 1e6:.2f} MB, tokens: {tokens}, "
            f"{summary.seconds:.2f} s ({rates(summary, summary.seconds)})",
            file=sys.stderr,
        )
    print(f"encoder: {summary.encoder}", file=sys.stderr)
    if summary.bad_lines:
        print(f"skipped {summary.bad_lines:,} bad line(s) (--skip-bad-lines)", file=sys.stderr)
    for prefix in summary.outputs:
        print(f"wrote {prefix}.bin / .idx", file=sys.stderr)
    if isinstance(summary, SftSummary):
        print(f"train with --sft --data-path {summary.outputs[0]}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(logging.INFO)
    refused = _flag_error(args)
    if refused is not None:
        print(f"error: {refused[1]}", file=sys.stderr)
        return refused[0]
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        summary = _run(args)
    except TokenizerFileError as e:  # a tokenizer or chat template flag or file
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (
        PreprocessError,
        ValueError,
        OSError,
    ) as e:  # OSError: missing files, permissions, disk full
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: no output written (temporary files removed)", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    _report(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
