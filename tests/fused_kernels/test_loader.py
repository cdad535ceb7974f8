"""The kernel loader: concurrent JIT builds compile once and never load a half-written build; a machine that cannot
build (no compiler) still trains, on the references, with one warning; an extension built from other sources than
csrc/ holds now is never loaded (the loader refuses it, a failed ``setup.py`` build removes it).

The concurrency test builds a tiny Python extension (no torch headers: it compiles in about a second) through the
same ``jit_build`` the kernels use, from 4 processes started together on one cache folder.
"""

from __future__ import annotations

import json
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
