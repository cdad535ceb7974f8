"""Checksums of checkpoint files: SHA-256 of every file a save writes, computed while it is written, recorded in
``trident_meta.json`` and checked before a load reads the file.

Why SHA-256: a flipped byte in a tensor's data unpickles without complaint (the issue's "2,000 flipped bytes loaded
and training saved on top"), so only a digest of the bytes catches it. SHA-256 runs at about 1.3 GB/s per core here
(the CPU's SHA extensions; BLAKE2b 0.6 GB/s, CRC-32 2.3 GB/s but no protection against a deliberate change), and
``sha256sum`` checks a file by hand.

While writing, no second read: DeepSpeed writes each file with ``checkpoint_engine.save(state_dict, path)``, which
``megatron.deepspeed_internals.checkpoint_saves_through`` routes to :meth:`ChecksumRecorder.torch_save`: the same
``torch.save`` into a file object that hashes each chunk as it passes (chunks of 1 MiB or more are hashed on a
second thread while the first writes them, so the hash costs little wall time; the disk starts writing each 64 MiB
piece back at once and every file is ``fdatasync``'ed before the save records it). Each rank writes
``.checksums_rank{R:05d}.json``; rank 0 merges them into the meta (``"checksums"``, below) and removes them.

::

    "checksums": {"algorithm": "sha256",
                  "files": {"mp_rank_00_model_states.pt": {"bytes": 1234, "sha256": "9f86d0..."}, ...}}

Names are relative to the tag directory. A load (``rules.check_checkpoint_dirs``, before any process group) checks
the size of every file the rank will read and, unless --no-verify-checkpoint-checksums, its digest; a mismatch is one
``ValueError`` naming the file, so nothing is loaded and nothing is overwritten.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import re
import threading
import zipfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

ALGORITHM = "sha256"
CHECKSUMS_KEY = "checksums"
SIDECAR_GLOB = ".checksums_rank*.json"
_PARALLEL_MIN = 1 << 20
"""Chunks this large are hashed on the helper thread while the caller's thread writes them (both drop the GIL)."""
_HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trident-sha256")
_PIECE = 64 << 20
"""A large chunk is written in pieces of this size, the write-back of each started as soon as it is written."""


def sidecar_name(rank: int) -> str:
    """The per-rank record of the files ``rank`` wrote in a tag (merged into the meta by rank 0)."""
    return f".checksums_rank{rank:05d}.json"


