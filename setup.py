"""Build script for Trident (distribution name ``trident-llm``; import package ``megatron``).

C++ extensions are optional: each one that fails to build is skipped with a warning, and the code falls back to its
NumPy/PyTorch reference at run time. Nothing is compiled at run time.

    pip install --no-build-isolation -e .      # torch and pybind11 must already be installed
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class OptionalBuildExt(build_ext):
    """build_ext that turns a failed extension build into a warning instead of an error."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any toolchain failure makes the extension optional
            sys.stderr.write(
                f"WARNING: optional C++ extensions not built ({exc}); using Python fallbacks.\n"
            )

    def build_extension(self, ext) -> None:  # type: ignore[no-untyped-def]
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            sys.stderr.write(
                f"WARNING: optional extension {ext.name} not built ({exc}); using its Python fallback.\n"
            )


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
    ext_modules=_extensions(),
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
