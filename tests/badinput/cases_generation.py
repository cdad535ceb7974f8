"""Bad input to text generation: tools/generate_text.py, tools/run_text_generation_server.py and
tools/text_generation_cli.py (flags, checkpoints, tokenizers, ports, server addresses, refused requests).

The checkpoint is the catalogue's ``{ws}/ckpt`` (NullTokenizer, context 16); the server cases talk to the shared
server at ``{url}``. Every case fails before any text is generated or written.
"""

from __future__ import annotations

from pathlib import Path

from tests.badinput.cases import Case

GEN = ("tools/generate_text.py", "--device", "cpu")
SERVE = ("tools/run_text_generation_server.py", "--device", "cpu")
CLI = ("tools/text_generation_cli.py",)
CKPT = ("--load", "{ws}/ckpt")
OUT = "{tmp}/samples.jsonl"
"""A --sample-output-file that must not be created by a refused command."""


def _gen(*flags: str) -> tuple[str, ...]:
    return (*GEN, *CKPT, "--prompt", "1 2", "--sample-output-file", OUT, *flags)


def _prompts_dir(tmp: Path, ws: Path) -> None:
    (tmp / "prompts").mkdir()


CASES: list[Case] = [
    # --- tools/generate_text.py: the checkpoint and tokenizer
    Case(
        "gen-load-missing",
        (*GEN, "--load", "{tmp}/no-such-ckpt", "--prompt", "1"),
        2,
        "holds no Trident checkpoint (no 'latest' file)",
    ),
    Case(
        "gen-load-is-a-data-dir",
        (*GEN, "--load", "{ws}/tiny", "--prompt", "1"),
        2,
        "holds no Trident checkpoint",
        unchanged=("{ws}/tiny",),
        needs=("data",),
    ),
    Case(
        "gen-load-tag-absent",
        _gen("--load-tag", "global_step9"),
        2,
        "complete tags there: global_step2",
        unchanged=(OUT, "{ws}/ckpt"),
        needs=("ckpt",),
    ),
    Case(
        "gen-tokenizer-files-without-type",
        _gen("--vocab-file", "{ws}/tiny/vocab.json"),
        2,
        "need --tokenizer-type",
        unchanged=(OUT,),
        needs=("ckpt", "data"),
    ),
    Case(
        "gen-tokenizer-vocab-missing",
        _gen(
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            "{tmp}/vocab.json",
            "--merge-file",
            "{ws}/tiny/merges.txt",
        ),  # fmt: skip
        2,
        "vocab.json does not exist",
        unchanged=(OUT,),
        needs=("ckpt", "data"),
    ),
    Case(
        "gen-tokenizer-type-unknown",
        _gen("--tokenizer-type", "NoSuchTokenizer"),
        2,
        "--tokenizer-type NoSuchTokenizer is not supported",
        unchanged=(OUT,),
        needs=("ckpt",),
    ),
    # --- tools/generate_text.py: sampling flags (Megatron's rules)
    Case(
        "gen-top-k-and-top-p",
        _gen("--top_k", "5", "--top_p", "0.5"),
        2,
        "--top_k (5) and --top_p (0.5) are exclusive",
        unchanged=(OUT,),
        needs=("ckpt",),
    ),
    Case(
        "gen-temperature-zero",
        _gen("--temperature", "0"),
        2,
        "--temperature (0.0) must be > 0",
        unchanged=(OUT,),
        needs=("ckpt",),
    ),
    Case(
        "gen-temperature-nan",
        _gen("--temperature", "nan"),
        2,
        "--temperature (nan) must be > 0",
        unchanged=(OUT,),
        needs=("ckpt",),
    ),
    Case(
        "gen-top-p-above-one",
        _gen("--top_p", "1.5"),
        2,
        "--top_p (1.5) must be in [0, 1]",
        unchanged=(OUT,),
        needs=("ckpt",),
    ),
    Case(
        "gen-top-k-negative",
        _gen("--top_k", "-3"),
        2,
        "--top_k (-3) must be >= 0",
        unchanged=(OUT,),
        needs=("ckpt",),
    ),
    Case(
        "gen-out-seq-length-too-long",
        _gen("--out-seq-length", "100"),
        2,
        "so at most 14 new tokens fit; use --out-seq-length 14 or less",
        unchanged=(OUT,),
        needs=("ckpt",),
    ),
    Case(
        "gen-num-samples-zero",
        _gen("--num-samples", "0"),
        2,
        "--num-samples (0) must be >= 1",
        unchanged=(OUT,),
        needs=("ckpt",),
    ),
    Case(
        "gen-sample-input-file-missing",
        _gen("--sample-input-file", "{tmp}/prompts.txt"),
        2,
        "prompts.txt does not exist",
        unchanged=(OUT,),
        needs=("ckpt",),
    ),
    Case(
        "gen-sample-output-file-is-a-dir",
        (*GEN, *CKPT, "--prompt", "1", "--sample-output-file", "{tmp}/prompts"),
        2,
        "is a directory; give a file path",
        unchanged=("{tmp}/prompts",),
        needs=("ckpt",),
        setup=_prompts_dir,
    ),
    # --- tools/run_text_generation_server.py
    Case(
        "server-port-out-of-range",
        (*SERVE, *CKPT, "--port", "70000"),
        2,
        "--port 70000 must be in 0..65535",
        needs=("ckpt",),
    ),
    Case(
        "server-port-negative",
        (*SERVE, *CKPT, "--port", "-1"),
        2,
        "--port -1 must be in 0..65535",
        needs=("ckpt",),
    ),
    Case(
        "server-port-in-use",
        (*SERVE, *CKPT, "--port", "{port}"),
        2,
        "(Address already in use); use another --port",
        needs=("ckpt", "server"),
    ),
    Case(
        "server-read-timeout-zero",
        (*SERVE, *CKPT, "--read-timeout", "0"),
        2,
        "--read-timeout (0.0) must be a finite number of seconds > 0",
        needs=("ckpt",),
    ),
    Case(
        "server-load-missing",
        (*SERVE, "--load", "{tmp}/no-such-ckpt", "--port", "0"),
        2,
        "holds no Trident checkpoint",
    ),
    # --- tools/text_generation_cli.py: the address, checked before the first prompt is read
    Case(
        "cli-url-port-not-a-number",
        (*CLI, "localhost:abc"),
        2,
        "the server address 'localhost:abc' is not a valid URL",
        stdin="1 2\n",
    ),
    Case(
        "cli-url-port-out-of-range",
        (*CLI, "localhost:99999"),
        2,
        "Port out of range",
        stdin="1 2\n",
    ),
    Case(
        "cli-url-space-in-host",
        (*CLI, "h ost:5000"),
        2,
        "is empty or holds spaces; give host:port",
    ),
    Case(
        "cli-url-unclosed-ipv6",
        (*CLI, "http://[::1"),
        2,
        "Invalid IPv6 URL",
    ),
    Case(
        "cli-url-wrong-scheme",
        (*CLI, "ftp://localhost:5000"),
        2,
        "uses ftp://; give host:port",
    ),
    Case(
        "cli-server-unreachable",
        (*CLI, "http://127.0.0.1:1"),
        2,
        "cannot reach the server at http://127.0.0.1:1/api",
        stdin="1 2\n",
    ),
    # --- the running server refuses a request (HTTP 400), the CLI prints its one line
    Case(
        "cli-server-refuses-top-k-and-top-p",
        (*CLI, "{url}", "--top_k", "2", "--top_p", "0.3"),
        2,
        "the server refused the request (HTTP 400): top_k (2) and top_p (0.3) are exclusive",
        needs=("server",),
        stdin="1 2\n",
    ),
    Case(
        "cli-server-refuses-too-many-tokens",
        (*CLI, "{url}", "--tokens-to-generate", "100"),
        2,
        "request at most",
        needs=("server",),
        stdin="1 2\n",
    ),
]