class _HashingWriter:
    """A write-only file object over the unbuffered file ``f``: every chunk goes to ``f`` and into a SHA-256, and
    the disk starts writing each piece back as soon as it is in the page cache (:func:`_start_writeback`)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.hash = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None
        """The first failed write (torch replaces it with an unrelated error when it closes the archive)."""

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= _PARALLEL_MIN:
            # ``view`` may point into a tensor that torch reuses after write() returns: wait for the hash here.
            pending = _HASHER.submit(self.hash.update, view)
            try:
                for start in range(0, view.nbytes, _PIECE):
                    offset = self.size
                    self._write_all(view[start : start + _PIECE])
                    _start_writeback(self._f.fileno(), offset, self.size - offset)
            finally:
                pending.result()
        else:
            self.hash.update(view)
            self._write_all(view)
        return view.nbytes

    def flush(self) -> None:
        """Nothing buffered here (the file is unbuffered)."""

    def _write_all(self, view: memoryview) -> None:
        try:
            done = 0
            while (
                done < view.nbytes
            ):  # an unbuffered file may write less (e.g. at a file-size limit)
                done += self._f.write(view[done:])
        except OSError as err:
            self.error = self.error or err
            raise
        self.size += view.nbytes


def _start_writeback(fd: int, offset: int, size: int) -> None:
    """Have the kernel start writing ``size`` bytes of ``fd`` at ``offset`` to disk now, without waiting.

    Left alone, dirty pages are written back only when they exceed ``vm.dirty_background_ratio`` of memory (GBs)
    or after 30 s: a checkpoint smaller than that sits in the page cache and the final ``fdatasync`` writes all of
    it while the save waits. Started piece by piece, the disk writes while the save still hashes and copies.
    ``POSIX_FADV_DONTNEED`` on Linux starts the write-back of the range's dirty pages without waiting for it (and
    drops the pages already clean: a checkpoint is not read back by the run that writes it). Elsewhere (no
    ``posix_fadvise``) the ``fdatasync`` at the end writes everything.
    """
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(
            OSError
        ):  # advice only: a file system that refuses it writes at the fdatasync
            os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)


def _write_durably(path: Path, write: Callable[[Any], None]) -> None:
    """Create ``path``, ``write(f)`` into it unbuffered, and ``fdatasync`` it before closing (its bytes are on the
    disk before the save's record of it is: a power loss after the commit cannot leave a complete-looking
    checkpoint with missing data)."""
    with path.open("wb", buffering=0) as f:
        write(f)
        getattr(os, "fdatasync", os.fsync)(f.fileno())


class ChecksumRecorder:
    """The ``{name: {"bytes", "sha256"}}`` of the files one rank writes into ``tag_dir`` during a save."""

    def __init__(self, tag_dir: Path) -> None:
        self.tag_dir = tag_dir
        self.files: dict[str, dict[str, Any]] = {}

    def _record(self, path: Path, size: int, digest: str) -> None:
        try:
            name = path.resolve().relative_to(self.tag_dir.resolve()).as_posix()
        except ValueError:
            return  # outside the tag (not a file a load of this tag reads)
        self.files[name] = {"bytes": size, ALGORITHM: digest}

    def torch_save(self, state_dict: Any, path: str | Path, zipfile_serialization: bool) -> None:
        """``torch.save(state_dict, path)`` as DeepSpeed's checkpoint engine does it, hashing the bytes written."""
        p = Path(path)
        # The SHA-256 covers every byte, so torch's own CRC-32 of each zip record (a second full pass over the data
        # on this thread, as long as the SHA-256 itself) is skipped: the records' CRC fields are 0. torch.load does
        # not check them; a generic zip tester (``unzip -t``) reports them.
        crc32 = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        writers: list[_HashingWriter] = []

        def save(f: Any) -> None:
            writers.append(_HashingWriter(f))
            try:
                torch.save(
                    state_dict, writers[0], _use_new_zipfile_serialization=zipfile_serialization
                )
            except Exception:
                err = writers[0].error
                if err is not None:
                    raise OSError(err.errno, err.strerror, str(p)) from None
                raise
            finally:
                torch.serialization.set_crc32_options(crc32)

        _write_durably(p, save)
        self._record(p, writers[0].size, writers[0].hash.hexdigest())

    def write_bytes(self, path: Path, data: bytes) -> None:
        """Write ``data`` to ``path`` (durably) and record it."""
        _write_durably(path, lambda f: f.write(data))
        self._record(path, len(data), hashlib.sha256(data).hexdigest())

    def write_sidecar(self, rank: int) -> None:
        """This rank's record, for rank 0 to merge (:func:`merge_sidecars`); the directories of the files it
        records are synced first (the files' names are on disk, not only their bytes)."""
        for folder in sorted({(self.tag_dir / name).parent for name in self.files}):
            _sync_directory(folder)
        (self.tag_dir / sidecar_name(rank)).write_text(json.dumps(self.files), encoding="utf-8")


