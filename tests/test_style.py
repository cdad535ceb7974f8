"""House-style checks that CI enforces: layering (imports never go upward) and file size."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEGATRON = ROOT / "megatron"

# package -> packages it must never import (STYLE.md section 1: mpu -> model -> training, never upward).
FORBIDDEN = {
    "megatron.config": (
        "megatron.mpu",
        "megatron.model",
        "megatron.training",
        "megatron.checkpointing",
        "megatron.data",
        "megatron.tokenizer",
    ),
    "megatron.mpu": (
        "megatron.model",
        "megatron.training",
        "megatron.checkpointing",
        "megatron.data",
        "megatron.text_generation",
    ),
    "megatron.model": ("megatron.training", "megatron.checkpointing", "megatron.text_generation"),
    "megatron.data": ("megatron.model", "megatron.training", "megatron.checkpointing"),
    "megatron.tokenizer": ("megatron.model", "megatron.training", "megatron.mpu", "megatron.data"),
    "megatron.fused_kernels": ("megatron.model", "megatron.training", "megatron.checkpointing"),
    # Text generation sits on top (checkpoint -> model -> tokens); only tools/ import it.
    "megatron.checkpointing": ("megatron.text_generation",),
    "megatron.training": ("megatron.text_generation",),
}
MAX_CODE_LINES = 800


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_imports_never_go_upward() -> None:
    violations = []
    for path in sorted(MEGATRON.rglob("*.py")):
        mod = _module_name(path)
        for pkg, banned in FORBIDDEN.items():
            if mod == pkg or mod.startswith(pkg + "."):
                for name in sorted(_imports(path)):
                    if any(name == b or name.startswith(b + ".") for b in banned):
                        violations.append(
                            f"{path.relative_to(ROOT)} imports {name} ({pkg} must not)"
                        )
    assert not violations, "layering violations:\n" + "\n".join(violations)


def test_files_stay_under_the_size_ceiling() -> None:
    too_big = []
    files = list(MEGATRON.rglob("*.py")) + list((ROOT / "tools").rglob("*.py"))
    files.append(ROOT / "pretrain_gpt.py")
    for path in files:
        if not path.exists():
            continue
        code = [
            ln
            for ln in path.read_text(encoding="utf-8").splitlines()
            if ln.strip() and not ln.strip().startswith("#")
        ]
        if len(code) > MAX_CODE_LINES:
            too_big.append(f"{path.relative_to(ROOT)}: {len(code)} code lines")
    assert not too_big, f"files over {MAX_CODE_LINES} code lines (split them):\n" + "\n".join(
        too_big
    )


def test_the_checker_catches_an_upward_import(tmp_path: Path) -> None:
    # The layering check must be able to fail: an mpu-like file importing model is flagged.
    bad = tmp_path / "bad.py"
    bad.write_text("from megatron.model import gpt\nimport megatron.training.loop\n")
    assert _imports(bad) == {"megatron.model", "megatron.training.loop"}
