"""The checksummed save's write path: each large chunk written in pieces whose write-back starts at once, every file
``fdatasync``'ed before it is recorded, the directory synced before the rank's record is written."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron.checkpointing import checksums
from megatron.checkpointing.checksums import ALGORITHM, ChecksumRecorder


def _spy(monkeypatch: pytest.MonkeyPatch, name: str, calls: list[tuple[Any, ...]]) -> None:
    """Record each call of ``os.<name>`` (with the synced file's size or 'dir'), then make the real call."""
    real = getattr(os, name)

    def spy(fd: int, *args: Any) -> Any:
        st = os.fstat(fd)
        calls.append((name, "dir" if stat.S_ISDIR(st.st_mode) else st.st_size, *args))
        return real(fd, *args)

    monkeypatch.setattr(os, name, spy)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise (Linux)")
def test_pieces_start_their_write_back_and_files_are_synced_before_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[Any, ...]] = []
    for name in ("fdatasync", "fsync", "posix_fadvise"):
        _spy(monkeypatch, name, calls)
    monkeypatch.setattr(checksums, "_PIECE", 1 << 20)
    recorder = ChecksumRecorder(tmp_path)
    state = {"w": torch.randn(900_000)}  # 3.6 MB: one record written as 4 pieces of <= 1 MiB
    recorder.torch_save(state, tmp_path / "model.pt", True)
    size = (tmp_path / "model.pt").stat().st_size
    kicks = [c for c in calls if c[0] == "posix_fadvise"]
    assert [c[3] for c in kicks] == [1 << 20] * 3 + [3_600_000 - 3 * (1 << 20)], kicks
    assert all(c[4] == os.POSIX_FADV_DONTNEED for c in kicks)
    offsets = [c[2] for c in kicks]  # contiguous pieces of the record, in order
    assert offsets == [offsets[0] + i * (1 << 20) for i in range(4)], kicks
    assert calls[-1] == (
        "fdatasync",
        size,
    )  # the whole file, before torch_save returned (and recorded it)
    digest = hashlib.sha256((tmp_path / "model.pt").read_bytes()).hexdigest()
    assert recorder.files["model.pt"] == {"bytes": size, ALGORITHM: digest}
    calls.clear()
    recorder.write_bytes(tmp_path / "rng.bin", b"x" * 100)
    assert calls == [("fdatasync", 100)]
    calls.clear()
    recorder.write_sidecar(0)
    assert calls == [("fsync", "dir")]  # the files' names are on disk before the record naming them
