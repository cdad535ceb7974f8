"""The CPU extension's instruction-set flavours (``default`` / ``avx2`` / ``avx512``).

The install builds the widest flavour the host runs (``avx512`` only where torch's own kernels use it), so the
default suite tests that one. Here: the flavour logic and its errors, the built extension is the flavour recorded
beside it, every other flavour's intrinsics compile (a syntax check, seconds), and (slow) each other flavour this CPU
runs, JIT-built for real, passes the kernel-vs-reference tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.fused_kernels import loader

ROOT = Path(__file__).resolve().parents[2]
OTHER_FLAVOURS = [f for f in loader.FLAVOURS if f != loader.host_flavour()]


def test_flavour_choice_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert loader.host_flavour() in loader.FLAVOURS
    assert loader.host_runs("default") and not loader.host_runs("avx9")
    monkeypatch.delenv(loader.FLAVOUR_ENV, raising=False)
    assert loader.build_flavour() == loader.host_flavour()
    monkeypatch.setenv(loader.FLAVOUR_ENV, "default")
    assert loader.build_flavour() == "default"
    assert not any(flag.startswith("-m") for flag in loader.cpu_cflags())
    monkeypatch.setenv(loader.FLAVOUR_ENV, "avx3")
    with pytest.raises(
        ValueError, match=r"TRIDENT_CPU_FLAVOUR='avx3' is not one of default, avx2, avx512"
    ):
        loader.build_flavour()
    assert "-DCPU_CAPABILITY_AVX512" in loader.cpu_cflags("avx512")
    assert "-DCPU_CAPABILITY_AVX2" in loader.cpu_cflags("avx2")


def test_a_cpu_without_the_recorded_flavour_refuses_the_prebuilt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Simulates an older CPU (its /proc/cpuinfo flags) under an AVX512 install: refused before the import."""
    recorded = loader.prebuilt_flavour_file().read_text(encoding="utf-8").strip()
    monkeypatch.delenv(loader.PREBUILT_ENV, raising=False)
    monkeypatch.setattr(loader, "_cpu_flags", lambda: {"sse2", "avx2", "fma", "f16c"})
    if recorded == "avx512":
        why = loader._prebuilt_refused("cpu")
        assert why is not None and "avx512 code" in why and "avx512f" in why, why
    monkeypatch.setattr(loader, "_cpu_flags", lambda: {"sse2"})
    if recorded in ("avx2", "avx512"):
        assert "this CPU lacks some of" in (loader._prebuilt_refused("cpu") or "")
    monkeypatch.setenv(loader.FLAVOUR_ENV, "avx2")
    with pytest.raises(ValueError, match="this CPU lacks avx2 f16c fma"):
        loader.build_flavour()


def test_the_built_extension_is_the_recorded_flavour() -> None:
    ext = loader.extension("cpu")
    if ext is None or os.environ.get(loader.PREBUILT_ENV) == "0":
        pytest.skip(f"no extension built at install in use here ({loader.status().get('cpu')})")
    recorded = loader.prebuilt_flavour_file().read_text(encoding="utf-8").strip()
    assert ext.build_info() == recorded
    assert loader.host_runs(recorded)


@pytest.mark.parametrize(
    "flavour",
    # One other flavour in the default suite; the rest under -m slow.
    [pytest.param(f, marks=[pytest.mark.slow] if i else []) for i, f in enumerate(OTHER_FLAVOURS)],
)
def test_other_flavours_compile(flavour: str, tmp_path: Path) -> None:
    """softmax.cpp and norms.cpp (through vec_io.h) hold the hand-written intrinsics, one block per flavour: each
    must compile."""
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    flags = [f for f in loader.cpu_cflags(flavour) if f != "-O3"]
    cmd = [os.environ.get("CXX", "c++"), "-std=c++17", "-fsyntax-only", "-Wall", *flags, *includes]
    cmd += [f"-I{ROOT / 'csrc' / 'cpu'}"]
    cmd += [str(ROOT / "csrc" / "cpu" / name) for name in ("softmax.cpp", "norms.cpp")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("flavour", [f for f in OTHER_FLAVOURS if loader.host_runs(f)])
def test_other_flavours_match_the_references(flavour: str, tmp_path: Path) -> None:
    """A real JIT build of ``flavour``, then the kernel-vs-reference tests against it in a fresh process."""
    env = {
        **os.environ,
        loader.FLAVOUR_ENV: flavour,
        loader.PREBUILT_ENV: "0",
        loader.CACHE_ENV: str(tmp_path / "kcache"),
        "OMP_NUM_THREADS": "1",
    }
    probe = "from megatron.fused_kernels import loader; print(loader.extension('cpu').build_info())"
    built = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=900
    )
    assert built.returncode == 0 and built.stdout.strip().endswith(flavour), built.stderr[-4000:]
    tests = [
        str(ROOT / "tests" / "fused_kernels" / n)
        for n in ("test_kernels.py", "test_cross_entropy_fused.py")
    ]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", *tests]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:]
