"""Written files get the mode the umask gives (0644 under 022), not the 0600 of mkstemp / safetensors.

On a shared cluster a dataset or checkpoint written 0600 is unreadable to the rest of the team. The dataset builder
(``.bin`` / ``.idx`` through a temporary file and rename) and the per-rank RNG file (safetensors) are checked here;
the HF export's ``model.safetensors`` in tests/checkpointing/test_ckpt_tools_errors.py.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from megatron.checkpointing.rng import save_rng_file
from megatron.data.indexed_builder import make_builder
from megatron.data.indexed_dataset import MMapIndexedDataset, apply_umask_mode, write_index


@pytest.fixture(params=[0o022, 0o027])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_dataset_files_follow_the_umask(tmp_path: Path, umask: int) -> None:
    want = 0o666 & ~umask  # 0644 under 022, 0640 under 027
    builder = make_builder(str(tmp_path / "d.bin"), vocab_size=1000)
    builder.add_doc(np.array([1, 2, 3]), [3])
    builder.finalize(str(tmp_path / "d.idx"))
    assert (_mode(tmp_path / "d.bin"), _mode(tmp_path / "d.idx")) == (want, want)
    assert len(MMapIndexedDataset(str(tmp_path / "d"))) == 1
    write_index(str(tmp_path / "e.idx"), np.uint16, [2], [0, 1])
    assert _mode(tmp_path / "e.idx") == want
    assert not list(tmp_path.glob("*.tmp"))
    assert os.umask(umask) == umask  # the helper put the umask back


def test_rng_file_follows_the_umask(tmp_path: Path, umask: int) -> None:
    path = tmp_path / "rng_state_rank00000.safetensors"
    save_rng_file(path)
    assert _mode(path) == 0o666 & ~umask


def test_apply_umask_mode_widens_and_narrows(tmp_path: Path, umask: int) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x")
    for start in (0o600, 0o777):
        os.chmod(path, start)
        apply_umask_mode(path)
        assert _mode(path) == 0o666 & ~umask
