"""Generation benchmark: prefill and decode tokens/s of Trident's generator vs Hugging Face ``generate``.

    python -m benchmarks.bench_generate                                  # GPT-2 124M, P 128, N 64, batch 1 and 8
    python -m benchmarks.bench_generate --num-layers 4 --hidden-size 256 --num-attention-heads 4 --json out.json
    python -m benchmarks.bench_generate --preset llama --num-key-value-heads 4 --bf16 --device cuda

Not a test: the numbers depend on the machine. What is measured:

- One randomly initialised model (``--seed``) built from the flags, GPT-2-style (``--preset gpt2``) or
  LLaMA-style (``--preset llama``), held once as our TP = 1 ``GPTModel`` and once as the Hugging Face model it
  exports to (``megatron.conversion``: ``GPT2LMHeadModel`` / ``LlamaForCausalLM``, written to a temporary
  directory and loaded with ``from_pretrained``, offline). Same dtype (fp32, or ``--bf16``), same device, same
  thread count (``torch.set_num_threads``).
- Per batch size ``b`` (``--batch-sizes``): ``b`` random prompts of ``P`` tokens (``--prompt-length``, NullTokenizer
  ids), ``N`` new tokens (``--new-tokens``), greedy. Ours: ``TextGenerator.generate_requests`` with greedy
  ``PromptRequest`` s and ``stop_at_eod=False``. HF: ``model.generate(do_sample=False, max_new_tokens=N,
  min_new_tokens=N, use_cache=True)``.
- Each call is split at the end of the model's first forward (a forward hook on the top module; on CUDA after a
  synchronize): prefill = call start to the end of that forward (the whole prompt through the model and its KV
  cache), decode = the rest of the call (the other ``N - 1`` forwards plus all sampling and bookkeeping). Prefill
  tokens/s = ``b * P / prefill``, decode tokens/s = ``b * (N - 1) / decode``. One warm-up call of each, then the
  median of ``--repeats`` calls (ours and HF alternate). Ours also tokenizes the prompt strings and detokenizes the
  output inside the call (NullTokenizer: negligible).
- Greedy tokens of ours and HF are compared per row (fp32: expected equal; bf16 rounding may make near-ties
  diverge, which is reported, not an error).

Output: a table on stdout; ``--json FILE`` adds every number and the ratios ours / HF. Exit 2 with one ``error:``
line for bad flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.config import ModelConfig

EXIT_INPUT_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse that raises ValueError (reported by :func:`main` as one ``error:`` line, exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"{message} (run with --help for the list of flags)")


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers (e.g. 1,8)"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every batch size must be >= 1 (e.g. 1,8)")
    return sizes


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The flags, checked (sizes, lengths, device).

    Raises:
        ValueError: a bad flag, naming it and the fix.
    """
    p = _Parser(
        prog="bench_generate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model (random weights)")
    m.add_argument("--preset", choices=["gpt2", "llama"], default="gpt2")
    m.add_argument("--num-layers", type=int, default=12)
    m.add_argument("--hidden-size", type=int, default=768)
    m.add_argument("--num-attention-heads", type=int, default=12)
    m.add_argument("--num-key-value-heads", type=int, default=None, help="GQA (--preset llama)")
    m.add_argument("--ffn-hidden-size", type=int, default=None, help="default: Megatron's")
    m.add_argument("--seq-length", type=int, default=1024, help="context (position table) size")
    m.add_argument(
        "--vocab-size", type=int, default=50257, help="true vocabulary (ids the model can emit)"
    )
    m.add_argument("--seed", type=int, default=1234, help="weights and prompts")
    r = p.add_argument_group("run")
    r.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 8], help="comma-separated")
    r.add_argument("--prompt-length", type=int, default=128, help="P: tokens per prompt")
    r.add_argument("--new-tokens", type=int, default=64, help="N: tokens generated per prompt")
    r.add_argument("--repeats", type=int, default=3, help="timed calls per batch (median)")
    r.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    r.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if present)"
    )
    r.add_argument("--bf16", action="store_true", help="both models in bf16 (default fp32)")
    r.add_argument("--json", type=Path, default=None, help="also write every number here")
    a = p.parse_args(argv)
    for flag, least in (
        ("num_layers", 1), ("hidden_size", 1), ("num_attention_heads", 1), ("vocab_size", 2),
        ("prompt_length", 1), ("new_tokens", 2), ("repeats", 1), ("threads", 1),
    ):  # fmt: skip
        _positive(a, flag, least)
    if a.hidden_size % a.num_attention_heads:
        raise ValueError(
            f"--hidden-size ({a.hidden_size}) must be divisible by --num-attention-heads "
            f"({a.num_attention_heads}) (HF GPT-2 and LLaMA use hidden / heads channels per head)."
        )
    if a.prompt_length + a.new_tokens > a.seq_length:
        raise ValueError(
            f"--prompt-length ({a.prompt_length}) + --new-tokens ({a.new_tokens}) must fit in --seq-length "
            f"({a.seq_length}); raise --seq-length to {a.prompt_length + a.new_tokens} or shorten them."
        )
    if a.num_key_value_heads is not None and a.preset != "llama":
        raise ValueError("--num-key-value-heads needs --preset llama (HF GPT-2 has no GQA).")
    if a.device and a.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {a.device}: this torch sees no CUDA device; use --device cpu.")
    if a.json is not None and not a.json.parent.is_dir():
        raise ValueError(f"--json {a.json}: the directory {a.json.parent} does not exist.")
    return a


