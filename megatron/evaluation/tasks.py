"""Finding lm-evaluation-harness tasks offline: the task manager for ``--include-path``, names checked up front,
and local data files named relative to their task's YAML.

A local task reads its data with ``dataset_path: json`` and ``dataset_kwargs: {data_files: ...}``. ``datasets``
resolves a relative ``data_files`` path against the process's working directory; Trident resolves it against the
directory of the YAML file that names it instead, so a task folder works from wherever the run starts (the task is
then handed to ``lm_eval`` as its full config with absolute paths). Absolute paths and ``hf://`` / URL paths are left
as they are (a URL needs the network, which an offline run does not have).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def task_manager(tasks: Sequence[str], include_path: str | None) -> Any:
    """The ``lm_eval`` task manager for ``include_path`` (its tasks only; None: the built-in tasks).

    Raises:
        FileNotFoundError: ``include_path`` is not a directory.
        ValueError: no tasks, or a task name the manager does not know (the message lists the known ones).
    """
    from lm_eval.tasks import TaskManager

    if include_path is not None and not os.path.isdir(include_path):
        raise FileNotFoundError(
            f"--include-path {include_path} is not a directory of task YAML files."
        )
    if not tasks:
        raise ValueError("--tasks needs at least one task name.")
    manager = TaskManager(include_path=include_path, include_defaults=include_path is None)
    missing = [t for t in tasks if t not in manager.all_tasks]
    if missing:
        known = sorted(manager.all_tasks)
        shown = ", ".join(known[:20]) + (f" ... ({len(known)} in all)" if len(known) > 20 else "")
        raise ValueError(
            f"--tasks: unknown task(s) {', '.join(missing)}; --include-path {include_path} has: {shown}."
        )
    return manager


def _resolved(files: Any, base: Path) -> Any:
    """``data_files`` (a path, a list, or a split -> paths mapping) with relative local paths made absolute."""
    if isinstance(files, dict):
        return {k: _resolved(v, base) for k, v in files.items()}
    if isinstance(files, list):
        return [_resolved(v, base) for v in files]
    if isinstance(files, str) and "://" not in files and not os.path.isabs(files):
        return str((base / files).resolve())
    return files


def task_specs(tasks: Sequence[str], manager: Any) -> list[str | dict[str, Any]]:
    """What to hand ``simple_evaluate``: each task's name, or its full config when its YAML names relative local
    ``data_files`` (resolved against the YAML's directory).

    Raises:
        FileNotFoundError: a resolved data file does not exist (naming the task, its YAML and the path).
    """
    # lm_eval==0.4.13's own YAML reader (include:, !function), so the config is what lm_eval would build
    from lm_eval.tasks._yaml_loader import load_yaml

    specs: list[str | dict[str, Any]] = []
    for name in tasks:
        entry = manager.task_index.get(name)
        cfg = getattr(entry, "cfg", None) or {}
        files = (cfg.get("dataset_kwargs") or {}).get("data_files")
        yaml_path = getattr(entry, "yaml_path", None)
        if files is None or yaml_path is None or "task" not in cfg:
            specs.append(name)
            continue
        base = Path(yaml_path).resolve().parent
        full = dict(load_yaml(Path(yaml_path), resolve_func=True))
        kwargs = dict(full.get("dataset_kwargs") or {})
        kwargs["data_files"] = _resolved(kwargs.get("data_files"), base)
        for path in _local_paths(kwargs["data_files"]):
            if not os.path.exists(path):
                raise FileNotFoundError(
                    f"task {name} ({yaml_path}): data file {path} does not exist; data_files paths are "
                    "relative to the YAML file's directory."
                )
        specs.append({**full, "dataset_kwargs": kwargs})
    return specs


def _local_paths(files: Any) -> list[str]:
    if isinstance(files, dict):
        return [p for v in files.values() for p in _local_paths(v)]
    if isinstance(files, list):
        return [p for v in files for p in _local_paths(v)]
    return [files] if isinstance(files, str) and "://" not in files and "*" not in files else []
