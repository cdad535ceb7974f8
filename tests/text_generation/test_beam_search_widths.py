"""Beam search at widths near and above the vocabulary, against every sequence scored by brute force.

A tiny random model with an 8-token vocabulary (ids 0..6, EOD 7 the stop token) and 2 new tokens has 57 possible
hypotheses: ``[EOD]``, ``[t, EOD]`` and ``[t, u]`` for ``t, u`` in 0..6. Each one's score is computed here from
full forwards without the KV cache (log-softmax of the true vocabulary, summed, divided by ``length **
length_penalty``, the length counting EOD). A width of 64 beams leaves room for all of them, so the search must
return exactly that set; a width equal to the vocabulary must return real hypotheses with their true scores.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.mpu.context import ParallelContext
from megatron.text_generation import TextGenerator
from megatron.tokenizer import build_tokenizer

V = 8
EOD = V - 1
PROMPT = "1 2"
CFG = ModelConfig(
    num_layers=1,
    hidden_size=16,
    num_attention_heads=2,
    seq_length=16,
    max_position_embeddings=16,
    vocab_size=V,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)
TOL = 1e-5  # fp32 logits: the cached search and the uncached oracle differ in summation order only


@pytest.fixture(scope="module")
def gen() -> TextGenerator:
    tok = build_tokenizer(tokenizer_type="NullTokenizer", vocab_size=V - 1)  # ids 0..6, EOD 7
    model = GPTModel(CFG, ParallelContext(seed=4)).eval()
    return TextGenerator(model, CFG, tok, torch.device("cpu"))


def _brute_force(
    gen: TextGenerator, steps: int, length_penalty: float
) -> dict[tuple[int, ...], float]:
    """Every hypothesis of at most ``steps`` new tokens (only the last may be EOD) and its score."""
    prompt = gen.prompt_ids(PROMPT)
    seqs = [(EOD,)] if steps == 1 else [(EOD,), *((t, EOD) for t in range(EOD))]
    seqs += list(itertools.product(range(EOD), repeat=steps))
    scores = {}
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([prompt + list(seq)])  # [1, s]
            pos = torch.arange(ids.shape[1]).unsqueeze(0)  # [1, s]
            logits = gen.stage(ids, pos)[:, 0, :V]  # [s, 1, v] -> [s, V]
            logp = F.log_softmax(logits.double(), dim=-1)  # [s, V]
            n = len(prompt)
            total = sum(float(logp[n - 1 + i, t]) for i, t in enumerate(seq))
            scores[seq] = total / len(seq) ** length_penalty
    return scores


def _search(
    gen: TextGenerator, width: int, steps: int, lp: float
) -> list[tuple[tuple[int, ...], float]]:
    outs = gen.beam_search(
        PROMPT, beam_width=width, max_new_tokens=steps, length_penalty=lp, num_return_gen=width
    )
    got = [(tuple(o.tokens), float(o.score)) for o in outs]
    assert all(a[1] >= b[1] for a, b in itertools.pairwise(got)), got  # best first
    assert len({t for t, _ in got}) == len(got), got  # no duplicate hypothesis
    return got


@pytest.mark.parametrize("lp", [1.0, -0.5])
def test_beam_width_at_and_above_the_vocabulary(gen: TextGenerator, lp: float) -> None:
    # Width == vocabulary, one step: every one-token hypothesis, true scores (old: an invented [0] scored 0.0).
    truth = _brute_force(gen, 1, lp)
    got = _search(gen, V, 1, lp)
    assert {t for t, _ in got} == set(truth), got
    assert all(abs(s - truth[t]) <= TOL for t, s in got), (got, truth)

    # Width == vocabulary, two steps: V real hypotheses, each with its true score.
    truth = _brute_force(gen, 2, lp)
    got = _search(gen, V, 2, lp)
    assert len(got) == V and all(abs(s - truth[t]) <= TOL for t, s in got), (got, truth)

    # Width 64 > 57 hypotheses > vocabulary: the search is exhaustive, so it returns all of them and the
    # brute-force best first (old: duplicates of an invented hypothesis).
    got = _search(gen, 64, 2, lp)
    assert {t for t, _ in got} == set(truth), sorted(set(truth) - {t for t, _ in got})
    assert all(abs(s - truth[t]) <= TOL for t, s in got)
    assert got[0][0] == max(truth, key=truth.__getitem__)


def test_length_penalty_must_be_finite_and_bounded(gen: TextGenerator) -> None:
    for bad in (-math.inf, 1e308, math.nan, 10.5):
        with pytest.raises(
            ValueError, match=r"--length-penalty \(.*\) must be a finite number in \[-10, 10\]"
        ):
            gen.beam_search(PROMPT, beam_width=2, max_new_tokens=2, length_penalty=bad)
    for edge in (-10.0, 10.0):  # the bounds themselves give finite scores
        assert all(math.isfinite(s) for _, s in _search(gen, 2, 2, edge))
