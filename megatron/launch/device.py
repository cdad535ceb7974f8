"""The device a rank runs on: one rule for training, conversion and generation.

CPU when asked for (``--distributed-backend gloo``, ``DS_ACCELERATOR=cpu``, ``--device cpu``) or when torch sees no
GPU, so a CPU run never touches CUDA; on CUDA each rank takes GPU ``LOCAL_RANK % device_count``.
"""

from __future__ import annotations

import os

import torch


def device_type(backend: str = "auto") -> str:
    """'cuda' when a GPU is visible and neither ``backend`` 'gloo' nor DS_ACCELERATOR=cpu ask for CPU."""
    if backend == "gloo" or os.environ.get("DS_ACCELERATOR") == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def requested_device(requested: str | torch.device | None) -> str:
    """``requested`` (a ``--device`` value such as 'cpu', 'cuda', 'cuda:1', or a ``torch.device``) checked, else
    :func:`device_type`.

    Raises:
        ValueError: a CUDA device asked for where torch sees none.
    """
    if requested is None:
        return device_type()
    requested = str(requested)
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {requested}: this torch sees no CUDA device; use --device cpu.")
    return requested


def local_device(kind: str) -> torch.device:
    """This rank's ``torch.device`` of ``kind``: plain 'cuda' becomes GPU ``LOCAL_RANK % device_count``, made
    current; anything else ('cpu', 'cuda:1') is taken as it is."""
    if kind != "cuda":
        return torch.device(kind)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())
