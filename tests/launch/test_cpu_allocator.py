"""The CPU allocator setting of training (``megatron.launch.cpu_allocator``): what glibc does with it, and without.

The effect is checked on the process's resident set: a freed 256 MiB tensor stays resident (kept for reuse) with
``TRIDENT_CPU_ALLOCATOR=reuse`` and with the default ``auto`` for a run planned small next to the machine's memory,
and goes back to the system with ``system``, with ``auto`` for a large or unplanned run. Each case runs in its own
interpreter, so the pytest process keeps glibc's defaults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron.launch.cpu_allocator import ENV, allocator_choice, auto_reuses, keep_freed_memory

_PROBE = r"""
import json, sys
import torch
from megatron.launch.cpu_allocator import keep_freed_memory

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

planned = int(sys.argv[2]) if len(sys.argv) > 2 else None
said = keep_freed_memory(planned_bytes=planned) if sys.argv[1] == "apply" else "not applied"
before = rss_mib()
t = torch.ones(64 * 2**20)  # 256 MiB, written (resident)
held = rss_mib()
del t
after_free = rss_mib()
t = torch.ones(64 * 2**20)  # again: reuses the kept pages when the setting is on
print(json.dumps({"said": said, "before": before, "held": held, "after_free": after_free}))
"""


def _probe(mode: str, *planned: str, **env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode, *planned],
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

    for env in ({ENV: "system"}, {}):  # never; the default 'auto' without a plan
        default = _probe("apply", **env)
        assert default["said"].startswith("CPU allocator: glibc defaults"), default
        assert default["after_free"] - default["before"] < 50, default

    small = _probe("apply", str(2**20))  # auto, a run planned at 1 MiB: kept
    assert small["said"].startswith(
        "CPU allocator: freed tensor memory is kept for reuse (auto: planned"
    ), small
    assert small["after_free"] - small["before"] > 200, small
    large = _probe("apply", str(2**50))  # auto, a run planned at 1 PiB: glibc's defaults
    assert "more than 25% of the" in large["said"], large
    assert large["after_free"] - large["before"] < 50, large


def test_choices_and_other_allocators() -> None:
    assert allocator_choice({}) == "auto"
    assert allocator_choice({ENV: " Reuse "}) == "reuse"
    with pytest.raises(ValueError, match=rf"{ENV}='bogus' is not a choice: use 'auto'"):
        allocator_choice({ENV: "bogus"})
    # these branches return before any mallopt call (safe in the pytest process)
    jemalloc = {ENV: "reuse", "LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}
    assert (
        keep_freed_memory(jemalloc)
        == "CPU allocator: jemalloc is preloaded (LD_PRELOAD); left as it is"
    )
    assert keep_freed_memory({}).startswith(
        "CPU allocator: glibc defaults (auto: this run has no memory plan; TRIDENT_CPU_ALLOCATOR=reuse"
    )
    large = keep_freed_memory({ENV: "auto"}, planned_bytes=2**38, local_ranks=4, available=2**40)
    assert large.startswith(
        "CPU allocator: glibc defaults (auto: planned peak 256.00 GiB x 4 rank(s)"
    ), large


def test_auto_budget() -> None:
    gib = 2**30
    assert auto_reuses(None, 1, 100 * gib) == (False, "auto: this run has no memory plan")
    assert auto_reuses(gib, 1, None)[0] is False
    assert auto_reuses(gib, 4, 16 * gib)[0] is True  # 4 GiB of 16: exactly 25 %
    assert auto_reuses(gib + 1, 4, 16 * gib)[0] is False
    ok, why = auto_reuses(
        3 * gib, 4, 23 * gib
    )  # the 700M ZeRO-3 DP 4 build that failed with reuse: ~3 GiB/rank
    assert not ok and "12.00 GiB, more than 25% of the 23.00 GiB available" in why, why
