"""Train a tokenizer offline from JSONL and write files our tokenizers load.

    python tools/train_tokenizer.py --input 'data/*.jsonl' --type bpe --vocab-size 8192 --output-dir tok/
        -> tok/vocab.json, tok/merges.txt (--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file),
           tok/tokenizer.json (--tokenizer-type HFTokenizer --tokenizer-model tok)
    python tools/train_tokenizer.py --input data/c.jsonl --type sentencepiece --vocab-size 4096 --output-dir tok/
        -> tok/tokenizer.model (--tokenizer-type GPTSentencePieceTokenizer or SentencePieceTokenizer)

Deterministic: the same input and flags give byte-identical files. All files appear only when training succeeds
(a failed run leaves nothing, not even the --output-dir it created). An --output-dir that already holds tokenizer
files is refused unless --overwrite is given: checkpoints record the tokenizer's paths, so replacing the files
changes the tokenizer of every run that used them. An input without any text is an error.

Exit codes: 0 ok, 1 bad input or a failed run (one ``error:`` line), 2 bad flags (argparse).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

from megatron.data.jsonl_input import PreprocessError, iter_texts, resolve_inputs
from megatron.tokenizer.train import train_to_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--input", required=True, help="a .jsonl / .jsonl.gz file, or a glob of them")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys whose text to train on")
    p.add_argument(
        "--type",
        required=True,
        choices=["bpe", "sentencepiece"],
        help="byte-level BPE or SentencePiece",
    )
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--output-dir", required=True, help="created if missing")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace tokenizer files already in --output-dir (runs that recorded them change tokenizer)",
    )
    p.add_argument(
        "--min-frequency", type=int, default=2, help="bpe: minimum pair frequency to merge"
    )
    p.add_argument(
        "--model-type", default="bpe", choices=["bpe", "unigram"], help="sentencepiece algorithm"
    )
    args = p.parse_args(argv)
    try:
        texts: Iterator[str] = iter_texts(resolve_inputs(args.input), args.json_keys)
        paths = train_to_dir(
            texts,
            kind=args.type,
            vocab_size=args.vocab_size,
            output_dir=args.output_dir,
            overwrite=args.overwrite,
            source=f"--input {args.input} (--json-keys {' '.join(args.json_keys)})",
            min_frequency=args.min_frequency,
            model_type=args.model_type,
        )
    except (PreprocessError, ValueError, OSError) as e:  # OSError: unreadable input, unwritable dir
        print(f"error: {e}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        print(f"wrote {name}: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
