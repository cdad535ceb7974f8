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


PROCESS_WIDE_STATE: dict[tuple[str, str], str] = {
    (
        "megatron/mpu/parallel_state.py",
        "_STATE",
    ): "the groups of this process (the first process-wide object)",
    (
        "megatron/mpu/random.py",
        "_RNG_STATE_TRACKER",
    ): "the RNG tracker (the second): DeepSpeed's checkpointing "
    "and pipeline engine reach it through deepspeed.checkpointing, so it is one object per process",
    (
        "megatron/mpu/expert_parallel.py",
        "_SELF_GROUP",
    ): "a cache of this rank's one-rank group (creating a group is collective, so it is made once)",
    (
        "megatron/deepspeed_internals.py",
        "_checked",
    ): "the DeepSpeed version gate runs once per process",
    (
        "megatron/data/helpers.py",
        "_warned_missing",
    ): "the missing-extension warning is given once per process",
}
"""Every module variable of ``megatron/`` that code rebinds at run time (a ``global`` statement) or that holds the
RNG tracker, with the reason. A new one is a design decision: add it here with its reason, or pass the state."""


def process_wide_state(root: Path) -> set[tuple[str, str]]:
    found = set()
    for path in sorted((root / "megatron").rglob("*.py")):
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found.update((rel, name) for name in node.names)
        for node in tree.body:  # module-level trackers: the object itself is the state
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                callee = ast.unparse(node.value.func)
                if callee.endswith("RNGStatesTracker"):
                    found.update((rel, t.id) for t in node.targets if isinstance(t, ast.Name))
    return found


def test_process_wide_state_is_the_listed_set(tmp_path: Path) -> None:
    assert process_wide_state(ROOT) == set(PROCESS_WIDE_STATE)
    bad = tmp_path / "megatron" / "training" / "g.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("_X = None\ndef f():\n    global _X\n    _X = 1\n")
    assert process_wide_state(tmp_path) == {("megatron/training/g.py", "_X")}


def test_the_rng_tracker_is_one_object_shared_with_deepspeed() -> None:
    import deepspeed

    from megatron.deepspeed_internals import share_rng_tracker
    from megatron.mpu import random as mpu_random

    ours = mpu_random.get_cuda_rng_tracker()
    assert ours is mpu_random.get_cuda_rng_tracker()
    saved = deepspeed.checkpointing.get_cuda_rng_tracker()
    try:
        share_rng_tracker(ours)
        assert deepspeed.checkpointing.get_cuda_rng_tracker() is ours
    finally:
        deepspeed.checkpointing._CUDA_RNG_STATE_TRACKER = saved


GLOBAL_READS: dict[tuple[str, str], str] = {
    (
        "megatron/diagnostics/comm_bench.py",
        "model_parallel_is_initialized",
    ): "comm_bench joins the groups its "
    "caller built, or builds (and forgets) its own: it asks whether any exist",
    (
        "megatron/diagnostics/comm_bench.py",
        "get_parallel_state",
    ): "the state comm_bench found or just built",
    (
        "megatron/checkpointing/rng.py",
        "get_cuda_rng_tracker",
    ): "saves and restores the RNG tracker (the second "
    "process-wide object, megatron/mpu/random.py)",
    (
        "megatron/model/attention.py",
        "get_cuda_rng_tracker",
    ): "dropout on sharded heads forks the tracker stream",
    (
        "megatron/model/language_model.py",
        "get_cuda_rng_tracker",
    ): "embedding dropout under SP forks the tracker",
    (
        "megatron/model/transformer.py",
        "get_cuda_rng_tracker",
    ): "activation checkpointing replays the tracker",
    (
        "megatron/training/activation_checkpointing.py",
        "get_cuda_rng_tracker",
    ): "hands the tracker to DeepSpeed",
}
"""Every place outside ``megatron/mpu`` that reads the process-wide state through a module getter, with the reason.
Everything else is given the run's ``ParallelState`` (or its groups) or a ``ParallelContext``."""


def _global_getters(root: Path) -> set[str]:
    mpu = root / "megatron" / "mpu"
    tree = ast.parse((mpu / "parallel_state.py").read_text(encoding="utf-8"))
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    names |= {
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    getters = {
        n for n in names if n.startswith(("get_", "is_")) or n == "model_parallel_is_initialized"
    }
    return getters | {"get_cuda_rng_tracker"}


def global_reads(root: Path) -> set[tuple[str, str]]:
    """(file, getter) for every call of a ``parallel_state`` getter or of the RNG tracker getter outside
    ``megatron/mpu``, spelled ``mpu.get_x()``, ``parallel_state.get_x()`` or as an imported ``get_x()`` (calls on a
    passed ``ParallelState`` object are not reads of the global)."""
    getters = _global_getters(root)
    found = set()
    for path in sorted((root / "megatron").rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel.startswith("megatron/mpu/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                if f.value.id in ("mpu", "parallel_state", "mpu_random") and f.attr in getters:
                    found.add((rel, f.attr))
            elif isinstance(f, ast.Name) and f.id in getters:
                found.add((rel, f.id))
    return found


def test_global_getters_only_in_the_listed_places(tmp_path: Path) -> None:
    assert global_reads(ROOT) == set(GLOBAL_READS)
    planted = tmp_path / "megatron" / "training" / "s.py"
    planted.parent.mkdir(parents=True)
    (tmp_path / "megatron" / "mpu").mkdir()
    (tmp_path / "megatron" / "mpu" / "parallel_state.py").write_text(
        (ROOT / "megatron" / "mpu" / "parallel_state.py").read_text(encoding="utf-8")
    )
    planted.write_text(
        "from megatron import mpu\nfrom megatron.mpu.parallel_state import get_data_parallel_group\n"
        "def f(state):\n    state.get_data_parallel_group()\n    get_data_parallel_group()\n"
        "    return mpu.get_pipeline_model_parallel_rank()\n"
    )
    assert global_reads(tmp_path) == {
        ("megatron/training/s.py", "get_data_parallel_group"),
        ("megatron/training/s.py", "get_pipeline_model_parallel_rank"),
    }
