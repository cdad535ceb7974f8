"""CPU training: keep freed tensor memory in the process for reuse (glibc ``mallopt``) when the run is small.

PyTorch allocates CPU tensors with ``malloc``. glibc serves requests above its mmap threshold (at most 32 MiB, and
128 KiB until a large block is freed) with a fresh ``mmap`` and gives the pages back on ``free``; it also trims the
heap's free top. Every training step allocates the same activations and gradients again, so each step pays a page
fault and a kernel-side zero fill for every page of them. Measured on a 2-core VM: a 100 MB fresh fp32 tensor costs
~25 ms before the first byte is computed, which is most of an elementwise op's time.

:func:`keep_freed_memory` with the ``reuse`` setting sets ``M_MMAP_MAX=0`` (large blocks come from the heap like
small ones) and ``M_TRIM_THRESHOLD=-1`` (the heap is never trimmed): the second step reuses the first step's pages,
as CUDA's caching allocator does on a GPU. The heap then also keeps what fragmentation costs:
``benchmarks/bench_zero3_build.py`` (a 700M GPT, ZeRO-3, DP 4, on the 24 GB box) peaked at 1.1-1.9 GiB per rank while
building instead of 0.94 GiB, and a rank was killed for memory in training (a fixed 32 MiB mmap threshold with a
256 MiB trim threshold failed the same way). So it is for runs that are small next to the machine's memory.

``TRIDENT_CPU_ALLOCATOR``:

- ``auto`` (the default): ``reuse`` when the memory planner's peak of one rank (``memory_plan.plan_memory``: the
  worst stage's total plus what it offloads to CPU), times the ranks on this node, is at most
  :data:`AUTO_FRACTION` of the node's available memory (``MemAvailable``), so that even a fourfold fragmentation
  stays within it; glibc's defaults otherwise, and when the run has no plan (a bare ``init_distributed``).
- ``reuse``: always; ``system``: never (glibc's defaults).

Applied by ``init_distributed`` when the training device is the CPU, never on CUDA. Another preloaded ``malloc``
(jemalloc, tcmalloc, mimalloc) is left alone, as is a C library that is not glibc.
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
CHOICES = ("auto", "reuse", "system")
AUTO_FRACTION = 0.25
"""``auto`` keeps freed memory when the planned peak of this node's ranks is at most this share of its available
memory."""


def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (it has ``mallopt`` and ``gnu_get_libc_version``), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (an AttributeError means: not glibc)
        return libc if hasattr(libc, "mallopt") else None
    except (OSError, AttributeError):
        return None


def allocator_choice(environ: Mapping[str, str]) -> str:
    """``TRIDENT_CPU_ALLOCATOR``: 'auto' (the default), 'reuse' or 'system'; ValueError naming the variable
    otherwise."""
    choice = environ.get(ENV, "auto").strip().lower()
    if choice not in CHOICES:
        raise ValueError(
            f"{ENV}={environ.get(ENV)!r} is not a choice: use 'auto' (the default: keep freed CPU memory for reuse "
            "when the run is small next to this machine's memory), 'reuse' (always: faster small-model steps, a "
            "higher peak) or 'system' (glibc's defaults)."
        )
    return choice


def available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def auto_reuses(
    planned_bytes: int | None, local_ranks: int, available: int | None
) -> tuple[bool, str]:
    """What ``auto`` decides for a rank planned at ``planned_bytes`` with ``local_ranks`` ranks on a node that has
    ``available`` bytes free: (reuse?, why)."""
    if planned_bytes is None:
        return False, "auto: this run has no memory plan"
    if available is None:
        return False, "auto: the available memory is unknown"
    need = planned_bytes * max(1, local_ranks)
    budget = AUTO_FRACTION * available
    verdict = "at most" if need <= budget else "more than"
    why = (
        f"auto: planned peak {_gib(planned_bytes)} x {max(1, local_ranks)} rank(s) on this node = {_gib(need)}, "
        f"{verdict} {AUTO_FRACTION:.0%} of the {_gib(available)} available"
    )
    return need <= budget, why


def keep_freed_memory(
    environ: Mapping[str, str] | None = None,
    *,
    planned_bytes: int | None = None,
    local_ranks: int = 1,
    available: int | None = None,
) -> str:
    """Tell glibc to keep freed memory for reuse where ``TRIDENT_CPU_ALLOCATOR`` says so (see the module
    docstring); returns one line saying what was done and why.

    Args:
        environ: the environment (default ``os.environ``).
        planned_bytes: the memory planner's peak of one rank (``auto`` decides with it; None: no plan).
        local_ranks: ranks of the run on this node.
        available: the node's available bytes (default: ``MemAvailable``).

    Idempotent. Does nothing (and says why) with ``system``, with ``auto`` for a run that is not small, when another
    allocator is preloaded, or when the C library is not glibc.
    """
    env = os.environ if environ is None else environ
    choice = allocator_choice(env)
    why = f"{ENV}={choice}"
    if choice == "auto":
        reuse, why = auto_reuses(
            planned_bytes, local_ranks, available_bytes() if available is None else available
        )
        choice = "reuse" if reuse else "system"
    if choice == "system":
        return (
            f"CPU allocator: glibc defaults ({why}; {ENV}=reuse keeps freed memory: faster small runs, a higher "
            "peak)"
        )
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
        f"CPU allocator: freed tensor memory is kept for reuse ({why}: glibc M_MMAP_MAX=0, no trimming; "
        f"the resident set stays at its peak; {ENV}=system turns it off)"
    )
