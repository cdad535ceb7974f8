"""What a run tells the user: the progress line, the metrics JSONL, and TensorBoard scalars (rank 0 only).

The progress line and the JSONL are interfaces (tests and ``tools/plot_metrics.py`` parse them); change them only
together with their parsers.

Progress line (every --log-interval iterations)::

     iteration       20/     100 | consumed samples:          160 | elapsed time per iteration (ms): 41.2 |
     learning rate: 1.000E-04 | lm loss: 6.912345E+00 | grad norm: 1.234 | loss scale: 1.0 |
     number of skipped iterations:   0 | tokens per second: 6213.6 | TFLOP/s per device: 0.01 | MFU: n/a |

(one line; wrapped here). Metrics JSONL (``--metrics-file``), one object per line:

    {"iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "loss_scale", "skipped_iter",
     "tokens_per_sec", "tflops_per_device", "mfu"}               per logged training iteration
    {"iteration", "valid_loss", "valid_ppl"}                     per evaluation
    {"iteration", "test_loss", "test_ppl"}                       the test-split evaluation at the end

``lm_loss`` is the loss of that iteration averaged over the whole global batch (every micro-batch and DP rank);
``grad_norm`` is null when clipping is off, ``mfu`` null when no peak is known; ``skipped_iter`` is 0 or 1.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

TRAIN_KEYS = (
    "iteration",
    "consumed_samples",
    "lm_loss",
    "lr",
    "grad_norm",
    "loss_scale",
    "skipped_iter",
    "tokens_per_sec",
    "tflops_per_device",
    "mfu",
)
EVAL_KEYS = ("iteration", "valid_loss", "valid_ppl")
TEST_KEYS = ("iteration", "test_loss", "test_ppl")


@dataclass(frozen=True)
class TrainRecord:
    """One logged training iteration (field names are the JSONL keys)."""

    iteration: int
    consumed_samples: int
    lm_loss: float
    lr: float
    grad_norm: float | None
    loss_scale: float
    skipped_iter: int
    tokens_per_sec: float
    tflops_per_device: float
    mfu: float | None


@dataclass(frozen=True)
class EvalRecord:
    """One evaluation."""

    iteration: int
    valid_loss: float
    valid_ppl: float


@dataclass(frozen=True)
class TestRecord:
    """The end-of-training evaluation on the test split."""

    iteration: int
    test_loss: float
    test_ppl: float


def format_test_line(rec: TestRecord) -> str:
    """Megatron's end-of-training line for the test data."""
    return (
        f" validation loss at the end of training for test data | lm loss value: {rec.test_loss:.6E} |"
        f" lm loss PPL: {rec.test_ppl:.6E} |"
    )


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(20) like Megatron; NaN for a NaN loss (``min(20, nan)`` would print exp(20))."""
    if math.isnan(loss):
        return math.nan
    return math.exp(min(20.0, loss))


def format_train_line(
    rec: TrainRecord, *, train_iters: int, elapsed_ms: float, skipped_total: int
) -> str:
    """The Megatron-style progress line for ``rec``."""
    gn = "n/a" if rec.grad_norm is None else f"{rec.grad_norm:.3f}"
    mfu = "n/a" if rec.mfu is None else f"{100.0 * rec.mfu:.1f}%"
    return (
        f" iteration {rec.iteration:8d}/{train_iters:8d} |"
        f" consumed samples: {rec.consumed_samples:12d} |"
        f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
        f" learning rate: {rec.lr:.3E} |"
        f" lm loss: {rec.lm_loss:.6E} |"
        f" grad norm: {gn} |"
        f" loss scale: {rec.loss_scale:.1f} |"
        f" number of skipped iterations: {skipped_total:3d} |"
        f" tokens per second: {rec.tokens_per_sec:.1f} |"
        f" TFLOP/s per device: {rec.tflops_per_device:.2f} |"
        f" MFU: {mfu} |"
    )


def format_eval_line(rec: EvalRecord) -> str:
    """Megatron's validation line."""
    return (
        f" validation loss at iteration {rec.iteration} | lm loss value: {rec.valid_loss:.6E} |"
        f" lm loss PPL: {rec.valid_ppl:.6E} |"
    )


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


