"""Megatron's memory-mapped indexed dataset (``--data-impl mmap``): the format and its reader, byte for byte (the
writer: :mod:`megatron.data.indexed_builder`).

A dataset is a pair of files sharing a prefix. ``{prefix}.bin`` is every token sequence, each a C-contiguous
array of one dtype, concatenated with no header or padding. ``{prefix}.idx`` (little-endian) is::

    offset      size   field
    0           9      magic b"MMIDIDX\\x00\\x00"
    9           8      <Q version = 1
    17          1      <B dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    18          8      <Q N = number of sequences
    26          8      <Q D = len(doc_idx) = number of documents + 1
    34          4*N    sizes: int32 tokens per sequence
    34+4N       8*N    pointers: int64 byte offset of each sequence in .bin (exclusive prefix sum of sizes*itemsize)
    34+12N      8*D    doc_idx: int64, doc_idx[0] = 0, doc_idx[k+1] = index of the first sequence after document k

so an ``.idx`` is exactly ``34 + 12N + 8D`` bytes and its ``.bin`` exactly ``sum(sizes) * itemsize`` bytes.
Opening checks all of it, vectorized in blocks (bounded memory on multi-GB indexes; once per process and file
version): ``pointers`` equal the running sum of ``sizes * itemsize`` (so swapped sizes or an overwritten pointer are
caught), ``doc_idx`` starts at 0, never decreases and ends at most at N, and the ``.bin`` length is the last pointer
plus the last size. A failure is one ``ValueError`` naming the file.
A sequence is a sentence when documents were split into sentences, otherwise a whole document (then N = D - 1).

Known upstream bug: Megatron-DeepSpeed's ``preprocess_data.py --append-eod`` writes each document's EOD into the
``.bin`` but leaves it out of ``sizes``; the ``.bin`` is then longer by exactly one token per document. The reader
accepts such files with a warning (each document's EOD then starts the next document's span); the builder here
writes the fixed Megatron-LM layout, where sizes include the EOD.

"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D
HEADER_SIZE = _HEADER.size  # 34
_WARMUP_CHUNK = 100 * 1024 * 1024
_CHECK_BLOCK = 1 << 22  # index entries per vectorized step: 32 MiB int64 temporaries at most
# Indexes already checked (and their content ids) in this process, by file version: preflight, the dataset
# builders and every split open the same files; a replaced file has another inode, size or mtime.
_VERIFIED: dict[tuple[str, int, int, int, int], str | None] = {}

DTYPES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


class MDSEodWarning(UserWarning):
    """The ``.bin`` holds one more token per document than the ``.idx`` sizes: the Megatron-DeepSpeed EOD bug."""


def dtype_code(dtype: Any) -> int:
    """The ``.idx`` dtype code of ``dtype`` (a numpy dtype or type).

    Raises:
        ValueError: the dtype has no code in the format.
    """
    dt = np.dtype(dtype)
    for code, cand in DTYPES.items():
        if np.dtype(cand) == dt:
            return code
    names = ", ".join(np.dtype(t).name for t in DTYPES.values())
    raise ValueError(
        f"dtype {dt.name} cannot be stored in an MMapIndexedDataset; use one of {names}."
    )


def best_fitting_dtype(vocab_size: int | None = None) -> type[np.generic]:
    """Megatron's token dtype choice: uint16 when ``vocab_size < 65500``, else int32 (also when unknown)."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


LOSS_MASK_SUFFIX = "_loss_mask"
"""--sft: the loss mask of the conversations at ``P`` is the indexed dataset ``P + LOSS_MASK_SUFFIX``."""


def loss_mask_prefix(prefix: str) -> str:
    """The loss-mask dataset of the conversations at ``prefix`` (issue #33's SFT format)."""
    return prefix + LOSS_MASK_SUFFIX


def data_file_path(prefix_path: str) -> str:
    """``{prefix}.bin``."""
    return prefix_path + ".bin"


def index_file_path(prefix_path: str) -> str:
    """``{prefix}.idx``."""
    return prefix_path + ".idx"


def _pointers(sizes: np.ndarray, itemsize: int) -> np.ndarray:
    """Exclusive prefix sum of ``sizes * itemsize`` as int64 byte offsets."""
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    return pointers


