"""Generation at the training layout: one checkpoint generated at TP in {1, 2, 4} x PP in {1, 2}, against Hugging Face.

For a GPT-2 checkpoint saved at TP = 2 x PP = 2 (layer files) and a LLaMA-GQA checkpoint saved at TP = 4 x PP = 1
(``mp_rank`` files), every layout must give, for a batch of prompts of different lengths:

- greedy tokens equal to transformers' ``generate`` on the exported model, each prompt run alone there;
- per-token log-probs of the prompt and of the output within 1e-5 of ``log_softmax`` of transformers' logits;
- seeded top-k samples equal to the one-process run (each prompt its own generator);
- beam search (width 4, a stop token that does occur) equal to the reference written here, which follows
  Megatron's semantics on transformers' logits with no cache (transformers' own beam search scores lengths and
  stops differently, so it is not the oracle).

Every rank must return the same results. The one-process run also checks that a prompt batched with longer and
shorter ones gives what it gives alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron.model.presets import GPT2_FLAGS, LLAMA_FLAGS
from megatron.testing import run_distributed
from megatron.text_generation import PromptRequest, SamplingParams, TextGenerator

PROMPTS = ["5 17 3 99 42 8 1", "12", "7 7 30 61"]
NEW = 8
BEAM_WIDTH = 4
LENGTH_PENALTY = 0.8
COMMON = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
    "--mock-data", "--vocab-size", "199", "--eval-iters", "0", "--log-level", "WARNING", "--seed", "5",
]  # fmt: skip
MODELS = {
    "gpt2": (
        [*GPT2_FLAGS, *COMMON, "--init-method-std", "0.3", "--seq-length", "32", "--max-position-embeddings", "48"],
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "1"],
        4,
    ),
    "llama": (
        [*LLAMA_FLAGS, *COMMON, "--init-method-std", "0.2", "--num-key-value-heads", "4", "--ffn-hidden-size", "128",
         "--seq-length", "48"],
        ["--tensor-model-parallel-size", "4"],
        4,
    ),
}  # fmt: skip
LAYOUTS = {2: [(2, 1), (1, 2)], 4: [(4, 1), (2, 2)], 8: [(4, 2)]}


def _train(flags: list[str], ck: str) -> None:
    from megatron.config import parse_args
    from megatron.training import pretrain

    pretrain(parse_args([*flags, "--save", ck]))


def _requests(gen: TextGenerator) -> tuple[list[PromptRequest], list[PromptRequest]]:
    greedy = [
        PromptRequest(
            p, NEW, SamplingParams(greedy=True), seed=0, stop_at_eod=False, return_log_probs=True
        )
        for p in PROMPTS
    ]
    sampled = [
        PromptRequest(p, NEW - i, SamplingParams(top_k=5), seed=11 + i, stop_at_eod=False)
        for i, p in enumerate(PROMPTS)
    ]
    return greedy, sampled


def _run_all(gen: TextGenerator, stop: int) -> dict[str, Any]:
    greedy, sampled = _requests(gen)
    return {
        "greedy": [
            (g.tokens, g.log_probs, g.prompt_log_probs) for g in gen.generate_requests(greedy)
        ],
        "sampled": [g.tokens for g in gen.generate_requests(sampled)],
        "beam": [
            (b.tokens, b.score)
            for b in gen.beam_search(
                PROMPTS[0],
                beam_width=BEAM_WIDTH,
                max_new_tokens=NEW,
                stop_token=stop,
                length_penalty=LENGTH_PENALTY,
                num_return_gen=BEAM_WIDTH,
            )
        ],
    }


def _layouts(ck: str, layouts: list[tuple[int, int]], stop: int) -> dict[tuple[int, int], Any]:
    from megatron.mpu import parallel_state
    from megatron.text_generation.distributed import init_inference_distributed

    out = {}
    for tp, pp in layouts:
        layout = init_inference_distributed(tp, pp, ckpt_dir=ck, device="cpu")
        micro = (
            1 if (tp, pp) == (1, 2) else None
        )  # one layout pushes each prompt alone through the pipe
        gen = TextGenerator.from_checkpoint(ck, device="cpu", micro_batch_size=micro, layout=layout)
        out[(tp, pp)] = _run_all(gen, stop)
        parallel_state.destroy_model_parallel()
    return out


def _hf_reference(hf: Any, ids: list[int]) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens (transformers' generate) and log-probs of prompt and output (its logits)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(x, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        logp = torch.log_softmax(hf(out).logits.float(), dim=-1)[0]  # [n, V]
    seq = out[0].tolist()
    lp = [float(logp[i - 1, seq[i]]) for i in range(1, len(seq))]
    return seq[len(ids) :], lp[len(ids) - 1 :], lp[: len(ids) - 1]


def _extensions(
    hf: Any, ids: list[int], beams: list[tuple[list[int], float]]
) -> list[tuple[float, int, int]]:
    """``(score, beam, token)`` of every one-token extension of every beam, best first (ties: beam, token)."""
    cands = []
    for b, (toks, total) in enumerate(beams):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + toks])).logits[0, -1].double()
        for t, lp in enumerate(torch.log_softmax(logits, dim=-1).tolist()):
            cands.append((total + lp, b, t))
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    return cands


def _reference_beam(hf: Any, ids: list[int], stop: int) -> list[tuple[list[int], float]]:
    """Megatron's beam search on full forwards of transformers (written from its semantics, no cache)."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[float, list[int]]] = []

    def add(tokens: list[int], total: float) -> None:
        score = total / len(tokens) ** LENGTH_PENALTY
        if len(done) < BEAM_WIDTH or score > min(s for s, _ in done):
            done.append((score, tokens))
            if len(done) > BEAM_WIDTH:
                done.pop(min(range(len(done)), key=lambda i: done[i][0]))

    for step in range(NEW):
        cands = _extensions(hf, ids, beams if step else beams[:1])
        nxt = []
        for rank, (score, b, t) in enumerate(cands[: 2 * BEAM_WIDTH]):
            if t == stop:
                if rank < BEAM_WIDTH:
                    add(beams[b][0] + [t], score)
                continue
            nxt.append((beams[b][0] + [t], score))
            if len(nxt) == BEAM_WIDTH:
                break
        best = cands[0][0] / (step + 1) ** LENGTH_PENALTY
        if len(done) >= BEAM_WIDTH and min(s for s, _ in done) >= best:
            break
        beams = nxt
    else:
        for toks, total in beams:
            add(toks, total)
    return [(t, s) for s, t in sorted(done, key=lambda d: d[0], reverse=True)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[str, str]]:
    """``model -> (checkpoint dir, exported HF dir)``, each model trained once for the module when first asked."""
    from megatron.conversion.hf_export import export_to_hf

    made: dict[str, tuple[str, str]] = {}

    def get(model: str) -> tuple[str, str]:
        if model not in made:
            flags, layout, world = MODELS[model]
            root = tmp_path_factory.mktemp(model)
            ck = str(root / "ckpt")
            run_distributed(
                _train, world, [*flags, *layout], ck, init_process_group=False, timeout=300
            )
            export_to_hf(ck, root / "hf", verification=None)
            made[model] = (ck, str(root / "hf"))
        return made[model]

    return get


