"""The CPU allocator setting of training (``megatron.training.cpu_allocator``): what glibc does with it, and without.

The effect is checked on the process's resident set: a freed 256 MiB tensor stays resident (kept for reuse) with
``TRIDENT_CPU_ALLOCATOR=reuse``, and goes back to the system by default. Each case runs in its own interpreter, so the pytest process keeps
glibc's defaults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron.training.cpu_allocator import ENV, allocator_choice, keep_freed_memory

_PROBE = r"""
import json, sys
import torch
from megatron.training.cpu_allocator import keep_freed_memory

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

said = keep_freed_memory() if sys.argv[1] == "apply" else "not applied"
before = rss_mib()
t = torch.ones(64 * 2**20)  # 256 MiB, written (resident)
held = rss_mib()
del t
after_free = rss_mib()
t = torch.ones(64 * 2**20)  # again: reuses the kept pages when the setting is on
print(json.dumps({"said": said, "before": before, "held": held, "after_free": after_free}))
"""


def _probe(mode: str, **env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        env={**{k: v for k, v in os.environ.items() if k != ENV}, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_freed_memory_is_kept_only_with_the_setting() -> None:
    kept = _probe("apply", **{ENV: "reuse"})
    assert kept["said"].startswith("CPU allocator: freed tensor memory is kept for reuse"), kept
    assert kept["held"] - kept["before"] > 200, kept
    assert kept["after_free"] - kept["before"] > 200, kept  # still resident after free

    system = _probe("skip")
    assert system["held"] - system["before"] > 200, system
    assert system["after_free"] - system["before"] < 50, system  # glibc's default: unmapped on free

    for env in ({}, {ENV: "system"}):  # the default
        default = _probe("apply", **env)
        assert default["said"].startswith("CPU allocator: glibc defaults"), default
        assert default["after_free"] - default["before"] < 50, default


def test_choices_and_other_allocators() -> None:
    assert allocator_choice({}) == "system"
    assert allocator_choice({ENV: " Reuse "}) == "reuse"
    with pytest.raises(ValueError, match=rf"{ENV}='bogus' is not a choice: use 'system'"):
        allocator_choice({ENV: "bogus"})
    # these branches return before any mallopt call (safe in the pytest process)
    jemalloc = {ENV: "reuse", "LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}
    assert (
        keep_freed_memory(jemalloc)
        == "CPU allocator: jemalloc is preloaded (LD_PRELOAD); left as it is"
    )
    assert keep_freed_memory({}).startswith(
        "CPU allocator: glibc defaults (TRIDENT_CPU_ALLOCATOR=reuse"
    )
