"""Bad inputs of ``tools/plan_memory.py`` found in reliability round 3 (issue #35, item 24): a device memory that is
not a positive finite number (``nan``; ``1e400``, which ``float()`` reads as ``inf``) used to "fit in inf GB", and
``--world-size 0`` was taken as "not given". Each fails while parsing, before any plan (about 3 s: the imports).

The kernel loader's cases of the same round (a cached library cut short, the build folder's name taken by a file, a
build lock held by another process) need a private kernel cache (``$TRIDENT_KERNEL_CACHE``), so they are plain tests
in ``tests/fused_kernels/test_loader.py``.
"""

from __future__ import annotations

from tests.badinput.cases import Case

PLAN = (
    "-m", "tools.plan_memory",
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "128",
    "--micro-batch-size", "1", "--train-iters", "1",
)  # fmt: skip

CASES: list[Case] = [
    Case(
        id="plan-memory-gb-nan",
        argv=(*PLAN, "--memory-gb", "nan"),
        exit_code=2,
        message="argument --memory-gb: 'nan' is not a positive finite number of GB",
    ),
    Case(
        id="plan-memory-gb-overflows-to-inf",
        argv=(*PLAN, "--memory-gb", "1e400"),
        exit_code=2,
        message="argument --memory-gb: '1e400' is not a positive finite number of GB",
    ),
    Case(
        id="plan-world-size-zero",
        argv=(*PLAN, "--world-size", "0"),
        exit_code=2,
        message="--world-size (0) must be at least 1",
    ),
]
