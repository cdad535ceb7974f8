"""Weights-only loading: safetensors and plain torch.save tensors load; pickled objects are refused, not executed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron.checkpointing.safe_load import load_hf_directory, load_state_dict_file

SD = {"a.weight": torch.arange(6.0).view(2, 3), "b.bias": torch.ones(4, dtype=torch.bfloat16)}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


class _Evil:
    def __reduce__(self):
        return (Path.touch, (Path(_Evil.target),))

    target = ""


def test_accepts_safetensors_and_weights_only_bin(tmp_path: Path) -> None:
    save_file(SD, tmp_path / "w.safetensors")
    _same(load_state_dict_file(tmp_path / "w.safetensors"), SD)
    torch.save(SD, tmp_path / "w.bin")
    _same(load_state_dict_file(str(tmp_path / "w.bin")), SD)


def test_refuses_pickled_objects_without_running_them(tmp_path: Path) -> None:
    torch.save({**SD, "args": argparse.Namespace(lr=1.0)}, tmp_path / "ckpt.pt")
    with pytest.raises(
        ValueError,
        match=r"pickled Python objects \(e\.g\. argparse\.Namespace\).*trusted source.*safetensors",
    ):
        load_state_dict_file(tmp_path / "ckpt.pt")

    # A payload that would create a file when unpickled: refused, and the file is never created.
    _Evil.target = str(tmp_path / "pwned")
    torch.save({"x": _Evil()}, tmp_path / "evil.bin")
    with pytest.raises(ValueError, match="refuses to unpickle"):
        load_state_dict_file(tmp_path / "evil.bin")
    assert not (tmp_path / "pwned").exists()


def test_clear_errors_for_bad_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_state_dict_file(tmp_path / "missing.bin")
    (tmp_path / "junk.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable PyTorch weights file"):
        load_state_dict_file(tmp_path / "junk.bin")
    (tmp_path / "junk.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        load_state_dict_file(tmp_path / "junk.safetensors")
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="holds a list, not a state dict"):
        load_state_dict_file(tmp_path / "list.pt")
    torch.save({"model": SD, "iteration": 3}, tmp_path / "nested.pt")
    with pytest.raises(
        ValueError, match=r"not a flat state dict.*weights may be under \['model'\]"
    ):
        load_state_dict_file(tmp_path / "nested.pt")


def test_hf_directory_variants(tmp_path: Path) -> None:
    config = {"model_type": "gpt2", "n_embd": 3}
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_directory(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_directory(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_hf_directory(tmp_path)

    torch.save(SD, tmp_path / "pytorch_model.bin")
    sd, cfg = load_hf_directory(tmp_path)
    _same(sd, SD)
    assert cfg == config

    # Sharded safetensors wins over the .bin.
    save_file({"a.weight": SD["a.weight"]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b.bias": SD["b.bias"]}, tmp_path / "model-00002-of-00002.safetensors")
    index = {
        "metadata": {},
        "weight_map": {
            "a.weight": "model-00001-of-00002.safetensors",
            "b.bias": "model-00002-of-00002.safetensors",
        },
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    _same(load_hf_directory(tmp_path)[0], SD)
    index["weight_map"]["c.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match=r"lists tensors that no shard contains \(e\.g\. \['c\.weight'\]\)"
    ):
        load_hf_directory(tmp_path)

    save_file(SD, tmp_path / "model.safetensors")  # single file wins over everything
    _same(load_hf_directory(tmp_path)[0], SD)
