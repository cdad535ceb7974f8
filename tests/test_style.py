"""House-style checks that CI enforces: the package order (every edge), test code kept out of the library, and the
file-size ceiling (STYLE.md sections 1 and 5)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, ...], ...] = (
    ("megatron.config", "megatron.log"),
    (
        "megatron.mpu",
        "megatron.fused_kernels",
        "megatron.layout",
        "megatron.tokenizer",
        "megatron.deepspeed_internals",
    ),
    ("megatron.model", "megatron.data"),
    ("megatron.checkpointing",),
    ("megatron.training",),
    ("megatron.conversion",),
    ("megatron.text_generation",),
)
"""The package order, bottom first (README "Architecture" shows the same table). A package imports packages of
lower rows only: never a row above its own, never another package of its row."""

TEST_ONLY = "megatron.testing"
"""Imported by tests/ alone (and by tools/mpu_selfcheck.py, the command line of its mpu oracle)."""
TEST_DRIVERS = ("tools/mpu_selfcheck.py",)
MAX_CODE_LINES = 800


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports; ``from megatron import mpu`` counts as ``megatron.mpu``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if _package(node.module) is None:  # from megatron import mpu -> megatron.mpu
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            else:
                names.add(node.module)
    return names


def _package(module: str) -> str | None:
    """The package of ``module`` in :data:`LAYERS` (or the test-only one), None for anything else."""
    for pkg in (TEST_ONLY, *(p for row in LAYERS for p in row)):
        if module == pkg or module.startswith(pkg + "."):
            return pkg
    return None


def _row(pkg: str) -> int:
    return next(i for i, row in enumerate(LAYERS) if pkg in row)


def layering_violations(root: Path) -> list[str]:
    """Every import under ``root`` that breaks the package order or brings test code into the library."""
    out = []
    for path in sorted((root / "megatron").rglob("*.py")):
        mine = _package(_module_name(path, root))
        if mine is None or mine == TEST_ONLY:
            continue  # megatron/__init__.py; the test utilities may use anything
        for name in sorted(_imports(path)):
            theirs = _package(name)
            if theirs is None or theirs == mine:
                continue
            if theirs == TEST_ONLY:
                out.append(f"{path.relative_to(root)} imports {name} (test code, tests/ only)")
            elif _row(theirs) >= _row(mine):
                where = "the same row" if _row(theirs) == _row(mine) else "a higher row"
                out.append(f"{path.relative_to(root)} imports {name} ({mine} must not: {where})")
    entry_points = [*(root / "tools").rglob("*.py"), root / "pretrain_gpt.py"]
    for path in sorted(p for p in entry_points if p.exists()):
        if str(path.relative_to(root)) in TEST_DRIVERS:
            continue
        out += [
            f"{path.relative_to(root)} imports {name} (test code, tests/ only)"
            for name in sorted(_imports(path))
            if _package(name) == TEST_ONLY
        ]
    return out


def test_imports_follow_the_package_order() -> None:
    violations = layering_violations(ROOT)
    assert not violations, "layering violations:\n" + "\n".join(violations)


def test_every_library_package_has_a_row() -> None:
    packages = {p.name for p in (ROOT / "megatron").iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in (ROOT / "megatron").glob("*.py") if p.stem != "__init__"}
    known = {pkg.split(".")[1] for row in LAYERS for pkg in row} | {TEST_ONLY.split(".")[1]}
    assert packages | modules <= known, f"add to LAYERS: {sorted((packages | modules) - known)}"


def test_readme_architecture_matches_the_table() -> None:
    """README's "Architecture" picture gives every package of :data:`LAYERS` its row (numbered from 1)."""
    import re

    readme = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = readme.split("# Architecture", 1)[1].split("```", 2)[1]
    rows: dict[str, int] = {}
    row = 0
    for line in block.splitlines():
        m = re.match(r"\s*(\d+)?\s+megatron/(\w+)", line)
        if m:
            row = int(m.group(1)) if m.group(1) else row
            rows[f"megatron.{m.group(2)}"] = row
    expected = {pkg: i + 1 for i, packages in enumerate(LAYERS) for pkg in packages}
    assert {p: rows.get(p) for p in expected} == expected


