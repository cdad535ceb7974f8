"""How much memory a GPT sample index takes to build, checked against this machine's before anything is allocated.

``--global-batch-size 1000000000`` asks for 2e9 samples: their ``sample_idx`` alone is 29.8 GiB, and NumPy's
``ArrayMemoryError`` deep in the index builder was the only answer. :func:`check_index_fits` estimates the three
arrays (``doc_idx`` int32 per document and epoch, ``sample_idx`` int64 pairs, ``shuffle_idx`` uint32/int64 per
sample) and refuses with the numbers and the fix when they exceed the memory of this machine (its RAM, or the
cgroup limit of its container when lower).
"""

from __future__ import annotations

import os


class DatasetRequestError(ValueError):
    """The samples asked of a dataset do not fit it or this machine (names the numbers and the flags to change);
    identical on every rank, raised before any array is built."""


def index_bytes(num_docs: int, num_epochs: int, total_samples: int) -> int:
    """Bytes of ``doc_idx`` + ``sample_idx`` + ``shuffle_idx`` for ``total_samples`` over ``num_epochs``."""
    shuffle_item = 8 if total_samples >= 2**32 - 2 else 4
    return num_docs * num_epochs * 4 + (total_samples + 1) * 16 + total_samples * shuffle_item


def memory_bytes() -> int | None:
    """This machine's memory for one process: physical RAM, or the container's cgroup limit when lower (None
    where neither can be read)."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits) if limits else None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_index_fits(
    where: str, *, num_docs: int, num_epochs: int, total_samples: int, memory: int | None = None
) -> None:
    """Refuse an index larger than ``memory`` (default: :func:`memory_bytes`).

    Raises:
        DatasetRequestError: ``dataset 'train' of X: the sample index of 2000000250 samples needs 29.8 GiB, more
            than this machine's 23.0 GiB of memory; ...``.
    """
    memory = memory_bytes() if memory is None else memory
    need = index_bytes(num_docs, num_epochs, total_samples)
    if memory is not None and need > memory:
        raise DatasetRequestError(
            f"{where}: the sample index of {total_samples} samples ({num_epochs} epochs of {num_docs} documents) "
            f"needs {_gib(need)}, more than this machine's {_gib(memory)} of memory; ask for fewer samples "
            "(--global-batch-size, --train-iters/--train-samples, --eval-iters)."
        )
