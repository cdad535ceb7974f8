"""CPU training: keep freed tensor memory in the process for reuse (glibc ``mallopt``), as CUDA's caching allocator.

PyTorch allocates CPU tensors with ``malloc``. glibc serves requests above its mmap threshold (at most 32 MiB, and
128 KiB until a large block is freed) with a fresh ``mmap`` and gives the pages back on ``free``; it also trims the
heap's free top. Every training step allocates the same activations and gradients again, so each step pays a page
fault and a kernel-side zero fill for every page of them. Measured on a 2-core VM: a 100 MB fresh fp32 tensor costs
~25 ms before the first byte is computed, which is most of an elementwise op's time, and a GPT-2 L4 h256 s256 b8 step
spends ~24 of its ~364 ms in it.

:func:`keep_freed_memory` sets ``M_MMAP_MAX=0`` (large blocks come from the heap like small ones) and
``M_TRIM_THRESHOLD=-1`` (the heap is never trimmed): the second step reuses the first step's pages. The price is
that the resident set stays at its peak (on a GPU that is what the CUDA caching allocator does too). glibc still
maps memory when the heap cannot grow, so no allocation fails because of it.

Applied by ``init_distributed`` when the training device is the CPU, never on CUDA (the host side of a GPU job
holds checkpoint copies that should go back). ``TRIDENT_CPU_ALLOCATOR=system`` keeps glibc's defaults; with
another ``malloc`` preloaded (jemalloc, tcmalloc, mimalloc) nothing is changed.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

ENV = "TRIDENT_CPU_ALLOCATOR"
# <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (it has ``mallopt`` and ``gnu_get_libc_version``), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (an AttributeError means: not glibc)
        return libc if hasattr(libc, "mallopt") else None
    except (OSError, AttributeError):
        return None


def allocator_choice(environ: Mapping[str, str]) -> str:
    """``TRIDENT_CPU_ALLOCATOR``: 'reuse' (the default) or 'system'; ValueError naming the variable otherwise."""
    choice = environ.get(ENV, "reuse").strip().lower()
    if choice not in ("reuse", "system"):
        raise ValueError(
            f"{ENV}={environ.get(ENV)!r} is not a choice: use 'reuse' (the default: keep freed CPU memory for "
            "reuse) or 'system' (glibc's defaults)."
        )
    return choice


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> str:
    """Tell glibc to keep freed memory for reuse (see the module docstring); returns one line saying what was done.

    Idempotent. Does nothing (and says why) when ``TRIDENT_CPU_ALLOCATOR=system``, another allocator is preloaded,
    or the C library is not glibc.
    """
    env = os.environ if environ is None else environ
    if allocator_choice(env) == "system":
        return f"CPU allocator: glibc defaults ({ENV}=system)"
    preload = env.get("LD_PRELOAD", "")
    other = next((name for name in _PRELOADED_ALLOCATORS if name in preload), None)
    if other is not None:
        return f"CPU allocator: {other} is preloaded (LD_PRELOAD); left as it is"
    libc = _glibc()
    if libc is None:
        return "CPU allocator: not glibc; left as it is"
    ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, -1) == 1
    if not ok:
        return "CPU allocator: glibc refused mallopt; left as it is"
    return (
        "CPU allocator: freed tensor memory is kept for reuse (glibc M_MMAP_MAX=0, no trimming; "
        f"{ENV}=system turns this off)"
    )
