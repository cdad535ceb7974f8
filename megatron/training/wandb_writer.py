"""Weights & Biases logging (optional dependency: ``pip install wandb``).

On with ``--wandb-project`` or ``--wandb-exp-name`` (Megatron-DeepSpeed's rule). The rank that writes TensorBoard
(global rank 0) opens one run and logs every scalar TensorBoard gets, under the same tags, plus the throughput
scalars of each progress line. The run is OFFLINE unless ``WANDB_MODE`` is set (training nodes often have no
network; ``wandb sync <dir>/wandb/offline-run-*`` uploads it later). Its files go to ``--wandb-save-dir``, else
``<--save>/wandb``, else ``./wandb``.

``validate()`` refuses the flags at start-up when the package is missing, so no rank gets far without it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict
from typing import Any

HAVE_WANDB = importlib.util.find_spec("wandb") is not None


def wandb_requested(project: str | None, exp_name: str | None) -> bool:
    """Megatron-DeepSpeed logs to W&B when a project or a run name is given (empty strings count as not given)."""
    return bool(project) or bool(exp_name)


def wandb_dir(save_dir: str | None, checkpoint_save: str | None) -> str:
    """--wandb-save-dir, else <--save>/wandb, else ./wandb."""
    if save_dir:
        return save_dir
    return os.path.join(checkpoint_save, "wandb") if checkpoint_save else "wandb"


class WandbWriter:
    """One W&B run; :meth:`scalar` buffers a value per step, committed when a later step arrives or on close.

    Args:
        project: --wandb-project (None: W&B's default project).
        name: --wandb-exp-name (None: W&B picks one).
        save_dir: the directory of the run files (created).
        config: the run's flags, stored with the run.
    """

    def __init__(
        self, *, project: str | None, name: str | None, save_dir: str, config: dict[str, Any]
    ) -> None:
        if not HAVE_WANDB:
            raise RuntimeError(
                "--wandb-project/--wandb-exp-name need the wandb package: pip install wandb"
            )
        import wandb

        os.makedirs(save_dir, exist_ok=True)
        self._run = wandb.init(
            project=project or None,
            name=name or None,
            dir=save_dir,
            config=config,
            mode=os.environ.get("WANDB_MODE") or "offline",  # type: ignore[arg-type]
        )
        self.run_dir: str = self._run.dir
        """The run's files directory (``.../wandb/offline-run-<time>-<id>/files``)."""

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Record ``tag = value`` at ``step`` (steps must not go backwards, as W&B requires)."""
        self._run.log({tag: value}, step=step, commit=False)

    def close(self) -> None:
        """Commit the last step and finish the run (writes its files)."""
        self._run.log({}, commit=True)
        self._run.finish()


def flat_config(cfg: Any) -> dict[str, Any]:
    """The run's config as ``{"section.field": value}`` for the W&B run page."""
    out: dict[str, Any] = {}
    for section, values in asdict(cfg).items():
        for key, value in values.items():
            out[f"{section}.{key}"] = list(value) if isinstance(value, tuple) else value
    return out
