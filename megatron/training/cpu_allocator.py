"""CPU training, opt-in: keep freed tensor memory in the process for reuse (glibc ``mallopt``).

PyTorch allocates CPU tensors with ``malloc``. glibc serves requests above its mmap threshold (at most 32 MiB, and
128 KiB until a large block is freed) with a fresh ``mmap`` and gives the pages back on ``free``; it also trims the
heap's free top. Every training step allocates the same activations and gradients again, so each step pays a page
fault and a kernel-side zero fill for every page of them. Measured on a 2-core VM: a 100 MB fresh fp32 tensor costs
~25 ms before the first byte is computed, which is most of an elementwise op's time, and a GPT-2 L4 h256 s256 b8 step
spends ~24 of its ~364 ms in it.

With ``TRIDENT_CPU_ALLOCATOR=reuse``, :func:`keep_freed_memory` sets ``M_MMAP_MAX=0`` (large blocks come from the
heap like small ones) and ``M_TRIM_THRESHOLD=-1`` (the heap is never trimmed): the second step reuses the first
step's pages, as CUDA's caching allocator does on a GPU. It is not the default because the heap then also keeps
what fragmentation costs: ``tools/bench_zero3_build.py`` (a 700M GPT, ZeRO-3, DP 4, on the 24 GB box) peaked at
1.1-1.9 GiB per rank while building instead of 0.94 GiB, and a rank was killed for memory in training (a fixed
32 MiB mmap threshold with a 256 MiB trim threshold failed the same way). So: for small models where CPU speed
matters, not for large ones.

Applied by ``init_distributed`` when the training device is the CPU, never on CUDA. The default, ``system``,
leaves glibc as it is; so does another preloaded ``malloc`` (jemalloc, tcmalloc, mimalloc).
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
    """``TRIDENT_CPU_ALLOCATOR``: 'system' (the default) or 'reuse'; ValueError naming the variable otherwise."""
    choice = environ.get(ENV, "system").strip().lower()
    if choice not in ("reuse", "system"):
        raise ValueError(
            f"{ENV}={environ.get(ENV)!r} is not a choice: use 'system' (the default: glibc's defaults) or 'reuse' "
            "(keep freed CPU memory for reuse: faster small-model steps, a higher peak)."
        )
    return choice


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> str:
    """With ``TRIDENT_CPU_ALLOCATOR=reuse``, tell glibc to keep freed memory for reuse (see the module docstring);
    returns one line saying what was done.

    Idempotent. Does nothing (and says why) by default (``system``), when another allocator is preloaded, or when
    the C library is not glibc.
    """
    env = os.environ if environ is None else environ
    if allocator_choice(env) == "system":
        return f"CPU allocator: glibc defaults ({ENV}=reuse keeps freed memory: faster small runs, a higher peak)"
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
        f"CPU allocator: freed tensor memory is kept for reuse ({ENV}=reuse: glibc M_MMAP_MAX=0, no trimming; "
        "the resident set stays at its peak)"
    )
