"""Packed-document training (``--reset-attention-mask --reset-position-ids``) is layout-independent: the losses of
a few iterations at PP 2 (document ids carried through DeepSpeed's pipeline, with recomputation), under
DeepSpeed-Ulysses (ids kept whole), ZeRO-3, TP 2 + sequence parallelism and context parallelism 2 (documents
crossing the load-balanced chunks) equal those at PP 1 (DP 2), within 1e-5
relative.

Every run is ``megatron.training.pretrain(cfg)`` on spawned gloo ranks with the real engines, on a dataset of
short documents (1 to 24 tokens, each closed by its EOD) built in the test's directory, so every 32-token sample
packs several documents. The flags and sizes are ``test_train_parity.py``'s (dropout 0, fp32); the tolerance is
its reasoning too: layouts differ only in the order of fp32 reductions (about 1e-7 here).
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron.data.indexed_builder import make_builder
from tests.training.test_train_parity import _argv, _layouts

ITERS = 6
RTOL = 1e-5
VOCAB = 299  # NullTokenizer: ids 0..298, EOD = 299


@pytest.fixture(scope="module")
def packed_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    prefix = str(tmp_path_factory.mktemp("packed") / "short_text_document")
    rng = np.random.default_rng(0)
    builder = make_builder(prefix + ".bin", vocab_size=VOCAB + 1)
    for n in rng.integers(1, 25, 600):
        # n - 1 random tokens, then the EOD that closes the document
        builder.add_item(np.append(rng.integers(0, VOCAB, n - 1), VOCAB))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def _packed(preset: str, prefix: str, tp: int, pp: int, *extra: str) -> list[str]:
    argv = [a for a in _argv(preset, tp, pp, *extra) if a != "--mock-data"]
    return [*argv, "--data-path", prefix, "--split", "100,0,0", "--train-iters", str(ITERS)]


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == ITERS
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_packed_documents_layouts_match_pp1(packed_data: str) -> None:
    flags = ("--reset-attention-mask", "--reset-position-ids")
    pp1, pp2, ulysses, zero3, tp2, cp2, unpacked, gpt2_pp1, gpt2_pp2 = _layouts(
        2,
        [
            _packed("llama", packed_data, 1, 1, *flags),  # DP 2
            _packed("llama", packed_data, 1, 2, *flags, "--recompute-granularity", "full"),
            _packed("llama", packed_data, 1, 1, *flags, "--ds-sequence-parallel-size", "2"),
            _packed("llama", packed_data, 1, 1, *flags, "--zero-stage", "3"),
            _packed("llama", packed_data, 2, 1, *flags, "--sequence-parallel"),
            _packed("llama", packed_data, 1, 1, *flags, "--context-parallel-size", "2"),
            _packed("llama", packed_data, 1, 1),  # the same samples, attending across documents
            _packed("gpt2", packed_data, 1, 1, *flags),
            _packed("gpt2", packed_data, 1, 2, *flags),  # tied embeddings across the stages
        ],
        iters=ITERS,
    )
    # packing changes the numbers, or parity would be vacuous (measured: 4e-3; the parities 1.7e-7, 8e-8)
    assert _max_rel(unpacked, pp1) > 1e-3
    diffs = {
        "llama pp2": _max_rel(pp2, pp1),
        "llama ulysses2": _max_rel(ulysses, pp1),
        "llama zero3": _max_rel(zero3, pp1),
        "llama tp2 sp": _max_rel(tp2, pp1),
        "llama cp2": _max_rel(cp2, pp1),
        "gpt2 pp2": _max_rel(gpt2_pp2, gpt2_pp1),
    }
    assert all(d < RTOL for d in diffs.values()), diffs


@pytest.mark.slow
def test_packed_documents_moe_pp2_matches_pp1(packed_data: str) -> None:
    """An MoE model's pipe tuple carries both the document ids and the running MoE loss (LM + MoE loss compared)."""
    from tests.training.test_moe_train import _argv as moe_argv
    from tests.training.test_moe_train import _layouts as moe_layouts

    def argv(pp: int) -> list[str]:
        flags = [a for a in moe_argv(2, pp=pp) if a != "--mock-data"]
        data = ["--data-path", packed_data, "--split", "100,0,0", "--vocab-size", str(VOCAB)]
        return [*flags, *data, "--train-iters", str(ITERS), "--reset-attention-mask"]

    (pp1,) = moe_layouts(1, [argv(1)], iters=ITERS)
    (pp2,) = moe_layouts(2, [argv(2)], iters=ITERS)
    assert _max_rel(pp2, pp1) < RTOL, _max_rel(pp2, pp1)
