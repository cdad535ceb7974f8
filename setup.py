"""Build script for Trident (distribution name ``trident-llm``; import package ``megatron``).

C++ extensions are optional: each one that fails to build is skipped with a warning, and the code falls back to its
NumPy/PyTorch reference at run time (the fused kernels first try a JIT build, see megatron/fused_kernels/loader.py).

- ``megatron.data._helpers``: the dataset-index helpers (pybind11), always.
- ``megatron.fused_kernels._cpu``: the CPU kernels of ``csrc/cpu`` (a torch C++ extension), always; AVX2 code where
  the building CPU has AVX2 + FMA (the loader refuses it on a CPU without them).
- ``megatron.fused_kernels._cuda``: the CUDA kernels of ``csrc/cuda`` when torch has CUDA and ``nvcc`` is found;
  architectures from ``TORCH_CUDA_ARCH_LIST`` (default ``8.0;9.0``).

    pip install --no-build-isolation -e .      # torch and pybind11 must already be installed
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # the kernel flags and source lists come from the package itself

try:  # torch is installed first (pip install --no-build-isolation); without it only the data helpers build
    from torch.utils import cpp_extension
except ImportError:
    cpp_extension = None

_BASE = cpp_extension.BuildExtension if cpp_extension is not None else build_ext


class OptionalBuildExt(_BASE):  # type: ignore[misc, valid-type]
    """build_ext that turns a failed extension build into a warning instead of an error."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any toolchain failure makes the extension optional
            sys.stderr.write(
                f"WARNING: optional C++ extensions not built ({exc}); using Python fallbacks.\n"
            )

    def build_extension(self, ext) -> None:  # type: ignore[no-untyped-def]
        record = _sources_record(ext)
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            if record is not None:
                record[0].unlink(missing_ok=True)
            removed = self._remove_stale(ext)
            sys.stderr.write(
                f"WARNING: optional extension {ext.name} not built ({exc}); using its Python fallback"
                + (f" (removed the stale {', '.join(removed)})" if removed else "")
                + ".\n"
            )
        else:  # built (or up to date: depends= lists the headers): the loader checks the record against csrc/
            if record is not None:
                record[0].write_text(record[1] + "\n", encoding="utf-8")

    def _remove_stale(self, ext) -> list[str]:  # type: ignore[no-untyped-def]
        """Deletes what an earlier build of ``ext`` left (in the build folder, and in the source tree for
        ``--inplace`` / editable installs, which copy the build folder's file there even after a failed compile):
        a binary of older sources must not be imported as if it were built from these."""
        built = Path(self.get_ext_fullpath(ext.name))
        in_tree = ROOT.joinpath(*ext.name.split(".")[:-1]) / built.name
        removed = []
        for path in dict.fromkeys([built.resolve(), in_tree.resolve()]):
            if path.is_file():
                path.unlink()
                removed.append(str(path))
        return removed


def _sources_record(ext) -> tuple[Path, str] | None:  # type: ignore[no-untyped-def]
    """For a fused-kernel extension: the file recording its sources' digest and that digest (else None)."""
    kind = {"megatron.fused_kernels._cpu": "cpu", "megatron.fused_kernels._cuda": "cuda"}.get(
        ext.name
    )
    if kind is None:
        return None
    from megatron.fused_kernels.loader import prebuilt_sources_file, sources, sources_digest

    return prebuilt_sources_file(kind), sources_digest(sources(kind, ROOT / "csrc"))


def _extensions() -> list:
    if os.environ.get("TRIDENT_NO_EXTENSIONS") == "1":
        return []
    try:
        from pybind11.setup_helpers import Pybind11Extension
    except ImportError:
        sys.stderr.write("WARNING: pybind11 not installed; C++ data helpers not built.\n")
        return []
    exts = []
    helpers = ROOT / "csrc" / "data" / "helpers.cpp"
    if helpers.exists():
        exts.append(
            Pybind11Extension(
                "megatron.data._helpers",
                [str(helpers.relative_to(ROOT))],
                cxx_std=17,
                extra_compile_args=["-O3"],
                optional=True,  # also: a failed build's file is not copied in place (it was removed)
            )
        )
    return exts + _kernel_extensions()


def _kernel_extensions() -> list:
    if cpp_extension is None:
        sys.stderr.write(
            "WARNING: torch not importable at build time; fused kernels are JIT-built on use.\n"
        )
        return []
    import shutil

    import torch

    from megatron.fused_kernels.loader import (
        CPU_LDFLAGS,
        build_flavour,
        cpu_cflags,
        headers,
        prebuilt_flavour_file,
        sources,
    )

    def rel(paths: list[Path]) -> list[str]:
        return [str(p.relative_to(ROOT)) for p in paths]

    exts = []
    cpu = sources("cpu", ROOT / "csrc")
    if cpu:
        # read by the loader before it imports the extension (AVX2/AVX512 code must not load on other CPUs)
        try:
            flavour = build_flavour()  # $TRIDENT_CPU_FLAVOUR, else the widest this CPU runs
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
        prebuilt_flavour_file().write_text(flavour + "\n")
        exts.append(
            cpp_extension.CppExtension(
                "megatron.fused_kernels._cpu",
                rel(cpu),
                depends=rel(headers(cpu)),  # an edited header alone rebuilds too
                extra_compile_args={"cxx": cpu_cflags(flavour)},
                extra_link_args=CPU_LDFLAGS,
                optional=True,
            )
        )
    cuda = sources("cuda", ROOT / "csrc")
    nvcc = cpp_extension.CUDA_HOME and shutil.which(
        os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
    )
    if cuda and torch.version.cuda and nvcc:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        exts.append(
            cpp_extension.CUDAExtension(
                "megatron.fused_kernels._cuda",
                rel(cuda),
                depends=rel(headers(cuda)),
                extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
                optional=True,
            )
        )
    return exts


setup(
    name="trident-llm",
    version="0.1.0",
    description="3D-parallel (TP x PP x ZeRO) GPT/LLaMA pretraining in the Megatron-DeepSpeed tradition",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8")
    if (ROOT / "README.md").exists()
    else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron", "megatron.*", "tools", "tools.*"]),
    ext_modules=_extensions(),  # writes megatron/fused_kernels/_cpu.flavour first
    # the loader reads the CPU extension's flavour before importing it: it must travel with the .so
    package_data={"megatron.fused_kernels": ["_cpu.flavour"]},
    cmdclass={"build_ext": OptionalBuildExt},
    install_requires=[
        "torch>=2.1",
        "deepspeed==0.19.8",  # the release megatron/deepspeed_internals.py is tested with
        "transformers",
        "sentencepiece",
        "safetensors",
        "numpy",
        "pybind11",
        "ninja",
        "regex",
    ],
    zip_safe=False,
)
