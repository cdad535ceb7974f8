"""Compile checks of the CUDA fused kernels (``csrc/cuda``) on machines without a GPU.

Nothing here runs a kernel: the numerical tests against ``megatron/fused_kernels/reference.py`` need a
GPU and live elsewhere. These tests catch what a CPU-only CI can: every ``.cu`` file compiles with
nvcc for sm_80 (A100) and sm_90 (H100/H200) without a warning and without a register spill (ptxas
``-v``: a kernel that spills under its ``__launch_bounds__`` reads and writes local memory in its
inner loop), and with CUDA 12 for sm_70 (V100, which CUDA 13 no longer targets; fp32/fp16 only, the
bf16 kernels reduced to a trap); no ``.cu`` file pulls in a torch header (the contract keeps them plain
CUDA), and ``binding.cpp`` passes a C++ syntax check against torch's headers.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
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


# The sm_70 compile. PyPI's CUDA 12 compiler wheels carry no nvcc driver (nvidia-cuda-nvcc-cu12 12.0-12.9 ship
# ptxas and libnvvm only), so the check uses CUDA 12's NVRTC (nvidia-cuda-nvrtc-cu12): the same front end,
# NVVM and ptxas as nvcc 12, compiling each .cu for sm_70 to a cubin. NVRTC compiles device code only, so
# -default-device (with -rdc for the launches) turns the host launchers into device code: every kernel
# template each launcher instantiates is compiled, as nvcc's device pass would. scripts/setup_env.sh installs
# the wheels (requirements-cuda12.txt) into .venv/cuda12; TRIDENT_CUDA12 names another such --target dir.
CUDA12_DIR = Path(os.environ.get("TRIDENT_CUDA12") or Path(sys.prefix) / "cuda12")
# NVRTC has no host C library: the host headers the kernels include, reduced to what they use.
NVRTC_STUBS = {
    "cstdint": "typedef signed char int8_t; typedef short int16_t; typedef int int32_t;\n"
    "typedef long long int64_t; typedef unsigned char uint8_t; typedef unsigned short uint16_t;\n"
    "typedef unsigned int uint32_t; typedef unsigned long long uint64_t;\n"
    "typedef unsigned long long uintptr_t;\n"
    "namespace std { using ::int32_t; using ::int64_t; using ::uint32_t; using ::uint64_t;\n"
    "using ::uintptr_t; }\n",
    "math.h": "#define INFINITY __int_as_float(0x7f800000)\n#define NAN __int_as_float(0x7fffffff)\n",
    "float.h": "#define FLT_MAX 3.402823466e+38F\n",
}
# The one warning sm_70 always draws (NVRTC has no -Wno-deprecated-gpu-targets); any other fails the test.
NVRTC_SM70_DEPRECATED = "Architectures prior to '<compute/sm>_75' are deprecated"
PTX_ENTRY = re.compile(r"^(?:\.visible\s+)?\.entry\s+(\S+?)\(", re.MULTILINE)


def _nvrtc12() -> ctypes.CDLL | None:
    """CUDA 12's NVRTC from CUDA12_DIR, or None where it is not installed."""
    libs = sorted((CUDA12_DIR / "nvidia" / "cuda_nvrtc" / "lib").glob("libnvrtc.so.12*"))
    runtime_h = CUDA12_DIR / "nvidia" / "cuda_runtime" / "include" / "cuda_runtime.h"
    if not libs or not runtime_h.exists():
        return None
    try:
        return ctypes.CDLL(str(libs[0]))
    except OSError:
        return None


def _nvrtc_compile(lib: ctypes.CDLL, src: Path, options: list[str]) -> tuple[int, str, str, int]:
    """Compile ``src`` with NVRTC: (result code, log, PTX, cubin bytes)."""
    prog = ctypes.c_void_p()
    code = lib.nvrtcCreateProgram(
        ctypes.byref(prog), src.read_bytes(), src.name.encode(), 0, None, None
    )
    assert code == 0, f"nvrtcCreateProgram: {code}"

    def read(size_fn: str, get_fn: str) -> str:
        size = ctypes.c_size_t()
        if getattr(lib, size_fn)(prog, ctypes.byref(size)) != 0:
            return ""
        buf = ctypes.create_string_buffer(size.value)
        getattr(lib, get_fn)(prog, buf)
        return buf.raw.rstrip(b"\0").decode(errors="replace")

    try:
        opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        code = lib.nvrtcCompileProgram(prog, len(options), opts)
        log = read("nvrtcGetProgramLogSize", "nvrtcGetProgramLog")
        if code != 0:
            return code, log, "", 0
        cubin = len(read("nvrtcGetCUBINSize", "nvrtcGetCUBIN"))
        return code, log, read("nvrtcGetPTXSize", "nvrtcGetPTX"), cubin
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _sm70_problems(name: str, result: tuple[int, str, str, int]) -> list[str]:
    """What is wrong with one file's sm_70 compile: errors, warnings, no cubin, bf16 code."""
    code, log, ptx, cubin = result
    warnings = [
        line for line in log.splitlines() if "warning" in line and NVRTC_SM70_DEPRECATED not in line
    ]
    if code != 0 or warnings or cubin == 0:
        return [f"{name}: nvrtc result {code}, cubin {cubin} bytes\n{log}"]
    entries = dict(zip(PTX_ENTRY.findall(ptx), PTX_ENTRY.split(ptx)[2::2], strict=True))
    bf16 = [k for k in entries if "nv_bfloat16" in k]
    problems = [
        f"{name}: bf16 kernel {k} has code for sm_70" for k in bf16 if "trap;" not in entries[k]
    ]
    problems += [
        f"{name}: {k} traps on sm_70" for k in entries if k not in bf16 and "trap;" in entries[k]
    ]
    if not bf16 or len(bf16) == len(entries):
        problems.append(
            f"{name}: {len(bf16)} bf16 of {len(entries)} kernels (expected some of each)"
        )
    return problems


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


def test_every_cu_file_compiles_for_sm70_with_cuda12(tmp_path: Path) -> None:
    """Volta: each .cu compiles for sm_70 with CUDA 12 without a warning; its bf16 kernels are only a trap."""
    lib = _nvrtc12()
    if lib is None:
        pytest.skip(
            f"CUDA 12 NVRTC not installed at {CUDA12_DIR} (scripts/setup_env.sh installs "
            "requirements-cuda12.txt there; TRIDENT_CUDA12 names another --target dir): "
            "the sm_70 (V100) compile is not checked"
        )
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, text in NVRTC_STUBS.items():
        (stubs / name).write_text("#pragma once\n" + text, encoding="utf-8")
    options = [
        "-arch=sm_70", "-std=c++17", "-default-device", "-rdc=true", f"-I{CUDA_DIR}",
        f"-I{CUDA12_DIR / 'nvidia' / 'cuda_runtime' / 'include'}", f"-I{stubs}",
    ]  # fmt: skip
    with ThreadPoolExecutor(
        max_workers=2
    ) as pool:  # CI has 2 cores; NVRTC is thread-safe per program
        results = list(pool.map(lambda src: _nvrtc_compile(lib, src, options), CU_FILES))
    problems = [
        p for src, r in zip(CU_FILES, results, strict=True) for p in _sm70_problems(src.name, r)
    ]
    assert not problems, "\n\n".join(problems)


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