def apply_umask_mode(path: str | os.PathLike[str]) -> None:
    """Give ``path`` the mode ``open()`` gives a new file, ``0o666 & ~umask`` (e.g. 0644 under umask 022).

    ``tempfile.mkstemp`` and safetensors' ``save_file`` create files 0600 whatever the umask, so datasets and
    models written through them would be unreadable to the other users of a shared cluster. Reading the umask
    means setting it and putting it back (``os.umask`` is the only API): process-wide, so a thread creating a
    file in that instant would get mode 0666 & ~0 -> 0666. It is done once per call, around nothing else.
    """
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def atomic_target(final_path: str) -> str:
    """Create an empty temporary file in ``final_path``'s directory (same filesystem, so rename is atomic).

    Its mode is the umask's (:func:`apply_umask_mode`), not mkstemp's 0600, so the renamed file is readable
    like any other file the user writes.
    """
    directory = os.path.dirname(os.path.abspath(final_path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"output directory {directory} does not exist; create it or choose another output path."
        )
    fd, tmp = tempfile.mkstemp(
        dir=directory, prefix=os.path.basename(final_path) + ".", suffix=".tmp"
    )
    os.close(fd)
    try:
        apply_umask_mode(tmp)
    except BaseException:
        remove_quietly(tmp)
        raise
    return tmp


def write_index(
    idx_path: str,
    dtype: Any,
    sizes: Sequence[int] | np.ndarray,
    doc_idx: Sequence[int] | np.ndarray,
) -> None:
    """Write an ``.idx`` file atomically (temporary name, then ``os.replace``).

    Args:
        idx_path: destination path.
        dtype: token dtype of the matching ``.bin``.
        sizes: tokens per sequence (stored as int32).
        doc_idx: document boundaries in sequences, starting with 0 (stored as int64).

    Raises:
        ValueError: a size does not fit int32, or ``doc_idx`` is malformed.
    """
    code = dtype_code(dtype)
    sizes64 = np.asarray(sizes, dtype=np.int64)
    if len(sizes64) and (sizes64.min() < 0 or sizes64.max() > np.iinfo(np.int32).max):
        raise ValueError(
            f"{idx_path}: sequence sizes must be in [0, 2^31); got {sizes64.min()}..{sizes64.max()}."
        )
    docs = np.asarray(doc_idx, dtype=np.int64)
    if len(docs) == 0 or docs[0] != 0 or docs[-1] > len(sizes64) or np.any(np.diff(docs) < 0):
        raise ValueError(
            f"{idx_path}: doc_idx must start at 0, be non-decreasing and end at most at the number of "
            f"sequences ({len(sizes64)}); got {len(docs)} entries."
        )
    sizes32 = sizes64.astype(np.int32)
    tmp = atomic_target(idx_path)
    try:
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(_INDEX_MAGIC, _INDEX_VERSION, code, len(sizes32), len(docs)))
            f.write(sizes32.astype("<i4").tobytes(order="C"))
            f.write(_pointers(sizes32, np.dtype(dtype).itemsize).astype("<i8").tobytes(order="C"))
            f.write(docs.astype("<i8").tobytes(order="C"))
        os.replace(tmp, idx_path)
    except BaseException:
        remove_quietly(tmp)
        raise


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class IndexReader:
    """The parsed ``.idx``: validated header plus zero-copy int32/int64 views into the memory-mapped file."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"index file {path} not found; pass the dataset prefix without .bin/.idx."
            )
        file_size = os.path.getsize(path)
        if file_size < HEADER_SIZE:
            raise ValueError(
                f"{path} is truncated: {file_size} bytes, shorter than the {HEADER_SIZE}-byte header; "
                "rebuild it with tools/preprocess_data.py."
            )
        with open(path, "rb") as f:
            magic, version, code, n, d = _HEADER.unpack(f.read(HEADER_SIZE))
        if magic != _INDEX_MAGIC:
            hint = (
                " (a legacy lazy/cached TNTIDX index; re-run preprocessing with the mmap format)"
                if magic.startswith(b"TNTIDX")
                else ""
            )
            raise ValueError(
                f"{path} is not an MMapIndexedDataset index: magic {magic!r}, expected {_INDEX_MAGIC!r}{hint}."
            )
        if version != _INDEX_VERSION:
            raise ValueError(
                f"{path}: index version {version} is not supported (only version {_INDEX_VERSION})."
            )
        if code not in DTYPES:
            raise ValueError(
                f"{path}: unknown dtype code {code}; valid codes are {sorted(DTYPES)}."
            )
        expected = HEADER_SIZE + 12 * n + 8 * d
        if file_size != expected:
            state = "truncated" if file_size < expected else "longer than its header says"
            raise ValueError(
                f"{path} is {state}: {file_size} bytes, but its header (N={n} sequences, D={d} doc_idx "
                f"entries) requires 34 + 12*N + 8*D = {expected} bytes; rebuild it."
            )
        self.path = path
        self.dtype: type[np.generic] = DTYPES[code]
        self._mmap = np.memmap(path, mode="r", order="C")
        buf = memoryview(self._mmap)
        self.sizes = np.frombuffer(buf, dtype="<i4", count=n, offset=HEADER_SIZE)
        self.pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=HEADER_SIZE + 4 * n)
        self.doc_idx = np.frombuffer(buf, dtype="<i8", count=d, offset=HEADER_SIZE + 12 * n)
        st = os.stat(path)
        self._version = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if self._version not in _VERIFIED:
            check_index_arrays(
                path, self.sizes, self.pointers, self.doc_idx, np.dtype(self.dtype).itemsize
            )
            _VERIFIED[self._version] = None

    def __len__(self) -> int:
        return len(self.sizes)

    def content_hash(self) -> str:
        """sha256 (first 32 hex digits) of the whole ``.idx`` file, computed once per process and file version."""
        known = _VERIFIED.get(self._version)
        if known is None:
            with open(self.path, "rb") as f:
                known = hashlib.file_digest(f, "sha256").hexdigest()[:32]
            _VERIFIED[self._version] = known
        return known


def check_index_arrays(
    path: str, sizes: np.ndarray, pointers: np.ndarray, doc_idx: np.ndarray, itemsize: int
) -> None:
    """Check that an index agrees with itself (see the module docstring); vectorized, in blocks.

    Raises:
        ValueError: one line naming ``path``, the first bad entry and the fix.
    """
    fix = "the file was changed after it was written; rebuild it with tools/preprocess_data.py."
    n, end = len(sizes), 0
    for start in range(0, n, _CHECK_BLOCK):
        block = sizes[start : start + _CHECK_BLOCK]
        if int(block.min()) < 0:
            i = start + int(np.argmax(block < 0))
            raise ValueError(
                f"{path} is corrupted: sequence {i} has a negative size ({sizes[i]}); {fix}"
            )
        ends = np.cumsum(block, dtype=np.int64)
        ends *= itemsize
        ends += end
        starts = (
            ends - block.astype(np.int64) * itemsize
        )  # exclusive running sum: where each sequence begins
        bad = np.flatnonzero(starts != pointers[start : start + len(block)])
        if len(bad):
            i = start + int(bad[0])
            raise ValueError(
                f"{path} is corrupted: the pointer of sequence {i} is {int(pointers[i])}, but the sizes before it "
                f"add up to {int(starts[bad[0]])} bytes (sizes swapped or pointers overwritten); {fix}"
            )
        end = int(ends[-1])
    d = len(doc_idx)
    if d and int(doc_idx[0]) != 0:
        raise ValueError(
            f"{path} is corrupted: doc_idx must start at 0, got {int(doc_idx[0])}; {fix}"
        )
    for start in range(0, max(d - 1, 0), _CHECK_BLOCK):
        block = doc_idx[start : start + _CHECK_BLOCK + 1]
        down = np.flatnonzero(block[1:] < block[:-1])
        if len(down):
            k = start + int(down[0]) + 1
            raise ValueError(
                f"{path} is corrupted: doc_idx decreases at entry {k} ({int(doc_idx[k - 1])} -> "
                f"{int(doc_idx[k])}); {fix}"
            )
    if d and int(doc_idx[-1]) > n:
        raise ValueError(
            f"{path} is corrupted: doc_idx ends at {int(doc_idx[-1])}, beyond its {n} sequences; {fix}"
        )


class MMapIndexedDataset:
    """Read-only, zero-copy view of a Megatron mmap dataset (``{path_prefix}.bin`` / ``.idx``).

    ``ds[i]`` and ``ds.get(i, offset, length)`` return numpy views into the memory-mapped ``.bin`` (no copy);
    ``ds[a:b]`` returns a list of such arrays. The object pickles by path (DataLoader workers reopen the files).

    Args:
        path_prefix: dataset prefix, e.g. ``data/my-gpt2_text_document``.
        skip_warmup: False reads both files once up front to warm the page cache (``--mmap-warmup``).

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: bad magic/version/dtype, a truncated ``.idx``, or a ``.bin`` whose size disagrees with the index.
    """

    def __init__(self, path_prefix: str, skip_warmup: bool = True) -> None:
        self._path = path_prefix
        self._skip_warmup = skip_warmup
        self._do_init(path_prefix, skip_warmup)

    def __getstate__(self) -> tuple[str, bool]:
        return (self._path, self._skip_warmup)

    def __setstate__(self, state: tuple[str, bool]) -> None:
        self._path, self._skip_warmup = state
        self._do_init(self._path, True)

    def _do_init(self, path: str, skip_warmup: bool) -> None:
        self._index = IndexReader(index_file_path(path))
        bin_path = data_file_path(path)
        if not os.path.isfile(bin_path):
            raise FileNotFoundError(
                f"data file {bin_path} not found (its index {index_file_path(path)} exists)."
            )
        self._check_bin_size(bin_path)
        if not skip_warmup:
            _warmup(index_file_path(path))
            _warmup(bin_path)
        size = os.path.getsize(bin_path)
        self._bin_mmap = np.memmap(bin_path, mode="r", order="C") if size else None
        self._bin_buffer = (
            memoryview(self._bin_mmap) if self._bin_mmap is not None else memoryview(b"")
        )

    def _check_bin_size(self, bin_path: str) -> None:
        itemsize = np.dtype(self._index.dtype).itemsize
        actual = os.path.getsize(bin_path)
        expected = int(self._index.sizes.sum(dtype=np.int64)) * itemsize
        if actual == expected:
            return
        num_docs = len(self._index.doc_idx) - 1
        if num_docs > 0 and actual == expected + num_docs * itemsize:
            warnings.warn(
                f"{bin_path} is {actual} bytes but {index_file_path(self._path)} accounts for {expected}: exactly "
                f"one extra token per document ({num_docs} documents). This is the Megatron-DeepSpeed "
                "preprocess_data.py --append-eod bug (sizes exclude the EOD); each document's EOD will appear "
                "at the start of the next document. Re-run tools/preprocess_data.py to fix it.",
                MDSEodWarning,
                stacklevel=3,
            )
            return
        raise ValueError(
            f"{bin_path} is {actual} bytes, but {index_file_path(self._path)} says {expected} bytes "
            f"(sum of sizes {expected // itemsize} x {itemsize}-byte {np.dtype(self._index.dtype).name}); "
            "the pair is inconsistent (truncated copy or mismatched files): rebuild or re-copy both."
        )

    # Megatron's public surface -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, idx: int | np.integer | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, (int, np.integer)):
            i = self._normalize(int(idx))
            return np.frombuffer(
                self._bin_buffer,
                dtype=self._index.dtype,
                count=int(self._index.sizes[i]),
                offset=int(self._index.pointers[i]),
            )
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices of an MMapIndexedDataset need step 1; got step {step}.")
            if stop <= start:
                return []
            sizes = self._index.sizes[start:stop]
            flat = np.frombuffer(
                self._bin_buffer,
                dtype=self._index.dtype,
                count=int(sizes.sum(dtype=np.int64)),
                offset=int(self._index.pointers[start]),
            )
            return np.split(flat, np.cumsum(sizes[:-1], dtype=np.int64))
        raise TypeError(
            f"MMapIndexedDataset indices must be int or slice, not {type(idx).__name__}."
        )

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` as a zero-copy view (to its end by default)."""
        i = self._normalize(int(idx))
        size = int(self._index.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"get({idx}, offset={offset}, length={length}) is outside sequence {idx} of {size} tokens."
            )
        itemsize = np.dtype(self._index.dtype).itemsize
        return np.frombuffer(
            self._bin_buffer,
            dtype=self._index.dtype,
            count=length,
            offset=int(self._index.pointers[i]) + offset * itemsize,
        )

    def _normalize(self, i: int) -> int:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(
                f"index {i} out of range for a dataset of {n} sequences ({self._path})."
            )
        return i

    @property
    def sizes(self) -> np.ndarray:
        """int32 tokens per sequence (read-only view)."""
        return self._index.sizes

    @property
    def pointers(self) -> np.ndarray:
        """int64 byte offset of each sequence in the ``.bin`` (read-only view)."""
        return self._index.pointers

    @property
    def doc_idx(self) -> np.ndarray:
        """int64 document boundaries in sequences (``len = documents + 1``; read-only view)."""
        return self._index.doc_idx

    @property
    def dtype(self) -> type[np.generic]:
        """Token dtype (numpy scalar type)."""
        return self._index.dtype

    @property
    def path_prefix(self) -> str:
        return self._path

    @property
    def content_id(self) -> str:
        """The dataset's identity for caches: a hash of the ``.idx`` bytes and the ``.bin`` length.

        Independent of paths and mtimes (a copy has the same id); any change of order, sizes or documents changes
        it. Reads the ``.idx`` once per process and file version, never the ``.bin``.
        """
        return f"idx-sha256 {self._index.content_hash()} bin {len(self._bin_buffer)}"

    @property
    def supports_prefetch(self) -> bool:
        return False

    @staticmethod
    def exists(path: str) -> bool:
        """True when both ``{path}.idx`` and ``{path}.bin`` exist."""
        return os.path.exists(index_file_path(path)) and os.path.exists(data_file_path(path))


def _warmup(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(_WARMUP_CHUNK):
            pass


def make_dataset(path: str, impl: str = "mmap", skip_warmup: bool = True) -> MMapIndexedDataset:
    """Open the dataset at prefix ``path`` (``impl`` ``mmap`` or ``infer``).

    Raises:
        ValueError: another ``impl``, or the files are not a valid mmap dataset.
        FileNotFoundError: the files are missing.
    """
    if impl not in ("mmap", "infer"):
        raise ValueError(f"--data-impl {impl} is not supported; use 'mmap' or 'infer'.")
    return MMapIndexedDataset(path, skip_warmup=skip_warmup)
