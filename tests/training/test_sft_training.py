"""--sft training is layout-independent and its loss is the global per-token mean, in real runs.

Every run is ``megatron.training.pretrain(cfg)`` with ``--sft`` on spawned gloo ranks with the real engines, on
conversations written with our builders (``P`` + ``P_loss_mask``; 2 to 60 tokens, so 33-token packs hold several
and a few are truncated), the flags and sizes of ``test_train_parity.py`` (dropout 0, fp32; global batch 8).

The layouts also group the global batch into micro-batches differently (micro-batch 1, 2 or 4): the mean of
micro-batch means would then differ between them (SFT packs hold very different numbers of loss tokens), so equal
losses check the global per-token rule in a real run too, training and evaluation (measured: the mean-of-means
curves of the default test differ by 7e-4; the parity is 8e-8). Tolerance 1e-5 relative, ``test_train_parity.py``'s reasoning.

Default: on 2 ranks, DP 2 with ZeRO-2 (micro-batch 2) against PP 2 (micro-batch 1, the pipeline engine). Slow:
TP 2 x PP 2 and DP 2 x CP 2 (4 ranks), DP 2 with ZeRO-1 and ZeRO-3, DeepSpeed-Ulysses 2 against 1 rank.
"""

from __future__ import annotations

import pytest

from tests.data.test_sft_dataset import write_sft_dataset
from tests.training.test_train_parity import _argv

ITERS = 4
RTOL = 1e-5
VOCAB = 299  # NullTokenizer: ids 0..298 (EOD 299)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    import numpy as np

    prefix = str(tmp_path_factory.mktemp("sft") / "chat_text_document")
    lengths = np.random.default_rng(1).integers(2, 61, 300).tolist()
    write_sft_dataset(prefix, lengths, vocab=VOCAB)
    return prefix


def _sft(prefix: str, tp: int, pp: int, mbs: int, *extra: str) -> list[str]:
    argv = [a for a in _argv("llama", tp, pp, *extra) if a != "--mock-data"]
    return [
        *argv,
        "--sft", "--data-path", prefix, "--split", "90,10,0",
        "--train-iters", str(ITERS), "--micro-batch-size", str(mbs),
        "--eval-interval", str(ITERS), "--eval-iters", "1",
    ]  # fmt: skip


def _train_many(argvs: list[list[str]]) -> list[tuple[list[float], float | None]]:
    from megatron.config import parse_args
    from megatron.training import pretrain

    out = []
    for argv in argvs:
        result = pretrain(parse_args(argv))
        assert result.exit_code == 0 and result.iteration == ITERS
        out.append((result.losses, result.valid_loss))
    return out


def _runs(world: int, argvs: list[list[str]]) -> list[tuple[list[float], float | None]]:
    from megatron.testing import run_distributed

    per_rank = run_distributed(_train_many, world, argvs, init_process_group=False, timeout=900)
    for r, runs in enumerate(per_rank):
        assert runs == per_rank[0], f"rank {r} logged other losses than rank 0"
    return per_rank[0]


def _max_rel(a: tuple[list[float], float | None], b: tuple[list[float], float | None]) -> float:
    (la, va), (lb, vb) = a, b
    assert len(la) == len(lb) == ITERS and va is not None and vb is not None
    return max(abs(x - y) / abs(y) for x, y in zip([*la, va], [*lb, vb], strict=True))


def test_sft_dp2_zero2_matches_pp2(sft_data: str) -> None:
    dp2, pp2 = _runs(
        2,
        [
            _sft(sft_data, 1, 1, 2, "--zero-stage", "2"),  # DP 2, gas 2
            _sft(sft_data, 1, 2, 1),  # PP 2: the pipeline engine, gas 8
        ],
    )
    assert dp2[0][-1] < dp2[0][0]  # it learns
    assert _max_rel(pp2, dp2) < RTOL, _max_rel(pp2, dp2)


@pytest.mark.slow
def test_sft_layouts_match_one_rank(sft_data: str) -> None:
    (one,) = _runs(1, [_sft(sft_data, 1, 1, 4)])
    tp2pp2, cp2 = _runs(
        4,
        [
            _sft(sft_data, 2, 2, 1),  # TP 2 x PP 2
            _sft(sft_data, 1, 1, 2, "--context-parallel-size", "2"),  # DP 2 x CP 2
        ],
    )
    zero1, zero3, ulysses = _runs(
        2,
        [
            _sft(sft_data, 1, 1, 1, "--zero-stage", "1"),  # DP 2, gas 4
            _sft(sft_data, 1, 1, 4, "--zero-stage", "3"),  # DP 2, gas 1
            _sft(sft_data, 1, 1, 2, "--ds-sequence-parallel-size", "2"),  # Ulysses 2
        ],
    )
    diffs = {
        "tp2 pp2": _max_rel(tp2pp2, one),
        "dp2 cp2": _max_rel(cp2, one),
        "dp2 zero1": _max_rel(zero1, one),
        "dp2 zero3": _max_rel(zero3, one),
        "ulysses2": _max_rel(ulysses, one),
    }
    print("sft layout parity (max relative difference to 1 rank):", diffs)
    assert all(d < RTOL for d in diffs.values()), diffs
