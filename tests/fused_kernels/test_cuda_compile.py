"""Compile checks of the CUDA fused kernels (``csrc/cuda``) on machines without a GPU.

Nothing here runs a kernel: the numerical tests against ``megatron/fused_kernels/reference.py`` need a
GPU and live elsewhere. These tests catch what a CPU-only CI can: every ``.cu`` file compiles with
nvcc for sm_80 (A100) and sm_90 (H100/H200) without a warning and without a register spill (ptxas
``-v``: a kernel that spills under its ``__launch_bounds__`` reads and writes local memory in its
inner loop), no ``.cu`` file pulls in a torch header (the contract keeps them plain CUDA), and
``binding.cpp`` passes a C++ syntax check against torch's headers.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "csrc" / "cuda"
CU_FILES = sorted(CUDA_DIR.glob("*.cu"))
EXPECTED = {"norms.cu", "softmax.cu", "activations.cu", "rope.cu", "cross_entropy.cu"}
NVCC = shutil.which("nvcc")
CXX = shutil.which("g++") or shutil.which("c++")
ARCH_FLAGS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]
TORCH_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](torch|ATen|c10)/', re.MULTILINE)
# ptxas -v: "Compiling entry function '_Z...' for 'sm_80'" then "... N bytes spill stores, M bytes spill loads"
PTXAS_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+)'")
PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")

# Headers ATen/cuda/CUDAContext.h needs that a CPU-only machine lacks: the CPU torch wheel has no
# generated c10/cuda/impl/cuda_cmake_macros.h and a bare CUDA toolkit may have no cuBLAS / cuSPARSE
# / cuSOLVER headers. Only the type names torch's headers mention are declared; they are searched
# after every real include dir (-idirafter), so a full CUDA install uses its own headers.
STUB_HEADERS = {
    "c10/cuda/impl/cuda_cmake_macros.h": "",
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t;\n",
    "cublas_v2.h": "typedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;\n",
    "cublasLt.h": "typedef struct cublasLtContext* cublasLtHandle_t;\n",
    "cusolverDn.h": "typedef struct cusolverDnContext* cusolverDnHandle_t;\n",
    "cusolver_common.h": "typedef int cusolverStatus_t;\n",
}


def _cuda_include_dir() -> Path | None:
    """The CUDA toolkit's include dir (``cuda_runtime_api.h``), or None."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if NVCC:
        candidates.insert(0, str(Path(NVCC).resolve().parents[1]))
    for base in candidates:
        if base and (Path(base) / "include" / "cuda_runtime_api.h").exists():
            return Path(base) / "include"
    return None


def test_the_contract_files_exist() -> None:
    names = {p.name for p in CU_FILES}
    assert names >= EXPECTED, f"missing in csrc/cuda: {sorted(EXPECTED - names)}"
    assert (CUDA_DIR / "kernels.h").exists() and (CUDA_DIR / "binding.cpp").exists()


def test_no_torch_header_in_the_kernels() -> None:
    """The .cu files and kernels.h stay plain CUDA; only binding.cpp includes torch."""
    offenders = [
        f"{path.name}: {m.group(0).strip()}"
        for path in [*CU_FILES, CUDA_DIR / "kernels.h"]
        for m in TORCH_INCLUDE.finditer(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "torch headers in plain-CUDA files:\n" + "\n".join(offenders)


def spilling_kernels(ptxas_output: str) -> list[str]:
    """``kernel for sm_XX: S bytes spill stores, L bytes spill loads`` for every entry function of ``ptxas -v``
    output that spills."""
    found, entry = [], None
    for line in ptxas_output.splitlines():
        if m := PTXAS_ENTRY.search(line):
            entry = f"{m.group(1)} for {m.group(2)}"
        elif (m := PTXAS_SPILL.search(line)) and entry and (int(m.group(1)) or int(m.group(2))):
            found.append(f"{entry}: {m.group(0)}")
    return found


def test_spill_parser_finds_a_spill() -> None:
    """The spill check reads ptxas' lines as they are (here the masked softmax forward's before its fix)."""
    log = (
        "ptxas info    : Compiling entry function '_Z18softmax_fwd_kernelI6__halfLi8ELb0EEvPKT_' "
        "for 'sm_80'\nptxas info    : Function properties for _Z18softmax_fwd_kernel\n"
        "    16 bytes stack frame, 12 bytes spill stores, 24 bytes spill loads\n"
        "ptxas info    : Compiling entry function '_Z6otherv' for 'sm_90'\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    )
    assert spilling_kernels(log) == [
        "_Z18softmax_fwd_kernelI6__halfLi8ELb0EEvPKT_ for sm_80: 12 bytes spill stores, 24 bytes spill loads"
    ]


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: install the CUDA toolkit to compile")
def test_every_cu_file_compiles_for_sm80_and_sm90(tmp_path: Path) -> None:
    def compile_one(src: Path) -> tuple[str, subprocess.CompletedProcess[str]]:
        cmd = [
            str(NVCC), "-c", "-O3", "-std=c++17", *ARCH_FLAGS, "-Xcompiler", "-Wall",
            "-Xptxas", "-v", "-I", str(CUDA_DIR), "-o", str(tmp_path / f"{src.stem}.o"), str(src),
        ]  # fmt: skip
        return src.name, subprocess.run(cmd, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=2) as pool:  # CI has 2 cores
        results = list(pool.map(compile_one, CU_FILES))
    # ptxas -v prints only "ptxas info" lines on a clean compile, so any warning (ours, nvcc's or ptxas')
    # fails the test, and so does any kernel that spills registers.
    failures = [
        f"{name}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}"
        for name, proc in results
        if proc.returncode != 0 or "warning" in (proc.stdout + proc.stderr).lower()
    ]
    failures += [
        f"{name}: {spill}"
        for name, proc in results
        for spill in spilling_kernels(proc.stdout + proc.stderr)
    ]
    assert not failures, "\n\n".join(failures)


def test_binding_passes_a_syntax_check(tmp_path: Path) -> None:
    """binding.cpp against torch's headers: names, signatures and the launcher calls type-check."""
    from torch.utils.cpp_extension import include_paths

    cuda_include = _cuda_include_dir()
    python_include = sysconfig.get_paths()["include"]
    torch_dirs = [Path(p) for p in include_paths()]
    if CXX is None or cuda_include is None:
        pytest.skip("needs a C++ compiler and the CUDA toolkit's headers (cuda_runtime_api.h)")
    if not (Path(python_include) / "Python.h").exists():
        pytest.skip(f"Python headers not installed ({python_include}/Python.h)")
    if not any((d / "ATen" / "cuda" / "CUDAContext.h").exists() for d in torch_dirs):
        pytest.skip("this torch install ships no ATen/cuda headers")
    stubs = tmp_path / "stubs"
    for name, text in STUB_HEADERS.items():
        (stubs / name).parent.mkdir(parents=True, exist_ok=True)
        (stubs / name).write_text("#pragma once\n" + text, encoding="utf-8")
    cmd = [
        str(CXX), "-fsyntax-only", "-std=c++20", "-Wall",  # torch >= 2.10 headers need C++20
        "-DTORCH_EXTENSION_NAME=_cuda", "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(f"-I{d}" for d in torch_dirs), f"-I{python_include}", f"-I{cuda_include}",
        f"-I{CUDA_DIR}", "-idirafter", str(stubs), str(CUDA_DIR / "binding.cpp"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    ours = [line for line in output.splitlines() if "csrc/cuda/" in line and "warning" in line]
    assert proc.returncode == 0 and not ours, output
