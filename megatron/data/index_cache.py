"""On-disk cache of index arrays, safe for many ranks and nodes building at once.

Layout (Megatron-LM 23.x / Megatron-DeepSpeed naming): a description string ``desc`` names the arrays; with
``h = md5(desc)`` the cache holds ``{h}.dsc`` (the description) and ``{h}_{name}.npy`` per array (``doc_idx``,
``sample_idx``, ``shuffle_idx`` for GPT; ``index``, ``sample_index`` for blends).

Concurrency contract (no rank-0 build, no barrier, no shared filesystem needed):

* Every file is written to a unique temporary name in its final directory (``.{file}.{host}.{pid}.{rand}.tmp``),
  flushed, ``fsync``-ed and moved into place with ``os.replace`` — atomic on POSIX filesystems (local, NFS, Lustre,
  GPFS). A reader therefore sees either no file or a complete one, never a partial file.
* The arrays are a deterministic function of the description, so ranks that miss the cache at the same time
  build byte-identical files; whichever ``os.replace`` lands last wins and nothing changes for readers (a reader
  that already memory-mapped the older inode keeps a valid mapping).
* Loading validates every file (``.npy`` header, size, dtype and shape via ``np.load(mmap_mode="r")``, the
  ``.dsc`` text, and a caller check); an incomplete or corrupted set — e.g. left by Megatron's own non-atomic
  writer — is logged and rebuilt in place.
* An unwritable cache directory is not fatal: the freshly built arrays are used from memory, with a warning that
  names ``--data-cache-path``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import uuid
from collections.abc import Callable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]


def desc_hash(desc: str) -> str:
    """Megatron's cache key: the md5 hex digest of the UTF-8 description."""
    return hashlib.md5(desc.encode("utf-8")).hexdigest()


def cache_file_paths(directory: str, desc: str, names: Sequence[str]) -> dict[str, str]:
    """``{"desc": .../{h}.dsc, name: .../{h}_{name}.npy ...}`` for one cache directory."""
    h = desc_hash(desc)
    paths = {"desc": os.path.join(directory, h + ".dsc")}
    paths.update({name: os.path.join(directory, f"{h}_{name}.npy") for name in names})
    return paths


def _temp_path(path: str) -> str:
    directory, base = os.path.split(path)
    tag = f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:12]}"
    return os.path.join(directory, f".{base}.{tag}.tmp")


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename itself is still atomic
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, writer: Callable[[object], None]) -> None:
    """Write ``path`` atomically: ``writer(fileobj)`` fills a unique temp file, then fsync and ``os.replace``."""
    tmp = _temp_path(path)
    try:
        with open(tmp, "wb") as f:
            writer(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(os.path.dirname(path))


def atomic_save_npy(path: str, array: np.ndarray) -> None:
    """``np.save`` to ``path`` atomically (no pickles)."""
    atomic_write_bytes(path, lambda f: np.save(f, array, allow_pickle=False))


def atomic_write_text(path: str, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, lambda f: f.write(text.encode("utf-8")))


def load_cached(
    paths: dict[str, str],
    desc: str,
    check: Callable[[Arrays], str | None],
    *,
    warn: bool = True,
) -> Arrays | None:
    """Memory-map a complete, valid cache set, or return None (missing) / log and return None (invalid).

    Args:
        paths: from :func:`cache_file_paths`.
        desc: the expected description (must equal the ``.dsc`` text).
        check: returns None when the arrays are consistent, else a reason.
        warn: log a warning for an invalid set.
    """
    if not all(os.path.isfile(p) for p in paths.values()):
        return None
    try:
        with open(paths["desc"], encoding="utf-8") as f:
            found = f.read()
        if found != desc:
            raise ValueError("the .dsc text differs from this dataset's description")
        arrays = {
            name: np.load(p, mmap_mode="r", allow_pickle=False)
            for name, p in paths.items()
            if name != "desc"
        }
        reason = check(arrays)
        if reason is not None:
            raise ValueError(reason)
    except (OSError, ValueError, EOFError, UnicodeDecodeError) as exc:
        if not warn:
            return None
        logger.warning(
            "index cache %s is incomplete or corrupted (%s); rebuilding it.", paths["desc"], exc
        )
        return None
    return arrays


def load_or_build(
    directories: Sequence[str],
    desc: str,
    names: Sequence[str],
    build: Callable[[], Arrays],
    check: Callable[[Arrays], str | None],
) -> tuple[Arrays, str | None]:
    """Return cached arrays from the first directory holding a valid set, else build, save and return them.

    Lookup follows Megatron: ``directories`` in order, the first valid set wins; otherwise the arrays are built
    and written where the first partial or invalid set was found, else into the last directory. Safe to call from any number of processes at once (see module docstring).

    Args:
        directories: cache directories to look in (non-empty).
        desc: description; its md5 names the files.
        names: array names (file suffixes).
        build: builds the arrays (deterministic in ``desc``).
        check: validates loaded arrays (None = fine, else a reason).

    Returns:
        ``(arrays, directory)``: memory-mapped arrays and the cache directory they came from, or the in-memory
        arrays and None when no directory could be written.
    """
    target = None
    for directory in directories:
        paths = cache_file_paths(directory, desc, names)
        found = load_cached(paths, desc, check)
        if found is not None:
            return found, directory
        if target is None and any(os.path.isfile(p) for p in paths.values()):
            target = (
                directory  # a broken or partial set (or one being written): complete it where it is
            )
    target = directories[-1] if target is None else target
    arrays = build()
    paths = cache_file_paths(target, desc, names)
    # Another rank may have finished the same build meanwhile: then skip the redundant write.
    done = (
        load_cached(paths, desc, check) if all(os.path.isfile(p) for p in paths.values()) else None
    )
    if done is not None:
        return done, target
    try:
        os.makedirs(target, exist_ok=True)
        for name in names:
            atomic_save_npy(paths[name], arrays[name])
        atomic_write_text(paths["desc"], desc)
    except OSError as exc:
        logger.warning(
            "could not write the index cache in %s (%s); using the indices from memory (they are rebuilt on "
            "every start). Point --data-cache-path at a writable directory to cache them.",
            target,
            exc,
        )
        return arrays, None
    loaded = load_cached(paths, desc, check)
    if loaded is None:
        raise RuntimeError(
            f"the index cache just written to {target} does not read back ({paths['desc']}); check the "
            "filesystem or point --data-cache-path elsewhere."
        )
    return loaded, target