def _truncate_after(path: Path, iteration: int) -> None:
    """Keep the records of ``path`` up to ``iteration`` (atomically rewritten); drop unparsable tail lines."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if isinstance(rec, dict) and int(rec.get("iteration", 0)) <= iteration:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
    os.replace(tmp, path)


class MetricsWriter:
    """JSONL + TensorBoard sink. Construct it on every rank; only ``enabled`` (rank 0) writes anything.

    Args:
        metrics_file: --metrics-file path (parent directories are created), or None.
        tensorboard_dir: --tensorboard-dir, or None.
        enabled: True on the writing rank.
        resume_from: the iteration a resumed run starts after: the existing metrics file is kept up to that
            iteration (records a crashed run wrote past its last checkpoint are dropped) and appended to.
            None or 0: a fresh run, the file is started anew.
    """

    def __init__(
        self,
        metrics_file: str | None,
        tensorboard_dir: str | None,
        *,
        enabled: bool,
        resume_from: int | None = None,
    ) -> None:
        self.enabled = enabled
        self._file: IO[str] | None = None
        self._tb: Any = None
        if not enabled:
            return
        if metrics_file:
            path = Path(metrics_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            if resume_from and path.is_file():
                _truncate_after(path, resume_from)
                self._file = path.open("a", encoding="utf-8")
            else:
                self._file = path.open("w", encoding="utf-8")
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=tensorboard_dir)

    def _write(self, obj: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps({k: _json_value(v) for k, v in obj.items()}) + "\n")
            self._file.flush()

    def train(self, rec: TrainRecord) -> None:
        """Record one logged training iteration."""
        if not self.enabled:
            return
        self._write(asdict(rec))
        if self._tb is not None:
            step = rec.iteration
            self._tb.add_scalar("lm-loss-training/lm loss", rec.lm_loss, step)
            self._tb.add_scalar(
                "lm-loss-training/lm loss vs samples", rec.lm_loss, rec.consumed_samples
            )
            self._tb.add_scalar("learning-rate/learning-rate", rec.lr, step)
            self._tb.add_scalar("loss-scale/loss-scale", rec.loss_scale, step)
            if rec.grad_norm is not None:
                self._tb.add_scalar("grad-norm/grad-norm", rec.grad_norm, step)
            self._tb.add_scalar("throughput/tokens_per_sec", rec.tokens_per_sec, step)
            self._tb.add_scalar("throughput/tflops_per_device", rec.tflops_per_device, step)
            if rec.mfu is not None:
                self._tb.add_scalar("throughput/mfu", rec.mfu, step)

    def evaluation(self, rec: EvalRecord) -> None:
        """Record one evaluation."""
        if not self.enabled:
            return
        self._write(asdict(rec))
        if self._tb is not None:
            self._tb.add_scalar(
                "lm-loss-validation/lm loss validation", rec.valid_loss, rec.iteration
            )
            self._tb.add_scalar(
                "lm-loss-validation/lm loss validation ppl", rec.valid_ppl, rec.iteration
            )

    def test(self, rec: TestRecord) -> None:
        """Record the test-split evaluation."""
        if not self.enabled:
            return
        self._write(asdict(rec))
        if self._tb is not None:
            self._tb.add_scalar("lm-loss-test/lm loss test", rec.test_loss, rec.iteration)
            self._tb.add_scalar("lm-loss-test/lm loss test ppl", rec.test_ppl, rec.iteration)

    def close(self) -> None:
        """Flush and close the file and the TensorBoard writer."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Parse a metrics JSONL into (training records, evaluation records); test-split records are skipped.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line is not a JSON object (names the line).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"metrics file {p}: no such file.")
    train: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{lineno}: not a JSON object ({e.msg}).") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{p}:{lineno}: not a JSON object.")
        if "valid_loss" in obj:
            evals.append(obj)
        elif "lm_loss" in obj:
            train.append(obj)
    return train, evals
