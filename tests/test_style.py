"""House-style checks that CI enforces: the model takes its groups explicitly and the file-size ceiling (STYLE.md
sections 3 and 5). The import contracts are ``tests/test_layering.py``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MAX_CODE_LINES = 600
"""STYLE.md section 5: the ceiling of a library file (aim for 400)."""


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
