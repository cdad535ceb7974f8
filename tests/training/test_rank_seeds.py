"""Dropout seeds per rank (``initialize.set_seeds``): one default stream per pipeline stage and DeepSpeed-Ulysses
rank, shared by a TP group and by the data-parallel ranks (Megatron's ``seed + 100 * pp_rank``, plus our Ulysses
offset); the tracker's model-parallel stream differs on every (stage, Ulysses rank, TP rank).

One 8-rank spawn, two layouts: TP 2 x PP 2 x Ulysses 2, then TP 2 x PP 2 x DP 2.
"""

from __future__ import annotations

import pytest

from megatron.testing import run_distributed
from megatron.training.initialize import rank_seed

LAYOUTS = [(2, 2, 2), (2, 2, 1)]  # (tp, pp, ulysses); dp = 8 / (tp * pp * ulysses)


def _draws() -> list[dict[str, object]]:
    import torch

    from megatron import mpu
    from megatron.training.initialize import set_seeds

    out = []
    for tp, pp, sp in LAYOUTS:
        state = mpu.initialize_model_parallel(tp, pp, ds_sequence_parallel_size=sp)
        set_seeds(1234, state, device_type="cpu")
        default = torch.rand(4).tolist()
        with mpu.get_cuda_rng_tracker().fork():
            tracker = torch.rand(4).tolist()
        coords = (
            mpu.get_tensor_model_parallel_rank(),
            mpu.get_pipeline_model_parallel_rank(),
            mpu.get_sequence_parallel_rank(),
            mpu.get_data_parallel_rank(),
        )
        out.append({"coords": coords, "default": default, "tracker": tracker})
        mpu.destroy_model_parallel()
    return out


def test_rank_seed_values() -> None:
    assert rank_seed(1234, 0, 0) == 1234  # one stage, no Ulysses: the seed itself, as before
    assert rank_seed(1234, 3, 0) == 1234 + 300  # Megatron's stage offset
    seeds = {
        rank_seed(7, pp, sp) + 2718 + tp for pp in range(64) for sp in range(16) for tp in range(64)
    }
    seeds |= {rank_seed(7, pp, sp) for pp in range(64) for sp in range(16)}
    assert len(seeds) == 64 * 16 * 64 + 64 * 16  # no two streams share a seed


@pytest.mark.timeout(300)
def test_streams_per_stage_and_ulysses_rank() -> None:
    per_rank = run_distributed(_draws, 8, timeout=240)
    for i, (tp, pp, sp) in enumerate(LAYOUTS):
        rows = [r[i] for r in per_rank]
        for a in rows:
            for b in rows:
                (ta, pa, sa, _), (tb, pb, sb, _) = a["coords"], b["coords"]
                same_default = (pa, sa) == (pb, sb)
                assert (a["default"] == b["default"]) == same_default, (
                    tp,
                    pp,
                    sp,
                    a["coords"],
                    b["coords"],
                )
                same_tracker = (pa, sa, ta) == (pb, sb, tb)
                assert (a["tracker"] == b["tracker"]) == same_tracker, (
                    tp,
                    pp,
                    sp,
                    a["coords"],
                    b["coords"],
                )
        if sp == 1:  # data-parallel ranks share both streams (dp = 2 here)
            assert {r["coords"][3] for r in rows} == {0, 1}
