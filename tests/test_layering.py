"""The import contracts of ``megatron/``: one table of allowed edges (a tree, not a line), the edges that must never
exist even through other packages, the packages that must stay independent, and the listed exceptions.

Three kinds of contract, with the power of import-linter's ``layers`` / ``forbidden`` / ``independence``:

- :data:`ALLOWED`: every package's direct imports, edge by edge. An import that is not in the table fails.
- :data:`NEVER`: ``A`` never imports ``B``, directly or through any chain of other packages (checked on the real
  import graph, so a new allowed edge cannot open an indirect path either).
- :data:`INDEPENDENT`: no package of a group imports another of the same group, directly or indirectly.

An edge a single module needs against the table is an :data:`EXCEPTIONS` row with its reason (never a package-wide
allowance). Imports inside functions count like top-level ones. ``docs/architecture.md`` shows the table: its block
between the ``contracts`` markers is :func:`render` of these tables (the test below compares them). Each contract
kind is shown to fail on a planted violation.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_BASE = ("config", "log")
ALLOWED: dict[str, tuple[str, ...]] = {
    "config": (),
    "log": (),
    "deepspeed_internals": _BASE,
    "mpu": _BASE,
    "layout": _BASE,
    "tokenizer": _BASE,
    "fused_kernels": _BASE,
    "launch": _BASE,
    "model": (*_BASE, "mpu", "layout", "fused_kernels", "deepspeed_internals"),
    "data": (*_BASE, "tokenizer", "mpu"),
    "checkpointing": (
        *_BASE,
        "model",
        "data",
        "mpu",
        "layout",
        "tokenizer",
        "launch",
        "deepspeed_internals",
    ),
    "planning": (*_BASE, "layout"),
    "diagnostics": (*_BASE, "launch", "mpu"),
    "training": (
        *_BASE,
        "planning",
        "diagnostics",
        "checkpointing",
        "model",
        "data",
        "mpu",
        "layout",
        "tokenizer",
        "fused_kernels",
        "launch",
        "deepspeed_internals",
    ),
    "conversion": (
        *_BASE,
        "checkpointing",
        "model",
        "data",
        "mpu",
        "layout",
        "tokenizer",
        "launch",
        "deepspeed_internals",
    ),
    "text_generation": (
        *_BASE,
        "checkpointing",
        "model",
        "mpu",
        "layout",
        "tokenizer",
        "fused_kernels",
        "launch",
        "deepspeed_internals",
    ),
    "evaluation": (*_BASE, "text_generation", "tokenizer"),
    "testing": (*_BASE, "launch", "mpu"),
}
"""Package (or top-level module) of ``megatron/`` -> the packages it may import directly."""

ROLES: dict[str, str] = {
    "config": "frozen dataclasses -> flags, validate(), rules, RunPlan (derived values): the bottom",
    "log": "logging helpers",
    "deepspeed_internals": "every use of DeepSpeed internals, behind one version gate",
    "mpu": "parallel_state and the RNG tracker (the two globals), ParallelContext, mappings, TP layers",
    "layout": "pure arithmetic: parameter names, TP split rule, QKV, vocab padding, PP stages",
    "tokenizer": "tokenizers, tokenizer training, the checkpoint's tokenizer record",
    "fused_kernels": "fused kernels with their PyTorch references; the loader and JIT build",
    "launch": "spawning local ranks, rendezvous environment, restart rounds and the supervisor, device choice, "
    "CPU allocator, exit codes",
    "model": "GPTModel / GPTModelPipe from a ModelConfig + an explicit ParallelContext",
    "data": ".bin/.idx, GPT sample index, blending, samplers, preprocessing",
    "checkpointing": "runtime save/load protocol, pointers, start-up rules, meta schema, weight readers",
    "planning": "memory plan, MoE plan, FLOPs, collective bytes: from config and run plan alone",
    "diagnostics": "cluster checks, sysfs reading, comm bench, hang watchdog",
    "training": "preflight, trainer, step, loop, optimizer, LR, DeepSpeed config, logging, metrics",
    "conversion": "offline: HF families, Megatron-DeepSpeed import, universal, reshard, verification",
    "text_generation": "generation, the KV-cache engine and the REST server over a checkpoint's model",
    "evaluation": "lm-evaluation-harness over the generation engine: the lm_eval model, the task runner",
    "testing": "test utilities (spawn, mpu oracle): tests/ and tools/mpu_selfcheck.py only",
}

NEVER: tuple[tuple[str, str, str], ...] = (
    ("text_generation", "training", "inference knows no training loop"),
    ("launch", "training", "conversion, generation and tests start ranks without the loop"),
    ("planning", "training", "a plan is arithmetic on the config and run plan"),
    ("diagnostics", "training", "cluster checks run before any training code"),
    ("layout", "model", "layout arithmetic is shared by converters that build no model"),
    ("model", "checkpointing", "a model is built from a config and a context, not from files"),
    ("config", "*", "config is the bottom: it imports no other megatron package"),
    ("*", "testing", "test code is imported by tests/ (and tools/mpu_selfcheck.py) only"),
)
"""(A, B, why): A never imports B, directly or through others. ``*`` is every library package."""

INDEPENDENT: tuple[tuple[str, ...], ...] = (
    ("mpu", "layout", "tokenizer", "fused_kernels", "launch", "deepspeed_internals"),
    ("model", "data"),
    ("planning", "diagnostics"),
    ("training", "text_generation"),
    ("training", "evaluation"),
)
"""Groups whose packages never import one another, directly or indirectly."""

EXCEPTIONS: dict[tuple[str, str], str] = {
    (
        "megatron.conversion.rewrite",
        "training",
    ): "writes a checkpoint at a new layout through a real DeepSpeed engine, built as a run builds it "
    "(initialize, ds_config, lr_scheduler, model_setup, state)",
}
"""(module, package it imports against the table) -> why."""

TEST_DRIVERS = ("tools/mpu_selfcheck.py",)
"""Entry points allowed to import ``megatron.testing`` (the command line of its mpu oracle)."""

ENTRY_POINTS = ("tools", "benchmarks", "pretrain_gpt.py")


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth; ``from megatron import mpu`` counts as ``megatron.mpu``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "megatron":
                names.update(f"megatron.{alias.name}" for alias in node.names)
            else:
                names.add(node.module)
    return names


def package_of(module: str) -> str | None:
    """``megatron.training.loop`` -> ``training``; None outside ``megatron``."""
    parts = module.split(".")
    return parts[1] if parts[0] == "megatron" and len(parts) > 1 else None


def module_edges(root: Path) -> list[tuple[str, str, str]]:
    """(importing module, its package, imported package) for every cross-package import in ``megatron/``."""
    out = []
    for path in sorted((root / "megatron").rglob("*.py")):
        mod = module_name(path, root)
        mine = package_of(mod)
        if mine is None:
            continue  # megatron/__init__.py
        for name in sorted(imports(path)):
            theirs = package_of(name)
            if theirs is not None and theirs != mine:
                out.append((mod, mine, theirs))
    return out


def package_graph(edges: Iterable[tuple[str, str, str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for _, mine, theirs in edges:
        graph.setdefault(mine, set()).add(theirs)
    return graph


def reachable(graph: Mapping[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every package ``start`` imports through any chain -> one such chain (``[start, ..., it]``)."""
    paths: dict[str, list[str]] = {}
    todo = [[start]]
    while todo:
        chain = todo.pop(0)
        for nxt in sorted(graph.get(chain[-1], ())):
            if nxt not in paths and nxt != start:
                paths[nxt] = [*chain, nxt]
                todo.append(paths[nxt])
    return paths


