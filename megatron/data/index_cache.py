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

Content keying (a stale cache never passes for a fresh one): the ``.dsc`` holds Megatron's description followed by
two lines of ours (Megatron only checks that the ``.dsc`` exists, never reads it, so it still finds the files)::

    Trident dataset idx-sha256 <32 hex> bin <bytes>        # the dataset's identity (GPT; absent for blends)
    Trident crc32 doc_idx=<8 hex> sample_idx=<8 hex> ...   # checksum of each array's data as written

A set whose identity differs from the dataset now on disk (the data was re-preprocessed into the same prefix), whose
arrays do not match their checksums (values overwritten, even in range), or that has no such lines (written by
Megatron or an older Trident) is rebuilt, with one log line saying why. The ``.dsc`` is written last, after the
arrays it describes, so a reader that accepts a ``.dsc`` finds the arrays it names.
* An unwritable cache directory is not fatal: the freshly built arrays are used from memory, with a warning that
  names ``--data-cache-path``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import uuid
import zlib
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


_IDENTITY_TAG = "Trident dataset "
_CRC_TAG = "Trident crc32 "


def array_crc32(array: np.ndarray) -> str:
    """crc32 (8 hex digits) of an array's C-ordered data bytes (zero-copy for a C-contiguous memmap)."""
    data = (
        np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    )  # a view: no copy of a contiguous memmap
    return f"{zlib.crc32(data.data) & 0xFFFFFFFF:08x}"


def dsc_text(desc: str, arrays: Arrays, names: Sequence[str], identity: str | None) -> str:
    """The ``.dsc`` content: Megatron's description, then our identity and checksum lines."""
    text = desc if desc.endswith("\n") else desc + "\n"
    if identity is not None:
        text += f"{_IDENTITY_TAG}{identity}\n"
    crcs = " ".join(f"{name}={array_crc32(arrays[name])}" for name in names)
    return text + f"{_CRC_TAG}{crcs}\n"


def _parse_trailer(found: str, desc: str) -> dict[str, str]:
    """``{"identity": ..., "<array name>": crc, ...}`` from a ``.dsc``'s lines after the description."""
    head = desc if desc.endswith("\n") else desc + "\n"
    if not found.startswith(head):
        raise ValueError("its .dsc describes another dataset or configuration")
    out: dict[str, str] = {}
    for line in found[len(head) :].splitlines():
        if line.startswith(_IDENTITY_TAG):
            out["identity"] = line[len(_IDENTITY_TAG) :]
        elif line.startswith(_CRC_TAG):
            for item in line[len(_CRC_TAG) :].split():
                name, _, crc = item.partition("=")
                out[name] = crc
    return out


def _read_set(
    paths: dict[str, str],
    desc: str,
    check: Callable[[Arrays], str | None],
    identity: str | None,
) -> tuple[Arrays | None, str | None]:
    """``(arrays, None)`` for a valid set, ``(None, None)`` for an incomplete one, ``(None, why)`` otherwise."""
    if not all(os.path.isfile(p) for p in paths.values()):
        return None, None
    try:
        with open(paths["desc"], encoding="utf-8") as f:
            trailer = _parse_trailer(f.read(), desc)
        if identity is not None and trailer.get("identity") != identity:
            if "identity" not in trailer:
                raise ValueError(
                    "it records no dataset identity (written by Megatron or an older Trident)"
                )
            raise ValueError(
                f"it was built from other contents of the dataset ({trailer['identity']}; the files on disk "
                f"now are {identity}): the data was re-preprocessed or replaced"
            )
        arrays = {
            name: np.load(p, mmap_mode="r", allow_pickle=False)
            for name, p in paths.items()
            if name != "desc"
        }
        for name, array in arrays.items():
            if name not in trailer:
                raise ValueError(
                    "it records no array checksums (written by Megatron or an older Trident)"
                )
            if array_crc32(array) != trailer[name]:
                raise ValueError(
                    f"{os.path.basename(paths[name])} does not match the checksum recorded when it was written "
                    "(its values were changed)"
                )
        reason = check(arrays)
        if reason is not None:
            raise ValueError(reason)
    except (OSError, ValueError, EOFError, UnicodeDecodeError) as exc:
        return None, str(exc)
    return arrays, None


def _write_set(
    target: str, desc: str, names: Sequence[str], arrays: Arrays, identity: str | None
) -> None:
    paths = cache_file_paths(target, desc, names)
    os.makedirs(target, exist_ok=True)
    for name in names:
        atomic_save_npy(paths[name], arrays[name])
    atomic_write_text(
        paths["desc"], dsc_text(desc, arrays, names, identity)
    )  # last: it vouches for the arrays


def load_or_build(
    directories: Sequence[str],
    desc: str,
    names: Sequence[str],
    build: Callable[[], Arrays],
    check: Callable[[Arrays], str | None],
    *,
    identity: str | None = None,
) -> tuple[Arrays, str | None]:
    """Return cached arrays from the first directory holding a valid set, else build, save and return them.

    Lookup follows Megatron: ``directories`` in order, the first valid set wins; otherwise the arrays are built
    and written where the first partial, stale or damaged set was found (repaired in place, so no reader - ours
    or Megatron's - meets it again), falling back to the other directories when that one is not writable, else
    into the last directory. A stale or damaged set costs one log line naming the file and the reason. Safe to
    call from any number of processes at once (see module docstring).

    Args:
        directories: cache directories to look in (non-empty).
        desc: description; its md5 names the files.
        names: array names (file suffixes).
        build: builds the arrays (deterministic in ``desc`` and the dataset's contents).
        check: validates loaded arrays (None = fine, else a reason).
        identity: the dataset's content identity (e.g. a hash of its ``.idx`` and its ``.bin`` size); a set that
            records another one is stale. None: the arrays do not depend on the data's contents.

    Returns:
        ``(arrays, directory)``: memory-mapped arrays and the cache directory they came from, or the in-memory
        arrays and None when no directory could be written.
    """
    damaged: list[str] = []
    problems: list[str] = []
    for directory in directories:
        paths = cache_file_paths(directory, desc, names)
        found, reason = _read_set(paths, desc, check, identity)
        if found is not None:
            if problems:
                logger.warning(
                    "ignoring the stale or damaged index cache %s; using the valid one in %s.",
                    "; ".join(problems),
                    directory,
                )
            return found, directory
        if any(os.path.isfile(p) for p in paths.values()):
            damaged.append(directory)  # a broken, stale or partial set (or one being written)
            if reason is not None:
                problems.append(f"{paths['desc']} ({reason})")
    if problems:
        logger.warning("stale or damaged index cache %s; rebuilding it.", "; ".join(problems))
    targets = list(dict.fromkeys([*damaged, directories[-1]]))
    arrays = build()
    errors = []
    for target in targets:
        paths = cache_file_paths(target, desc, names)
        # Another rank may have finished the same build meanwhile: then skip the redundant write.
        done, _ = _read_set(paths, desc, check, identity)
        if done is not None:
            return done, target
        try:
            _write_set(target, desc, names, arrays, identity)
        except OSError as exc:
            errors.append(f"{target} ({exc})")
            continue
        loaded, reason = _read_set(paths, desc, check, identity)
        if loaded is None:
            raise RuntimeError(
                f"the index cache just written to {target} does not read back ({paths['desc']}: {reason}); check "
                "the filesystem or point --data-cache-path elsewhere."
            )
        return loaded, target
    logger.warning(
        "could not write the index cache in %s; using the indices from memory (they are rebuilt on every "
        "start). Point --data-cache-path at a writable directory to cache them.",
        ", ".join(errors),
    )
    return arrays, None
