"""GPU checks of the RNG checkpoint file (skipped without CUDA): CUDA generator and tracker states survive a
save/restore, so dropout on the GPU resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.checkpointing.rng import load_rng_file, save_rng_file
from megatron.mpu.random import get_cuda_rng_tracker


@pytest.mark.gpu
def test_cuda_rng_states_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(11)
    torch.cuda.manual_seed(11)
    tracker = get_cuda_rng_tracker()
    tracker.reset("cuda")  # the run's device (a CPU test before may have set 'cpu')
    tracker.add("model-parallel-rng", 2718)
    path = tmp_path / "rng.safetensors"
    save_rng_file(path)

    def draw() -> list[torch.Tensor]:
        out = [torch.rand(8, device="cuda"), torch.rand(4)]
        with tracker.fork():
            out.append(torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5))
        return [t.cpu() for t in out]

    first = draw()
    load_rng_file(path)
    again = draw()
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(draw()[0], first[0])  # the streams do advance