def table_violations(edges: Iterable[tuple[str, str, str]]) -> list[str]:
    """Direct imports that are neither in :data:`ALLOWED` nor an :data:`EXCEPTIONS` row."""
    out = []
    for mod, mine, theirs in edges:
        if mine not in ALLOWED:
            out.append(f"{mod}: package megatron.{mine} has no row in ALLOWED")
        elif theirs not in ALLOWED[mine] and (mod, theirs) not in EXCEPTIONS:
            out.append(f"{mod} imports megatron.{theirs} (not an allowed edge of megatron.{mine})")
    return sorted(set(out))


def _never_pairs(packages: Iterable[str]) -> list[tuple[str, str, str]]:
    pkgs = sorted(packages)
    out = []
    for a, b, why in NEVER:
        for src in pkgs if a == "*" else [a]:
            for dst in pkgs if b == "*" else [b]:
                if src != dst and src != "testing":
                    out.append((src, dst, why))
    return out


def never_violations(graph: Mapping[str, set[str]]) -> list[str]:
    """:data:`NEVER` and :data:`INDEPENDENT` contracts broken on ``graph``, with the chain that breaks each."""
    out = []
    packages = set(ALLOWED) | set(graph)
    for src, dst, why in _never_pairs(packages):
        chain = reachable(graph, src).get(dst)
        if chain:
            out.append(
                f"megatron.{src} must never import megatron.{dst} ({why}): {' -> '.join(chain)}"
            )
    for group in INDEPENDENT:
        for src in group:
            for dst, chain in reachable(graph, src).items():
                if dst in group:
                    out.append(f"{src} and {dst} must be independent: {' -> '.join(chain)}")
    return out


