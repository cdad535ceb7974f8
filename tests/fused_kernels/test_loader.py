"""The kernel loader: concurrent JIT builds compile once and never load a half-written build; a machine that cannot
build (no compiler) still trains, on the references, with one warning; an extension built from other sources than
csrc/ holds now is never loaded (the loader refuses it, a failed ``setup.py`` build removes it).

The concurrency test builds a tiny Python extension (no torch headers: it compiles in about a second) through the
same ``jit_build`` the kernels use, from 4 processes started together on one cache folder.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from megatron.model.presets import GPT2_FLAGS
from megatron.testing import run_distributed

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"

PROBE = r"""
#include <Python.h>
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, "42"}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef mod = {PyModuleDef_HEAD_INIT, "trident_jit_probe", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_trident_jit_probe(void) { return PyModule_Create(&mod); }
"""


def _build_probe(src: str, cache: str) -> tuple[int, int]:
    from megatron.fused_kernels import loader

    module = loader.jit_build(
        "trident_jit_probe", [Path(src)], cflags=["-O1"], cache_root=Path(cache)
    )
    return module.answer(), len(loader.compiled_in_this_process)


def test_concurrent_jit_builds_compile_once(tmp_path: Path) -> None:
    src = tmp_path / "probe.cpp"
    src.write_text(PROBE)
    cache = tmp_path / "cache"
    results = run_distributed(
        _build_probe, 4, str(src), str(cache), init_process_group=False, timeout=240
    )
    assert [answer for answer, _ in results] == [42] * 4
    assert sum(compiled for _, compiled in results) == 1, results  # one compile, three loads
    folders = [p.name for p in cache.iterdir() if p.is_dir()]
    assert len(folders) == 1 and not folders[0].startswith("."), folders  # no staging left
    # a later process (another rank, a relaunch) only loads
    assert run_distributed(_build_probe, 1, str(src), str(cache), init_process_group=False) == [
        (42, 0)
    ]


def _train(argv: list[str]) -> dict[str, str]:
    from megatron import fused_kernels
    from megatron.config import parse_args
    from megatron.training import pretrain

    pretrain(parse_args(argv))
    return fused_kernels.status()


def _run(tmp: Path, env: dict[str, str]) -> tuple[list[float], dict[str, str]]:
    tmp.mkdir()
    argv = [
        *GPT2_FLAGS,
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
        "--lr", "3e-3", "--seed", "1234",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(TINY / "vocab.json"),
        "--merge-file", str(TINY / "merges.txt"),
        "--data-path", str(TINY / "tiny_text_document"), "--split", "98,2,0",
        "--data-cache-path", str(tmp / "cache"), "--eval-iters", "0", "--log-interval", "1",
        "--metrics-file", str(tmp / "metrics.jsonl"), "--log-level", "WARNING",
    ]  # fmt: skip
    (status,) = run_distributed(_train, 1, argv, init_process_group=False, env=env, timeout=300)
    rows = [json.loads(x) for x in (tmp / "metrics.jsonl").read_text().splitlines()]
    return [r["lm_loss"] for r in rows if "lm_loss" in r], status


def test_no_compiler_trains_on_the_references(tmp_path: Path) -> None:
    """No extension from install, no compiler: one warning, the references, the same losses as forced references."""
    no_build = {
        "TRIDENT_PREBUILT_KERNELS": "0",
        "CXX": "/nonexistent/c++",
        "TRIDENT_KERNEL_CACHE": str(tmp_path / "kcache"),
    }
    losses, status = _run(tmp_path / "nobuild", no_build)
    assert "build failed" in status["cpu"] and "no C++ compiler" in status["cpu"], status
    assert not (tmp_path / "kcache").exists() or not any((tmp_path / "kcache").iterdir())
    forced, forced_status = _run(tmp_path / "forced", {"TRIDENT_NO_KERNELS": "1"})
    assert "TRIDENT_NO_KERNELS=1" in forced_status["cpu"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert losses == forced  # the same reference path, bit for bit


def _agree(lacking_rank: int | None) -> tuple[bool, str]:
    import torch.distributed as dist

    from megatron import fused_kernels
    from megatron.training.initialize import agree_on_fused_kernels

    if dist.get_rank() == lacking_rank:
        fused_kernels.force_references("cpu", "this rank's build failed")
    agree_on_fused_kernels("cpu")
    return fused_kernels.extension("cpu") is not None, fused_kernels.status()["cpu"]


def test_ranks_agree_on_kernels() -> None:
    """One rank without kernels: every rank runs the references (the fused CE's collectives differ)."""
    both = run_distributed(_agree, 2, None)
    assert [have for have, _ in both] == [True, True], both
    one_lacks = run_distributed(_agree, 2, 1)
    assert [have for have, _ in one_lacks] == [False, False], one_lacks
    assert "ranks [1] have no kernels" in one_lacks[0][1], one_lacks


def test_an_extension_built_from_other_sources_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The install records its sources' digest; the loader refuses (and JIT-builds instead of) an extension whose
    record does not match csrc/ (edited since), or that has no record; where none was built there is nothing to
    refuse."""
    from megatron.fused_kernels import loader

    monkeypatch.delenv(loader.PREBUILT_ENV, raising=False)
    installed = loader.prebuilt_sources_file("cpu")
    assert installed.is_file(), "the install did not record the CPU kernels' sources"
    assert installed.read_text().strip() == loader.sources_digest(loader.sources("cpu"))
    if loader.host_runs(loader.prebuilt_flavour_file().read_text().strip()):
        assert loader._prebuilt_refused("cpu") is None
    record = tmp_path / "_cpu.sources"
    monkeypatch.setattr(loader, "prebuilt_sources_file", lambda kind: record)
    why = loader._prebuilt_refused("cpu")
    assert why is not None and "is missing" in why and "pip install" in why, why
    record.write_text("0" * 64 + "\n")
    why = loader._prebuilt_refused("cpu")
    assert why is not None and "records others" in why and str(loader.csrc_dir() / "cpu") in why, (
        why
    )
    # nothing built at install (no compiler then): no refusal to warn about, the JIT build simply follows
    monkeypatch.setitem(loader.PREBUILT, "cpu", "megatron.fused_kernels._not_built")
    assert loader._prebuilt_refused("cpu") is None


FAILING_CXX = """#!/bin/sh
# a compiler that answers version probes and fails every compile
case "$*" in *--version*|*-dumpversion*|*-dumpfullversion*) exec c++ "$@";; esac
echo "planted compile failure" >&2
exit 1
"""


def test_a_failed_build_removes_the_stale_extension(tmp_path: Path) -> None:
    """setup.py in a copy of the checkout with an earlier build's extension in place (in-tree and in build/), and
    a compiler that fails: one warning, exit 0, and no stale binary left to be imported as if built from these
    sources (nor a sources record claiming so)."""
    root = Path(__file__).resolve().parents[2]
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy(root / name, tree / name)
    for name in ("megatron", "csrc"):
        shutil.copytree(root / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    from megatron.fused_kernels import loader

    so = next(Path(loader.__file__).parent.glob("_cpu*.so"), None)
    if so is None:
        pytest.skip("no CPU extension built at install to plant")
    in_tree = tree / "megatron" / "fused_kernels" / so.name
    platlib = f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    in_build = tree / "build" / platlib / "megatron" / "fused_kernels" / so.name
    in_build.parent.mkdir(parents=True)
    for stale in (in_tree, in_build):
        shutil.copy(so, stale)
    (tree / "megatron" / "fused_kernels" / "_cpu.sources").write_text("stale\n")
    cxx = tmp_path / "failing-c++"
    cxx.write_text(FAILING_CXX)
    cxx.chmod(0o755)
    env = {**os.environ, "CXX": str(cxx), "CC": str(cxx)}
    done = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "optional extension megatron.fused_kernels._cpu not built" in done.stderr, done.stderr[
        -3000:
    ]
    removed = done.stderr.split("fused_kernels._cpu not built", 1)[1].split("\n", 1)[0]
    assert (
        "removed the stale" in removed and str(in_tree) in removed and str(in_build) in removed
    ), removed
    assert not in_tree.exists() and not in_build.exists()
    assert not (tree / "megatron" / "fused_kernels" / "_cpu.sources").exists()


# --------------------------------------------------------------- the JIT cache: damaged, blocked, locked, failed


def _probe(tmp: Path, name: str, body: str = "") -> Path:
    """A probe extension named ``name`` (its own module name: each test imports its own)."""
    src = tmp / f"{name}.cpp"
    src.write_text(
        PROBE.replace("trident_jit_probe", name).replace("return PyLong", body + "return PyLong")
    )
    return src


def _key_folder(cache: Path, name: str, src: Path) -> Path:
    from megatron.fused_kernels import loader

    return cache / loader.build_key(name, [src], ["-O1"])


LOAD_IN_CHILD = """
import sys
from pathlib import Path
from megatron.fused_kernels import loader
module = loader.jit_build(sys.argv[1], [Path(sys.argv[2])], cflags=["-O1"], cache_root=Path(sys.argv[3]))
print("answer", module.answer(), "compiled", len(loader.compiled_in_this_process))
"""


def test_a_cached_library_cut_short_is_rebuilt_not_loaded(tmp_path: Path) -> None:
    """A cached ``.so`` cut to half its size (a full disk while copying the cache) used to kill the next process
    with SIGBUS in dlopen (rc 135, no message); its build record (size + sha256) no longer vouches for it, so the
    next process logs one line and rebuilds. The record is written atomically: no temporary file is left."""
    from megatron.fused_kernels import loader

    name = "trident_jit_probe_cut"
    src, cache = _probe(tmp_path, name), tmp_path / "cache"
    assert loader.jit_build(name, [src], cflags=["-O1"], cache_root=cache).answer() == 42
    folder = _key_folder(cache, name, src)
    (library,) = folder.glob(f"{name}*.so")
    whole = library.read_bytes()
    library.unlink()  # a new file (a copy cut short): this process keeps its own mapping of the old one
    library.write_bytes(whole[: len(whole) // 2])
    env = {**os.environ, "PYTHONPATH": str(Path(loader.__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", LOAD_IN_CHILD, name, str(src), str(cache)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert "answer 42 compiled 1" in done.stdout, done.stdout
    assert "rebuilding" in done.stderr and "cut short" in done.stderr, done.stderr[-3000:]
    from megatron.fused_kernels import build_cache

    (library,) = folder.glob(f"{name}*.so")
    assert build_cache.record_problem(library) is None and library.read_bytes() == whole
    cut = tmp_path / "cut" / library.name
    cut.parent.mkdir()
    cut.write_bytes(whole[:4096])
    shutil.copy(folder / build_cache.RECORD, cut.parent)
    assert "cut short" in (build_cache.record_problem(cut) or "")
    assert not [p for p in cache.rglob("*") if p.name.endswith(".tmp")]


def test_a_build_folder_name_taken_by_a_file_is_one_clear_error(tmp_path: Path) -> None:
    """A regular file where the build folder goes: every start used to compile (~45 s), fail to rename the build
    into place and drop it, silently. Now the build is refused before compiling, with one line naming the path and
    the fix; the loader turns it into its one warning and the references (a cache problem does not stop a run).
    The file is left as it was."""
    from megatron.fused_kernels import loader

    name = "trident_jit_probe_blocked"
    src, cache = _probe(tmp_path, name), tmp_path / "cache"
    cache.mkdir()
    blocker = _key_folder(cache, name, src)
    blocker.write_text("not a folder\n")
    compiled = len(loader.compiled_in_this_process)
    with pytest.raises(RuntimeError) as raised:
        loader.jit_build(name, [src], cflags=["-O1"], cache_root=cache)
    why = str(raised.value)
    assert f"{blocker} is taken by a file" in why and f"rm {blocker}" in why, why
    assert loader.CACHE_ENV in why and "\n" not in why
    assert len(loader.compiled_in_this_process) == compiled  # nothing compiled for nothing
    assert blocker.read_text() == "not a folder\n"
    assert loader.failure_line(raised.value) == why


def _hold(lock: Path, pid: int) -> int:
    """Take ``lock`` as another process would (a separate open file), recording ``pid`` on this host."""
    import fcntl
    import socket

    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {pid} host {socket.gethostname()} since 2026-01-01T00:00:00\n".encode())
    return fd


@pytest.mark.timeout(60)
def test_a_held_build_lock_is_logged_and_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process holds the build lock and never finishes: the wait used to be endless and silent. Now it
    names the holder at once and every LOG_EVERY s, and gives up after $TRIDENT_KERNEL_LOCK_TIMEOUT with one error
    naming the lock file (the loader's warning, then the references). A holder recorded on this host whose pid is
    dead is taken over (where the filesystem kept its lock)."""
    from megatron.fused_kernels import loader

    name = "trident_jit_probe_locked"
    src, cache = _probe(tmp_path, name), tmp_path / "cache"
    cache.mkdir()
    lock = cache / f"{_key_folder(cache, name, src).name}.lock"
    holder = _hold(lock, os.getpid())  # alive: this process
    monkeypatch.setenv("TRIDENT_KERNEL_LOCK_TIMEOUT", "1")
    caplog.set_level(logging.WARNING, logger="megatron.fused_kernels")

    def wait_for_lock() -> str:
        with pytest.raises(RuntimeError, match="waiting for the kernel build lock") as raised:
            loader.jit_build(name, [src], cflags=["-O1"], cache_root=cache)
        return str(raised.value)

    try:
        why = wait_for_lock()  # the default LOG_EVERY: one line at once
        from megatron.fused_kernels import build_cache

        monkeypatch.setattr(build_cache, "LOG_EVERY", 0.3)
        caplog.clear()
        wait_for_lock()
    finally:
        os.close(holder)
    assert str(lock) in why and f"pid {os.getpid()} on host" in why and f"delete {lock}" in why, why
    waiting = [
        r.getMessage() for r in caplog.records if "waiting for the build lock" in r.getMessage()
    ]
    assert len(waiting) >= 2 and all(f"pid {os.getpid()}" in m for m in waiting), waiting
    # a holder that is gone (its pid dead on this host) but whose lock was kept: taken over
    finished = subprocess.Popen(["true"])
    finished.wait()  # reaped: its pid names no process now
    dead = _hold(lock, finished.pid)
    try:
        with build_cache.build_lock(lock, timeout=20):
            assert lock.read_text().startswith(f"pid {os.getpid()} host")
    finally:
        os.close(dead)
    assert any("taking over the build lock" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv(build_cache.LOCK_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="TRIDENT_KERNEL_LOCK_TIMEOUT='soon' must be a positive"):
        build_cache.lock_timeout()


def test_a_failed_build_keeps_the_compiler_output(tmp_path: Path) -> None:
    """A compile error used to be reported by its first 300 characters (the compiler's command line, not the
    error). Now the whole output goes to a log beside the build folder, and the one-line message holds the first
    error lines and the log's path."""
    from megatron.fused_kernels import loader

    name = "trident_jit_probe_broken"
    src, cache = _probe(tmp_path, name, body="planted_undeclared_name; "), tmp_path / "cache"
    with pytest.raises(RuntimeError) as raised:
        loader.jit_build(name, [src], cflags=["-O1"], cache_root=cache)
    why = str(raised.value)
    log = cache / f"{_key_folder(cache, name, src).name}.log"
    assert "\n" not in why and "planted_undeclared_name" in why and "error" in why, why
    assert f"full compiler output in {log}" in why, why
    full = log.read_text()
    assert "planted_undeclared_name" in full and str(src) in full and "ninja" in full, full[-2000:]
    assert not [p.name for p in cache.iterdir() if p.name.startswith(".")]  # no staging left
    assert loader.failure_line(raised.value) == why  # what the loader's warning shows


def test_the_cuda_build_key_holds_the_architecture() -> None:
    """Without TORCH_CUDA_ARCH_LIST the key used to hold no architecture: an sm_80 build was loaded on an sm_90
    device. Now the list torch compiles for is derived the way torch derives it (the visible devices, capped at
    torch's newest, PTX for the last), passed as explicit -gencode flags and put in the key."""
    from megatron.fused_kernels import loader

    torch_archs = ["sm_70", "sm_80", "sm_90", "compute_90"]
    a100, a100_flags = loader.cuda_arch(None, [(8, 0)], torch_archs)
    h100, h100_flags = loader.cuda_arch("", [(9, 0), (9, 0)], torch_archs)
    assert (a100, h100) == ("8.0+PTX", "9.0+PTX")
    assert a100_flags == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_80,code=compute_80",
    ]
    assert loader.cuda_arch("native", [(9, 0), (8, 0)], torch_archs)[0] == "8.0;9.0+PTX"
    assert loader.cuda_arch(None, [(12, 0)], torch_archs)[0] == "9.0+PTX"  # capped, as torch does
    assert loader.cuda_arch(" 8.0;9.0 ", [(8, 0)], torch_archs) == ("8.0;9.0", [])  # torch reads it
    with pytest.raises(RuntimeError, match="no CUDA device"):
        loader.cuda_arch(None, [], torch_archs)
    srcs = loader.sources("cuda")
    assert srcs, "csrc/cuda has no sources"

    def key(arch: str, flags: list[str]) -> str:
        return loader.build_key("trident_cuda_kernels", srcs, ["-O3", "-O3", *flags], arch=arch)

    assert key(a100, a100_flags) != key(h100, h100_flags)
    assert key(a100, a100_flags) == key(*loader.cuda_arch(None, [(8, 0)], torch_archs))
    assert key("8.0", []) != key("9.0", [])  # an explicit TORCH_CUDA_ARCH_LIST is in the key too


def test_a_multiline_failure_is_summarised_on_one_line() -> None:
    from megatron.fused_kernels import loader

    output = "[1/2] c++ -c probe.cpp -o probe.o\nFAILED: probe.o\nprobe.cpp:3:5: error: 'x' was not declared\n"
    assert loader.failure_line(RuntimeError(output)) == "probe.cpp:3:5: error: 'x' was not declared"
    assert loader.failure_line(RuntimeError("no C++ compiler")) == "no C++ compiler"
    assert loader.failure_line(RuntimeError()) == "RuntimeError"
