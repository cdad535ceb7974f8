"""Unit tests of the checkpoint plumbing that needs no process group: pointers, preflight, shape check, RNG files."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.checkpointing.engine_checkpoint import (
    META_FILE,
    check_save_dir,
    find_checkpoint,
    model_mismatches,
)
from megatron.checkpointing.rng import load_rng_file, save_rng_file
from megatron.config import ModelConfig
from megatron.mpu.random import get_cuda_rng_tracker


def _complete(root: Path, tag: str) -> None:
    (root / tag).mkdir(parents=True)
    (root / tag / META_FILE).write_text("{}")


def test_find_checkpoint(tmp_path: Path) -> None:
    assert find_checkpoint(str(tmp_path)) is None  # empty --load dir: start from scratch
    assert find_checkpoint(str(tmp_path / "missing")) is None
    _complete(tmp_path, "global_step3")
    (tmp_path / "global_step6").mkdir()  # a save killed before its marker
    (tmp_path / "latest").write_text("global_step3")
    assert find_checkpoint(str(tmp_path)) == "global_step3"
    assert find_checkpoint(str(tmp_path), "global_step3") == "global_step3"
    with pytest.raises(FileNotFoundError, match=r"--load-tag global_step6: .* is not a complete"):
        find_checkpoint(str(tmp_path), "global_step6")
    (tmp_path / "latest").write_text("global_step6")
    with pytest.raises(
        ValueError, match=r"'latest' points to 'global_step6', which is not a complete"
    ):
        find_checkpoint(str(tmp_path))


def test_check_save_dir(tmp_path: Path) -> None:
    check_save_dir(str(tmp_path / "new" / "dir"))  # created
    assert (tmp_path / "new" / "dir").is_dir() and not list((tmp_path / "new" / "dir").iterdir())
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"--save .*file/sub: the directory cannot be written"):
        check_save_dir(str(blocker / "sub"))


def test_model_mismatches_lists_every_field() -> None:
    cur = ModelConfig(num_layers=2, hidden_size=32, vocab_size=299, max_position_embeddings=128)
    saved = {**cur.__dict__, "num_layers": 4, "swiglu": True}
    assert model_mismatches(saved, cur) == [
        "num_layers: checkpoint 4, flags 2",
        "ffn_size: checkpoint 64, flags 128",
        "swiglu: checkpoint True, flags False",
    ]
    # Defaults resolve: an explicit 4h MLP and kv heads = heads match the implicit ones.
    explicit = {**cur.__dict__, "ffn_hidden_size": 128, "num_key_value_heads": 4}
    assert model_mismatches(explicit, cur) == []
    assert model_mismatches({**cur.__dict__, "seq_length": 999}, cur) == []  # not a shape


def test_rng_file_round_trip(tmp_path: Path) -> None:
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 77)
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.standard_normal()  # a cached gaussian in numpy's state
    path = tmp_path / "rng.safetensors"
    save_rng_file(path)

    def draw() -> tuple:
        with tracker.fork():
            t = torch.rand(3)
        return torch.rand(3).tolist(), t.tolist(), np.random.standard_normal(), random.random()

    expected = draw()
    draw()
    load_rng_file(path)
    assert draw() == expected
    assert path.read_bytes()[:8]  # a safetensors file (no pickle)
    with pytest.raises(FileNotFoundError, match="--no-load-rng"):
        load_rng_file(tmp_path / "other.safetensors")
    tracker.reset()