def entry_point_violations(root: Path) -> list[str]:
    """Tools, benchmarks and ``pretrain_gpt.py``: no test code (bar the listed drivers), no private names."""
    out = []
    files: list[Path] = []
    for name in ENTRY_POINTS:
        p = root / name
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p] if p.exists() else []
    for path in files:
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(
                "megatron"
            ):
                continue
            private = [a.name for a in node.names if a.name.startswith("_")]
            if private:
                out.append(
                    f"{rel}:{node.lineno} imports private {', '.join(private)} from {node.module}"
                )
        if rel not in TEST_DRIVERS:
            out += [
                f"{rel} imports {n} (test code, tests/ only)"
                for n in sorted(imports(path))
                if package_of(n) == "testing"
            ]
    return out


def all_violations(root: Path) -> list[str]:
    edges = module_edges(root)
    return table_violations(edges) + never_violations(package_graph(edges))


def levels() -> dict[str, int]:
    """Each package's height in :data:`ALLOWED`: 0 imports nothing, else 1 + the highest package it may import."""
    out: dict[str, int] = {}

    def height(pkg: str) -> int:
        if pkg not in out:
            out[pkg] = 1 + max((height(dep) for dep in ALLOWED[pkg]), default=-1)
        return out[pkg]

    for pkg in ALLOWED:
        height(pkg)
    return out


def render() -> str:
    """The contracts as ``docs/architecture.md`` shows them (between its ``contracts`` markers)."""
    width = max(map(len, ALLOWED)) + len("megatron/") + 3
    height = levels()
    lines = ["```", "level  packages (a package imports only along its edges below, never upward)"]
    for level in sorted(set(height.values()), reverse=True):
        lines.append(f"{level:>5}  " + "  ".join(p for p in ALLOWED if height[p] == level))
    lines += ["```", "", "```", f"{'package':<{width}}may import (megatron/...)"]
    for pkg, allowed in ALLOWED.items():
        lines.append(f"{'megatron/' + pkg:<{width}}{', '.join(allowed) or '-'}")
        lines.append(f"{'':<{width}}  {ROLES[pkg]}")
    lines += ["```", "", "Never, directly or through other packages:", ""]
    lines += [f"- `{a}` never imports `{b}`: {why}." for a, b, why in NEVER]
    lines += ["", "Independent (none imports another of its group):", ""]
    lines += [f"- {', '.join(f'`{p}`' for p in group)}" for group in INDEPENDENT]
    lines += ["", "Exceptions (one module each, with the reason):", ""]
    lines += [f"- `{mod}` imports `{pkg}`: {why}." for (mod, pkg), why in EXCEPTIONS.items()]
    return "\n".join(lines)


BEGIN, END = (
    "<!-- contracts:begin (generated: tests/test_layering.py render()) -->",
    "<!-- contracts:end -->",
)


# ---------------------------------------------------------------------------------------------------- the tests


def test_the_library_keeps_every_contract() -> None:
    found = all_violations(ROOT)
    assert not found, "import contract violations:\n" + "\n".join(found)