def _positive(a: argparse.Namespace, flag: str, least: int) -> None:
    value = getattr(a, flag)
    if value < least:
        raise ValueError(f"--{flag.replace('_', '-')} ({value}) must be >= {least}.")


def model_config(a: argparse.Namespace) -> ModelConfig:
    """The ``ModelConfig`` the flags describe (the preset's flags through ``parse_args``; dropout 0)."""
    from megatron.config import parse_args
    from megatron.model.presets import preset_flags

    flags = preset_flags(a.preset) + [
        "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
        "--num-attention-heads", str(a.num_attention_heads), "--seq-length", str(a.seq_length),
        "--max-position-embeddings", str(a.seq_length), "--attention-dropout", "0",
        "--hidden-dropout", "0",
    ]  # fmt: skip
    if a.num_key_value_heads is not None:
        flags += ["--num-key-value-heads", str(a.num_key_value_heads)]
    if a.ffn_hidden_size is not None:
        flags += ["--ffn-hidden-size", str(a.ffn_hidden_size)]
    cfg = parse_args(flags).model
    return dataclasses.replace(cfg, vocab_size=a.vocab_size)


def build_models(
    cfg: ModelConfig, *, seed: int, device: torch.device, dtype: torch.dtype
) -> tuple[Any, torch.nn.Module, int]:
    """(our ``TextGenerator``, the exported HF model, our parameter count), same weights, eval mode."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from megatron.conversion.hf_export import is_llama
    from megatron.conversion.hf_gpt2 import megatron_to_gpt2_hf
    from megatron.conversion.hf_llama import megatron_to_llama_hf
    from megatron.model import GPTModel
    from megatron.mpu.context import ParallelContext
    from megatron.text_generation import TextGenerator
    from megatron.tokenizer import build_tokenizer

    model = GPTModel(cfg, ParallelContext(seed=seed)).eval()
    export = megatron_to_llama_hf if is_llama(cfg) else megatron_to_gpt2_hf
    hf_sd, hf_cfg = export(model.state_dict(), cfg, cfg.vocab_size)
    with tempfile.TemporaryDirectory(prefix="bench_generate-hf-") as tmp:
        save_file(
            {k: v.contiguous() for k, v in hf_sd.items()}, str(Path(tmp) / "model.safetensors")
        )
        (Path(tmp) / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        del hf_sd
        hf = AutoModelForCausalLM.from_pretrained(tmp, local_files_only=True)
    hf = hf.to(device=device, dtype=dtype).eval()
    hf.generation_config.eos_token_id = None  # never stop early: exactly N tokens, as ours
    hf.generation_config.pad_token_id = 0
    n_params = sum(p.numel() for p in model.parameters())
    tok = build_tokenizer(tokenizer_type="NullTokenizer", vocab_size=cfg.vocab_size - 1)
    gen = TextGenerator(model.to(device=device, dtype=dtype), cfg, tok, device)
    return gen, hf, n_params


@dataclasses.dataclass
class Call:
    """One timed generation call."""

    prefill_s: float
    """Call start to the end of the model's first forward."""
    decode_s: float
    """The rest of the call."""
    forwards: int
    """Forward calls of the model's top module during the call."""
    tokens: list[list[int]]
    """Generated ids per row."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def outermost_module(call: Callable[[], object]) -> torch.nn.Module:
    """The outermost module whose forward ``call`` runs (found with global module hooks during one call).

    Whatever wraps the model (``GPTModel``, a pipeline stage, HF's ``*ForCausalLM``), its forward includes the
    logits; the timing hook goes there.

    Raises:
        RuntimeError: ``call`` ran no module.
    """
    depth, found = 0, []

    def enter(*_: Any) -> None:
        nonlocal depth
        depth += 1

    def leave(module: torch.nn.Module, *_: Any) -> None:
        nonlocal depth
        depth -= 1
        if depth == 0 and not found:
            found.append(module)

    handles = [
        torch.nn.modules.module.register_module_forward_pre_hook(enter),
        torch.nn.modules.module.register_module_forward_hook(leave),
    ]
    try:
        call()
    finally:
        for h in handles:
            h.remove()
    if not found:
        raise RuntimeError("the generation call ran no torch module: nothing to time.")
    return found[0]


@contextmanager
def _forward_clock(module: torch.nn.Module, device: torch.device) -> Iterator[list[float]]:
    """Appends ``perf_counter()`` at the end of every forward of ``module`` (synchronized after the first)."""
    ends: list[float] = []

    def hook(*_: Any) -> None:
        if not ends:
            _sync(device)
        ends.append(time.perf_counter())

    handle = module.register_forward_hook(hook)
    try:
        yield ends
    finally:
        handle.remove()


def timed(
    module: torch.nn.Module, device: torch.device, call: Callable[[], list[list[int]]]
) -> Call:
    """Run ``call`` once, split at the end of ``module``'s first forward."""
    with _forward_clock(module, device) as ends:
        _sync(device)
        start = time.perf_counter()
        tokens = call()
        _sync(device)
        stop = time.perf_counter()
    if not ends:
        raise RuntimeError(
            f"{type(module).__name__}.forward never ran: the timing split is unknown."
        )
    return Call(ends[0] - start, stop - ends[0], len(ends), tokens)


def ours_call(gen: Any, prompts: list[list[int]], new_tokens: int) -> Callable[[], list[list[int]]]:
    """One ``generate_requests`` call (greedy, ``stop_at_eod=False``) -> generated ids per row."""
    from megatron.text_generation.generation import PromptRequest
    from megatron.text_generation.sampling import SamplingParams

    greedy = SamplingParams(greedy=True)
    requests = [
        PromptRequest(
            prompt=" ".join(map(str, ids)),
            max_new_tokens=new_tokens,
            params=greedy,
            seed=i,
            stop_at_eod=False,
        )
        for i, ids in enumerate(prompts)
    ]
    return lambda: [list(g.tokens) for g in gen.generate_requests(requests)]


def hf_call(
    hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int
) -> Callable[[], list[list[int]]]:
    """One ``model.generate`` call (greedy, exactly ``new_tokens``, KV cache) -> generated ids per row."""
    device = next(hf.parameters()).device
    ids = torch.tensor(prompts, dtype=torch.long, device=device)  # [b, P]

    def call() -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(  # type: ignore[operator]
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                use_cache=True,
            )
        return out[:, ids.shape[1] :].tolist()  # [b, P + N] -> [b, N]

    return call


def _rates(calls: list[Call], batch: int, prompt_length: int, new_tokens: int) -> dict[str, Any]:
    prefill = statistics.median(c.prefill_s for c in calls)
    decode = statistics.median(c.decode_s for c in calls)
    return {
        "prefill_s": prefill,
        "decode_s": decode,
        "prefill_tokens_per_s": batch * prompt_length / prefill,
        "decode_tokens_per_s": batch * (new_tokens - 1) / decode,
        "forwards": calls[-1].forwards,
        "times_s": [[c.prefill_s, c.decode_s] for c in calls],
    }


def _agreement(ours: list[list[int]], hf: list[list[int]]) -> dict[str, Any]:
    """Rows whose greedy tokens match, and the first position where any row differs."""
    first = None
    for a, b in zip(ours, hf):
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is None and len(a) != len(b):
            diff = min(len(a), len(b))
        if diff is not None and (first is None or diff < first):
            first = diff
    same = sum(a == b for a, b in zip(ours, hf))
    return {"tokens_agree": same == len(ours), "rows_agree": same, "first_divergence": first}


def bench_batch(
    gen: Any,
    hf: torch.nn.Module,
    *,
    batch: int,
    prompt_length: int,
    new_tokens: int,
    repeats: int,
    seed: int,
) -> dict[str, Any]:
    """Ours and HF at one batch size: a warm-up call each, then ``repeats`` alternating timed calls."""
    g = torch.Generator().manual_seed(seed + batch)
    prompts = torch.randint(0, gen.tokenizer.eod, (batch, prompt_length), generator=g).tolist()
    runs = {"ours": ours_call(gen, prompts, new_tokens), "hf": hf_call(hf, prompts, new_tokens)}
    device = gen.device
    tops = {name: outermost_module(call) for name, call in runs.items()}  # also the warm-up
    calls: dict[str, list[Call]] = {"ours": [], "hf": []}
    for _ in range(repeats):
        for name, call in runs.items():
            calls[name].append(timed(tops[name], device, call))
    ours, theirs = (_rates(calls[k], batch, prompt_length, new_tokens) for k in ("ours", "hf"))
    return {
        "batch": batch,
        "ours": {**ours, "timed_module": type(tops["ours"]).__name__},
        "hf": {**theirs, "timed_module": type(tops["hf"]).__name__},
        "ratio": {
            k: ours[f"{k}_tokens_per_s"] / theirs[f"{k}_tokens_per_s"]
            for k in ("prefill", "decode")
        },
        **_agreement(calls["ours"][-1].tokens, calls["hf"][-1].tokens),
    }


def format_table(report: dict[str, Any]) -> str:
    """The stdout table of a :func:`run` report."""
    s = report["setup"]
    lines = [
        f"# {s['preset']} {s['num_layers']}x{s['hidden_size']} ({s['params'] / 1e6:.1f}M params), "
        f"{s['dtype']}, {s['device']}, {s['threads']} threads, P={s['prompt_length']}, "
        f"N={s['new_tokens']}, median of {s['repeats']}; HF {s['hf_class']} ({s['hf_attn']})",
        f"{'batch':>5} {'':5} {'prefill tok/s':>14} {'decode tok/s':>13} {'prefill ms':>11} "
        f"{'decode ms':>10} {'fwd':>4}",
    ]
    for row in report["results"]:
        for name in ("ours", "hf"):
            r = row[name]
            lines.append(
                f"{row['batch']:5d} {name:5} {r['prefill_tokens_per_s']:14.1f} "
                f"{r['decode_tokens_per_s']:13.1f} {r['prefill_s'] * 1e3:11.1f} "
                f"{r['decode_s'] * 1e3:10.1f} {r['forwards']:4d}"
            )
        agree = (
            "yes" if row["tokens_agree"] else f"NO (first divergence at {row['first_divergence']})"
        )
        lines.append(
            f"{row['batch']:5d} {'ratio':5} {row['ratio']['prefill']:13.2f}x "
            f"{row['ratio']['decode']:12.2f}x   greedy tokens agree: {agree} "
            f"({row['rows_agree']}/{row['batch']} rows)"
        )
    return "\n".join(lines)


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Build the models and benchmark every batch size; the report (also what ``--json`` writes)."""
    import transformers
    from transformers.utils import logging as hf_logging

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    cfg = model_config(a)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights" would interleave with the table
    try:
        gen, hf, n_params = build_models(cfg, seed=a.seed, device=device, dtype=dtype)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    results = [
        bench_batch(
            gen,
            hf,
            batch=b,
            prompt_length=a.prompt_length,
            new_tokens=a.new_tokens,
            repeats=a.repeats,
            seed=a.seed,
        )
        for b in a.batch_sizes
    ]
    setup = {
        "preset": a.preset,
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "ffn_hidden_size": cfg.ffn_size,
        "seq_length": cfg.seq_length,
        "vocab_size": cfg.vocab_size,
        "params": n_params,
        "prompt_length": a.prompt_length,
        "new_tokens": a.new_tokens,
        "repeats": a.repeats,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "dtype": "bf16" if a.bf16 else "fp32",
        "hf_class": type(hf).__name__,
        "hf_attn": getattr(hf.config, "_attn_implementation", None),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return {"setup": setup, "results": results}


def main(argv: list[str] | None = None) -> int:
    threads = torch.get_num_threads()
    try:
        a = parse(argv)
        torch.set_num_threads(a.threads)
        report = run(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    finally:
        torch.set_num_threads(threads)
    print(format_table(report))
    if a.json is not None:
        a.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