# All `slow` (suite time, ~19 s at world 2): TP 2 generation runs by default in test_server_parallel.py and
# test_generation.py, PP 2 through the engine in test_eval_during_training.py.
CASES = [
    pytest.param("llama", (2,), id="llama", marks=pytest.mark.slow),
    pytest.param("llama", (4, 8), id="llama-world4-8", marks=pytest.mark.slow),
    pytest.param("gpt2", (2, 4, 8), id="gpt2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("model", "worlds"), CASES)
def test_every_layout_generates_what_transformers_does(
    model: str, worlds: tuple[int, ...], checkpoints: Callable[[str], tuple[str, str]]
) -> None:
    from transformers import AutoModelForCausalLM

    ck, hf_dir = checkpoints(model)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()

    gen = TextGenerator.from_checkpoint(ck, device="cpu")  # one process: TP = PP = 1
    ids = [gen.prompt_ids(p) for p in PROMPTS]
    ref = [_hf_reference(hf, i) for i in ids]
    stop = ref[0][0][2]  # a token greedy decoding does reach: some beams end on it
    beam_ref = _reference_beam(hf, ids[0], stop)
    assert any(t[-1] == stop for t, _ in beam_ref)  # the stop rule is exercised

    results = {(1, 1): _run_all(gen, stop)}
    # Batching: each prompt alone gives what it gives in the batch.
    greedy, sampled = _requests(gen)
    for batch in (greedy, sampled):
        together = gen.generate_requests(batch)
        for req, got in zip(batch, together, strict=True):
            assert gen.generate_requests([req])[0].tokens == got.tokens
    for w in worlds:
        per_rank = run_distributed(_layouts, w, ck, LAYOUTS[w], stop, timeout=300)
        for i, r in enumerate(per_rank[1:], start=1):
            for k in r:
                for part in r[k]:
                    assert r[k][part] == per_rank[0][k][part], (
                        w,
                        i,
                        k,
                        part,
                        r[k][part],
                        per_rank[0][k][part],
                    )
        results.update(per_rank[0])

    base = results[(1, 1)]
    for key, got in results.items():
        for (tokens, lp, plp), (ref_tokens, ref_lp, ref_plp) in zip(
            got["greedy"], ref, strict=True
        ):
            assert tokens == ref_tokens, (key, tokens, ref_tokens)
            assert (
                max(abs(a - b) for a, b in zip(lp + plp, ref_lp + ref_plp, strict=True)) <= 1e-5
            ), key
        assert got["sampled"] == base["sampled"], key
        assert [t for t, _ in got["beam"]] == [t for t, _ in beam_ref], (key, got["beam"], beam_ref)
        assert all(abs(a - b) <= 1e-5 for (_, a), (_, b) in zip(got["beam"], beam_ref, strict=True))


def _torchrun(nproc: int, argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
    ]
    cmd += ["tools/generate_text.py", *argv, "--device", "cpu"]
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow  # ~16 s (suite time): generation at TP x PP runs in-process above (world 2), the CLI in
# test_generate_text_cli.py, a torchrun-launched TP 2 generation process in test_server_parallel.py
def test_generate_text_cli_under_torchrun(
    checkpoints: Callable[[str], tuple[str, str]], tmp_path: Path
) -> None:
    """tools/generate_text.py launched with torchrun at TP = 2 x PP = 2 writes what one process writes; a layout
    that does not fill the world is one error line and a non-zero exit."""
    from tools import generate_text

    ck = checkpoints("llama")[0]  # saved at TP 4, generated at TP 2 x PP 2
    args = [
        "--load",
        ck,
        "--prompt",
        PROMPTS[0],
        "--prompt",
        PROMPTS[2],
        "--top_k",
        "4",
        "--seed",
        "9",
    ]
    args += ["--num-samples", "2", "--out-seq-length", "6", "--return-log-probs"]
    beam = ["--load", ck, "--prompt", PROMPTS[2], "--beam-width", "3", "--num-samples", "2"]
    beam += ["--out-seq-length", "5"]
    one, one_beam = tmp_path / "one.jsonl", tmp_path / "one_beam.jsonl"
    assert generate_text.main([*args, "--device", "cpu", "--sample-output-file", str(one)]) == 0
    assert (
        generate_text.main([*beam, "--device", "cpu", "--sample-output-file", str(one_beam)]) == 0
    )
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    four = tmp_path / "four.jsonl"
    run = _torchrun(
        4, [*args, *layout, "--sample-output-file", str(four), "--micro-batch-size", "1"]
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(x) for x in four.read_text().splitlines()]
    ref = [json.loads(x) for x in one.read_text().splitlines()]
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in ref] and len(rows) == 4
    for r, e in zip(rows, ref, strict=True):
        got, want = r["prompt_log_probs"] + r["log_probs"], e["prompt_log_probs"] + e["log_probs"]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5
    four_beam = tmp_path / "four_beam.jsonl"
    run = _torchrun(4, [*beam, *layout, "--sample-output-file", str(four_beam)])
    assert run.returncode == 0, run.stderr[-3000:]
    got_beam = [json.loads(x) for x in four_beam.read_text().splitlines()]
    want_beam = [json.loads(x) for x in one_beam.read_text().splitlines()]
    assert len(got_beam) == 2
    assert [r["tokens"] for r in got_beam] == [r["tokens"] for r in want_beam]
    bad = _torchrun(2, ["--load", ck, "--prompt", "1 2", "--tensor-model-parallel-size", "4"])
    assert bad.returncode != 0
    message = "error: --tensor-model-parallel-size (4) x --pipeline-model-parallel-size (1)"
    assert bad.stderr.count(message) == 1  # rank 0 alone prints it