def test_tools_import_no_test_code_and_no_private_names() -> None:
    found = entry_point_violations(ROOT)
    assert not found, "\n".join(found)


def test_every_library_package_has_a_row_and_the_table_is_consistent() -> None:
    packages = {p.name for p in (ROOT / "megatron").iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in (ROOT / "megatron").glob("*.py") if p.stem != "__init__"}
    assert packages | modules == set(ALLOWED) == set(ROLES)
    # The table itself breaks no NEVER/INDEPENDENT contract: no allowed chain of edges opens a forbidden path.
    table = {pkg: set(allowed) for pkg, allowed in ALLOWED.items()}
    assert never_violations(table) == []
    # Every exception is still needed (an unused one is removed, not kept "just in case").
    used = {(mod, theirs) for mod, _, theirs in module_edges(ROOT)}
    assert set(EXCEPTIONS) <= used, f"unused exceptions: {set(EXCEPTIONS) - used}"


def test_the_architecture_page_shows_the_table() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert BEGIN in page and END in page, (
        f"docs/architecture.md lacks the markers {BEGIN} ... {END}"
    )
    shown = page.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert shown == render(), "docs/architecture.md's contracts are stale; paste:\n" + render()


def _plant(tmp_path: Path, rel: str, text: str) -> list[str]:
    target = tmp_path / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    (target.parent / "__init__.py").touch()
    target.write_text(text)
    return all_violations(tmp_path)


def test_each_contract_fails_on_a_planted_violation(tmp_path: Path) -> None:
    # generation -> training: outside the table, and a NEVER contract.
    found = _plant(
        tmp_path, "megatron/text_generation/x.py", "from megatron.training import loop\n"
    )
    assert (
        "megatron.text_generation.x imports megatron.training (not an allowed edge of "
        "megatron.text_generation)" in found
    )
    assert any(
        f.startswith("megatron.text_generation must never import megatron.training") for f in found
    )
    # launch -> training, spelled `import megatron.training.x` inside a function.
    found = _plant(
        tmp_path, "megatron/launch/y.py", "def f():\n    import megatron.training.step\n"
    )
    assert any("megatron.launch must never import megatron.training" in f for f in found)
    # model -> checkpointing.
    found = _plant(tmp_path, "megatron/model/z.py", "from megatron.checkpointing import engine\n")
    assert any("megatron.model must never import megatron.checkpointing" in f for f in found)
    # A library module importing megatron.testing.
    found = _plant(tmp_path, "megatron/data/t.py", "from megatron.testing import run_distributed\n")
    assert any("megatron.data must never import megatron.testing" in f for f in found)
    # An indirect path: each edge allowed by a (planted) table row would still be caught by NEVER.
    for rel in ("text_generation/x.py", "launch/y.py", "model/z.py", "data/t.py"):
        (tmp_path / "megatron" / rel).write_text("")
    graph = {"text_generation": {"checkpointing"}, "checkpointing": {"training"}}
    assert never_violations(graph)[0] == (
        "megatron.text_generation must never import megatron.training (inference knows no training loop): "
        "text_generation -> checkpointing -> training"
    )
    # Independence: planning and diagnostics.
    found = _plant(
        tmp_path, "megatron/planning/p.py", "from megatron.diagnostics import watchdog\n"
    )
    assert "planning and diagnostics must be independent: planning -> diagnostics" in found
    # An exception covers its module only.
    found = _plant(
        tmp_path, "megatron/conversion/other.py", "from megatron.training import state\n"
    )
    assert (
        "megatron.conversion.other imports megatron.training (not an allowed edge of "
        "megatron.conversion)" in found
    )
    assert not [
        f for f in _plant(tmp_path, "megatron/conversion/other.py", "") if "conversion" in f
    ]


def test_tools_contract_fails_on_planted_violations(tmp_path: Path) -> None:
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "t.py").write_text(
        "import megatron.testing.spawn\nfrom megatron.training.pretrain import _build_trainer\n"
    )
    assert entry_point_violations(tmp_path) == [
        "tools/t.py:2 imports private _build_trainer from megatron.training.pretrain",
        "tools/t.py imports megatron.testing.spawn (test code, tests/ only)",
    ]