def global_group_reads(root: Path) -> list[str]:
    """Places in ``megatron/model`` that take a process group from the process-wide ``parallel_state`` instead of
    the ``ParallelContext`` the model is given (importing its getters, or the ``mpu`` package as a whole)."""
    out = []
    for path in sorted((root / "megatron" / "model").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module in ("megatron", "megatron.mpu"):
                names = [a.name for a in node.names if a.name in ("mpu", "parallel_state")]
            elif isinstance(node, ast.ImportFrom) and node.module == "megatron.mpu.parallel_state":
                names = [a.name for a in node.names if a.name != "ProcessGroup"]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("megatron.mpu")]
            out += [f"{path.relative_to(root)}:{node.lineno} imports {n}" for n in names]
    return out


def test_the_model_takes_its_groups_explicitly(tmp_path: Path) -> None:
    found = global_group_reads(ROOT)
    assert not found, "the model must use its ParallelContext's group:\n" + "\n".join(found)
    bad = tmp_path / "megatron" / "model" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text(
        "from megatron.mpu.parallel_state import ProcessGroup, get_tensor_model_parallel_group\n"
        "from megatron.mpu import parallel_state\n"
    )
    assert global_group_reads(tmp_path) == [
        "megatron/model/bad.py:1 imports get_tensor_model_parallel_group",
        "megatron/model/bad.py:2 imports parallel_state",
    ]


def _plant(tmp_path: Path, rel: str, text: str) -> list[str]:
    (tmp_path / "megatron").mkdir(exist_ok=True)
    target = tmp_path / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return layering_violations(tmp_path)


def test_the_checker_catches_upward_sideways_and_test_imports(tmp_path: Path) -> None:
    # A planted upward import (mpu importing training), in both spellings, is flagged.
    found = _plant(tmp_path, "megatron/mpu/bad.py", "from megatron import training\n")
    assert found == [
        "megatron/mpu/bad.py imports megatron.training (megatron.mpu must not: a higher row)"
    ]
    found = _plant(tmp_path, "megatron/mpu/bad.py", "import megatron.training.loop\n")
    assert found == [
        "megatron/mpu/bad.py imports megatron.training.loop (megatron.mpu must not: a higher row)"
    ]
    # Training importing the offline conversions (the old two-way edge) is upward too.
    found = _plant(tmp_path, "megatron/mpu/bad.py", "")
    found = _plant(
        tmp_path, "megatron/training/x.py", "from megatron.conversion.rewrite import f\n"
    )
    assert found == [
        "megatron/training/x.py imports megatron.conversion.rewrite "
        "(megatron.training must not: a higher row)"
    ]
    # Packages of one row do not import each other.
    _plant(tmp_path, "megatron/training/x.py", "")
    found = _plant(tmp_path, "megatron/data/x.py", "from megatron.model import GPTModel\n")
    assert found == [
        "megatron/data/x.py imports megatron.model (megatron.data must not: the same row)"
    ]
    # Test code in library code or in a tool; downward imports are fine.
    _plant(tmp_path, "megatron/data/x.py", "from megatron.config import DataConfig\n")
    found = _plant(
        tmp_path, "megatron/model/y.py", "from megatron.testing import run_distributed\n"
    )
    assert found == ["megatron/model/y.py imports megatron.testing (test code, tests/ only)"]
    _plant(tmp_path, "megatron/model/y.py", "")
    found = _plant(tmp_path, "tools/t.py", "import megatron.testing.spawn\n")
    assert found == ["tools/t.py imports megatron.testing.spawn (test code, tests/ only)"]


def test_files_stay_under_the_size_ceiling() -> None:
    too_big = []
    files = list((ROOT / "megatron").rglob("*.py")) + list((ROOT / "tools").rglob("*.py"))
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