def _sync_directory(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not openable as a directory here (e.g. Windows): the files themselves were synced
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def merge_sidecars(tag_dir: Path) -> dict[str, Any]:
    """The ``"checksums"`` meta entry from every rank's sidecar in ``tag_dir`` (rank 0, after a barrier)."""
    files: dict[str, Any] = {}
    for sidecar in sorted(tag_dir.glob(SIDECAR_GLOB)):
        files.update(json.loads(sidecar.read_text(encoding="utf-8")))
    return {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}


def remove_sidecars(tag_dir: Path) -> None:
    """Delete the per-rank records once the meta holds them."""
    for sidecar in tag_dir.glob(SIDECAR_GLOB):
        sidecar.unlink(missing_ok=True)


def checksums_of_tree(tag_dir: Path, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The ``"checksums"`` entry of every regular file under ``tag_dir`` (not symlinks), read back from disk: for
    files written by code that does not go through :class:`ChecksumRecorder` (``ds_to_universal``)."""
    skipped = set(skip)
    files: dict[str, Any] = {}
    for root, _, names in os.walk(tag_dir):
        for n in names:
            p = Path(root) / n
            rel = p.relative_to(tag_dir).as_posix()
            if p.is_symlink() or rel in skipped:
                continue
            files[rel] = {"bytes": p.stat().st_size, ALGORITHM: _file_digest(p)}
    return {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}


_DIGEST_CHUNK = 32 << 20
"""Bytes hashed per GIL release: large, so a digest on a background thread keeps running while the main thread is
busy in Python (with small chunks it would wait for the GIL after each one)."""


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return h.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, memoryview(m) as view:
            for start in range(0, size, _DIGEST_CHUNK):
                h.update(view[start : start + _DIGEST_CHUNK])
    return h.hexdigest()


def _is_own_file(name: str, *, rank: int, tp_rank: int, dp_rank: int, same_dp: bool) -> bool:
    """Whether a rank at (``tp_rank``, ``dp_rank``) of a PP = 1 run reads ``name`` (see :func:`files_to_verify`)."""
    if (m := re.fullmatch(r"rng_state_rank(\d+)\.safetensors", name)) is not None:
        return int(m.group(1)) == rank
    if (m := re.fullmatch(r"mp_rank_(\d+)_model_states\.pt", name)) is not None:
        return int(m.group(1)) == tp_rank
    if (
        m := re.search(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$", name)
    ) is not None:
        return int(m.group(2)) == tp_rank and (not same_dp or int(m.group(1)) == dp_rank)
    return True


def files_to_verify(
    meta: dict[str, Any],
    *,
    rank: int,
    run_tp: int,
    run_pp: int,
    run_dp: int,
    optimizer_state: bool,
) -> list[str]:
    """The recorded files a rank reads when it loads the checkpoint of ``meta`` (over-approximated: a file it may
    read is included). At PP = 1 and the saved TP a rank reads its own TP rank's model files and RNG file, and,
    when it loads the optimizer state at the saved DP size, only its own ZeRO partition; any other case (pipelines,
    universal checkpoints, layout changes, weights-only reads that gather every partition) reads everything."""
    names = sorted((meta.get(CHECKSUMS_KEY) or {}).get("files", {}))
    tp = int(meta.get("tensor_model_parallel_size", 0))
    pp = int(meta.get("pipeline_model_parallel_size", 0))
    if meta.get("universal") or (tp, pp) != (run_tp, run_pp) or pp != 1:
        return names
    saved_dp = int(meta.get("world_size", 0)) // tp
    tp_rank, dp_rank = rank % run_tp, (rank // run_tp) % run_dp
    same_dp = optimizer_state and saved_dp == run_dp
    return [
        n
        for n in names
        if _is_own_file(n, rank=rank, tp_rank=tp_rank, dp_rank=dp_rank, same_dp=same_dp)
    ]


def verify_checkpoint_files(
    tag_dir: Path, meta: dict[str, Any], names: list[str] | None = None, *, hashes: bool = True
) -> int:
    """Compare the files ``names`` (default: every recorded file) with the sizes and digests recorded at save time.

    Returns:
        How many files were checked (0: the checkpoint records no checksums).

    Raises:
        FileNotFoundError: a recorded file is missing.
        ValueError: a file's size or (with ``hashes``) digest differs: one line naming the file and the fix.
    """
    record = (meta.get(CHECKSUMS_KEY) or {}).get("files")
    if not record:
        return 0
    wanted = sorted(record) if names is None else names
    fix = (
        "restore the checkpoint directory from a good copy, or --load-tag an older checkpoint; nothing was "
        "loaded or overwritten"
    )
    for name in wanted:
        path = tag_dir / name
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint file {path} is missing (recorded at save); {fix}.")
        size, saved = path.stat().st_size, int(record[name]["bytes"])
        if size != saved:
            raise ValueError(
                f"checkpoint file {path} has {size} bytes but had {saved} when it was saved (truncated or "
                f"replaced); {fix}."
            )
    hashed = [n for n in wanted if ALGORITHM in record[n]] if hashes else []
    if not hashed:
        return len(wanted)
    workers = max(1, min(4, len(hashed), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        digests = dict(
            zip(hashed, pool.map(lambda n: _file_digest(tag_dir / n), hashed), strict=True)
        )
    for name in hashed:
        if digests[name] != record[name][ALGORITHM]:
            raise ValueError(
                f"checkpoint file {tag_dir / name} does not match its {ALGORITHM} checksum recorded at save "
                f"(damaged or modified since; --no-verify-checkpoint-checksums skips this check); {fix}."
            )
    return len(wanted)


def sizes_only(meta: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``meta`` whose checksum record keeps each file's size but no digest: readers given it compare
    sizes only (``--no-verify-checkpoint-checksums`` of the tools that read through a meta they are handed)."""
    record = meta.get(CHECKSUMS_KEY) or {}
    files = {n: {"bytes": r["bytes"]} for n, r in (record.get("files") or {}).items()}
    return {**meta, CHECKSUMS_KEY: {**record, "files": files}} if files else meta


class PendingVerification:
    """:func:`verify_checkpoint_files` with hashes, running on a daemon thread while the run builds its model and
    engine (the digests then cost start-up no wall time on a second core); :meth:`result` joins it and re-raises
    its error. The caller must join before anything reads the files."""

    def __init__(self, tag_dir: Path, meta: dict[str, Any], names: list[str]) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(tag_dir, meta, names), name="trident-verify", daemon=True
        )
        self._thread.start()

    def _run(self, tag_dir: Path, meta: dict[str, Any], names: list[str]) -> None:
        try:
            verify_checkpoint_files(tag_dir, meta, names)
        except (OSError, ValueError) as err:
            self._error = err

    def result(self) -> None:
        """Wait for the hashes; raises what :func:`verify_checkpoint_files` raised (one line naming the file)."""
        self._thread.join()
        if self._error is not None:
            raise self._error


def start_verification(
    tag_dir: Path, meta: dict[str, Any], names: list[str]
) -> PendingVerification:
    """Check the sizes of ``names`` now (a truncated file fails here) and start hashing them in the background."""
    verify_checkpoint_files(tag_dir, meta, names, hashes=False)
    return PendingVerification(tag_dir, meta, names)


def check_readable_archives(tag_dir: Path, names: Iterable[str]) -> None:
    """Without recorded checksums: every ``torch.save`` zip archive among ``names`` has its central directory (a
    truncated file does not), so a damaged file is one line here instead of a traceback inside DeepSpeed.

    Raises:
        ValueError: naming the file.
    """
    for name in names:
        path = tag_dir / name
        if path.suffix != ".pt" or not path.is_file():
            continue
        with path.open("rb") as f:
            if f.read(2) != b"PK":
                continue  # torch's legacy (non-zip) format: nothing cheap to check
        try:
            with zipfile.ZipFile(path) as z:
                z.infolist()
        except (zipfile.BadZipFile, OSError) as err:
            raise ValueError(
                f"checkpoint file {path} is not a readable torch.save archive ({err}): truncated or damaged; "
                "restore the checkpoint directory from a good copy, or --load-tag an older checkpoint."
            ) from None
