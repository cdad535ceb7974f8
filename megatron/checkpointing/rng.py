"""Per-rank RNG states (python, numpy, torch, the mpu tracker) as a safetensors file: no pickle on load.

Every rank writes its own ``rng_state_rank{RANK:05d}.safetensors`` into the checkpoint's tag directory: the
states differ by rank (the tracker's model-parallel stream is seeded per TP rank; pipeline stages consume dropout
randomness differently), so one copy per rank is what exact resume needs.

Encoding: tensors ``torch/cpu``, ``torch/cuda`` (when the run's device is CUDA), ``numpy/keys`` (624 x uint32,
stored int64), ``python/state`` (625 ints, int64), ``tracker/<stream>/cpu`` and ``tracker/<stream>/cuda``; the few
scalars (numpy's position and cached gaussian, python's version) are JSON in the file's metadata.

The run's device type is the RNG tracker's (``mpu.model_parallel_cuda_manual_seed(..., device_type=...)`` at
start-up): a CPU run neither reads nor writes a CUDA generator, even where a GPU is visible.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, safe_open, save

from megatron.data.indexed_dataset import apply_umask_mode
from megatron.mpu.random import get_cuda_rng_tracker


def rng_file_name(rank: int) -> str:
    """File name of global rank ``rank``'s RNG states inside a tag directory."""
    return f"rng_state_rank{rank:05d}.safetensors"


def capture_rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This process's RNG states as (tensors, JSON-able scalars)."""
    tracker = get_cuda_rng_tracker()
    tensors: dict[str, torch.Tensor] = {
        f"torch/{dev}": t for dev, t in tracker.get_rng_state().items()
    }
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors["numpy/keys"] = torch.from_numpy(np.asarray(np_keys, dtype=np.int64))
    py_version, py_state, py_gauss = random.getstate()
    tensors["python/state"] = torch.tensor(py_state, dtype=torch.int64)
    for stream, state in tracker.get_states().items():
        for dev, t in state.items():
            tensors[f"tracker/{stream}/{dev}"] = t
    scalars = {
        "numpy": [np_name, int(np_pos), int(np_has_gauss), float(np_gauss)],
        "python": [py_version, py_gauss],
    }
    return {k: v.contiguous().clone() for k, v in tensors.items()}, scalars


def restore_rng_state(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (the CUDA parts only when the run's device is CUDA)."""
    tracker = get_cuda_rng_tracker()
    on_cuda = tracker.rng_device_type() == "cuda"
    tracker.set_rng_state(
        {k.split("/", 1)[1]: t for k, t in tensors.items() if k.startswith("torch/")}
    )
    np_name, np_pos, np_has_gauss, np_gauss = scalars["numpy"]
    keys = tensors["numpy/keys"].numpy().astype(np.uint32)
    np.random.set_state((np_name, keys, np_pos, np_has_gauss, np_gauss))
    py_version, py_gauss = scalars["python"]
    random.setstate((py_version, tuple(int(x) for x in tensors["python/state"].tolist()), py_gauss))
    streams: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if key.startswith("tracker/"):
            _, stream, dev = key.split("/", 2)
            streams.setdefault(stream, {})[dev] = t
    if streams:
        merged = tracker.get_states()
        for stream, state in streams.items():
            current = dict(merged.get(stream, {}))
            current.update({d: s for d, s in state.items() if d == "cpu" or on_cuda})
            merged[stream] = current
        tracker.set_states(merged)


def rng_file_bytes() -> bytes:
    """This process's RNG states as the bytes of an RNG file (safetensors; a snapshot, for --async-save)."""
    tensors, scalars = capture_rng_state()
    return save(tensors, metadata={"trident_rng": json.dumps(scalars)})


def write_rng_file(
    path: Path, data: bytes, write: Callable[[Path, bytes], None] | None = None
) -> None:
    """Write the RNG file ``data`` (from :func:`rng_file_bytes`) to ``path`` (mode from the umask, as the other
    files), through ``write(path, data)`` when given (the checksum recorder)."""
    if write is None:
        path.write_bytes(data)
    else:
        write(path, data)
    apply_umask_mode(path)


def save_rng_file(path: Path, write: Callable[[Path, bytes], None] | None = None) -> None:
    """Write this process's RNG states to ``path`` (:func:`rng_file_bytes`, :func:`write_rng_file`)."""
    write_rng_file(path, rng_file_bytes(), write)


def load_rng_file(path: Path) -> None:
    """Restore this process's RNG states from ``path``.

    Raises:
        FileNotFoundError: ``path`` does not exist (the checkpoint was saved with another world size).
    """
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the checkpoint has no RNG state for this rank (saved with a smaller world?); "
            "pass --no-load-rng to start with fresh RNG states."
        )
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    restore_rng_state(load_file(str(path)), json.loads(meta["trident_rng"]))
