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
    {"iteration", "stragglers": [{"rank", "host", "slowdown",    a log interval that named stragglers
                                  "busy_ms", "peers_median_ms"}]}  (--log-straggler, ``straggler.py``)
    {"iteration", "eval_harness": {task: {metric: value}}}     an --eval-harness-tasks evaluation

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

from megatron.config import LoggingConfig

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
    curriculum_seqlen: int | None = None
    """The sequence length of the DeepSpeed JSON's curriculum this iteration (absent without one)."""
    moe_loss: float | None = None
    """MoE models: the term added to the LM loss (--moe-loss-coeff x summed aux losses; absent for dense)."""
    expert_load: dict[str, list] | None = None
    """MoE models: ``{"layers", "tokens_per_expert", "dropped_tokens"}`` over the global batch (absent for dense;
    ``moe_log.ExpertLoad``)."""


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
    rec: TrainRecord,
    *,
    train_iters: int,
    elapsed_ms: float,
    skipped_total: int,
    num_zeros: float | None = None,
    params_norm: float | None = None,
) -> str:
    """The Megatron-style progress line for ``rec`` (``num zeros``/``params norm`` after the grad norm when given)."""
    gn = "n/a" if rec.grad_norm is None else f"{rec.grad_norm:.3f}"
    mfu = "n/a" if rec.mfu is None else f"{100.0 * rec.mfu:.1f}%"
    extra = "" if num_zeros is None else f" num zeros: {num_zeros:.1f} |"
    extra += "" if params_norm is None else f" params norm: {params_norm:.3f} |"
    if rec.curriculum_seqlen is not None:
        extra += f" curriculum seqlen: {rec.curriculum_seqlen:5d} |"
    return extra.join(
        (
            f" iteration {rec.iteration:8d}/{train_iters:8d} |"
            f" consumed samples: {rec.consumed_samples:12d} |"
            f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
            f" learning rate: {rec.lr:.3E} |"
            f" lm loss: {rec.lm_loss:.6E} |"
            + ("" if rec.moe_loss is None else f" moe loss: {rec.moe_loss:.6E} |")
            + f" grad norm: {gn} |",
            f" loss scale: {rec.loss_scale:.1f} |"
            f" number of skipped iterations: {skipped_total:3d} |"
            f" tokens per second: {rec.tokens_per_sec:.1f} |"
            f" TFLOP/s per device: {rec.tflops_per_device:.2f} |"
            f" MFU: {mfu} |",
        )
    )


def format_eval_line(rec: EvalRecord) -> str:
    """Megatron's validation line."""
    return (
        f" validation loss at iteration {rec.iteration} | lm loss value: {rec.valid_loss:.6E} |"
        f" lm loss PPL: {rec.valid_ppl:.6E} |"
    )


def format_harness_line(iteration: int, scores: dict[str, dict[str, float]], seconds: float) -> str:
    """The console line of an --eval-harness-tasks evaluation: every task's metrics, and its time."""
    parts = [
        f"{task} {metric}: {value:.6g}"
        for task, metrics in scores.items()
        for metric, value in metrics.items()
    ]
    return f" eval harness at iteration {iteration} | " + " | ".join(
        [*parts, f"time (s): {seconds:.1f} |"]
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
    """JSONL + TensorBoard (+ Weights & Biases) sink. Construct it on every rank; only ``enabled`` (rank 0) writes.

    Args:
        metrics_file: --metrics-file path (parent directories are created), or None.
        tensorboard_dir: --tensorboard-dir, or None.
        enabled: True on the writing rank.
        resume_from: the iteration a resumed run starts after: the existing metrics file is kept up to that
            iteration (records a crashed run wrote past its last checkpoint are dropped) and appended to.
            None or 0: a fresh run, the file is started anew.
        queue_size: --tensorboard-queue-size (events buffered before TensorBoard writes to disk).
        wandb: the W&B run (``wandb_writer.WandbWriter``) or None; it gets every scalar TensorBoard gets.
        options: the --log-*-to-tensorboard switches (default: Trident's defaults).
    """

    def __init__(
        self,
        metrics_file: str | None,
        tensorboard_dir: str | None,
        *,
        enabled: bool,
        resume_from: int | None = None,
        queue_size: int = 1000,
        wandb: Any = None,
        options: LoggingConfig | None = None,
    ) -> None:
        self.enabled = enabled
        self.options = options if options is not None else LoggingConfig()
        self._file: IO[str] | None = None
        self._tb: Any = None
        self._wandb: Any = wandb if enabled else None
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

            self._tb = SummaryWriter(log_dir=tensorboard_dir, max_queue=queue_size)

    @property
    def has_sink(self) -> bool:
        """TensorBoard or W&B is open on this rank."""
        return self._tb is not None or self._wandb is not None

    def scalar(self, tag: str, value: float, step: int) -> None:
        """``tag = value`` at iteration ``step`` to TensorBoard and W&B (no-op off the writing rank)."""
        if self._tb is not None:
            self._tb.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.scalar(tag, value, step)

    def scalar_vs(self, tag: str, value: float, x: int) -> None:
        """A ``... vs samples`` / ``... vs tokens`` curve: TensorBoard only (W&B steps are iterations)."""
        if self._tb is not None:
            self._tb.add_scalar(tag, value, x)

    def train_scalars(
        self, rec: TrainRecord, *, consumed_tokens: int, batch_size: int, world_size: int
    ) -> None:
        """Megatron's per-iteration TensorBoard scalars (every --tensorboard-log-interval iterations)."""
        if not self.enabled or not self.has_sink:
            return
        o, it, samples = self.options, rec.iteration, rec.consumed_samples
        curves: list[tuple[str, float]] = [("lm-loss-training/lm loss", rec.lm_loss)]
        if o.log_learning_rate_to_tensorboard:
            curves.append(("learning-rate/learning-rate", rec.lr))
        if o.log_loss_scale_to_tensorboard:
            curves.append(("loss-scale/loss-scale", rec.loss_scale))
        if rec.grad_norm is not None:
            curves.append(("grad-norm/grad-norm", rec.grad_norm))
        if o.log_batch_size_to_tensorboard:
            curves.append(("batch-size/batch-size", float(batch_size)))
        if o.log_world_size_to_tensorboard:
            curves.append(("world-size/world-size", float(world_size)))
        for tag, value in curves:
            self.scalar(tag, value, it)
            self.scalar_vs(f"{tag} vs samples", value, samples)
            self.scalar_vs(f"{tag} vs tokens", value, consumed_tokens)

    def _write(self, obj: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps({k: _json_value(v) for k, v in obj.items()}) + "\n")
            self._file.flush()

    def train(self, rec: TrainRecord) -> None:
        """Record one logged training iteration (JSONL, and the throughput scalars of the progress line)."""
        if not self.enabled:
            return
        record = asdict(rec)
        for key in ("curriculum_seqlen", "moe_loss", "expert_load"):
            if record[key] is None:
                del record[key]
        self._write(record)
        step = rec.iteration
        self._expert_load_scalars(rec)
        if rec.curriculum_seqlen is not None:
            self.scalar("seqlen/curriculum_seqlen", rec.curriculum_seqlen, step)
        self.scalar("throughput/tokens_per_sec", rec.tokens_per_sec, step)
        self.scalar("throughput/tflops_per_device", rec.tflops_per_device, step)
        if rec.mfu is not None:
            self.scalar("throughput/mfu", rec.mfu, step)

    def _expert_load_scalars(self, rec: TrainRecord) -> None:
        """An MoE model's MoE loss and per-layer load: ``moe-loss/moe loss``, ``moe-load/layer {i} expert {e}``
        (tokens routed), ``moe-dropped/layer {i}`` (tokens dropped)."""
        step = rec.iteration
        if rec.moe_loss is not None:
            self.scalar("moe-loss/moe loss", rec.moe_loss, step)
        load = rec.expert_load or {}
        for layer, counts, dropped in zip(
            load.get("layers", []),
            load.get("tokens_per_expert", []),
            load.get("dropped_tokens", []),
            strict=True,
        ):
            for e, n in enumerate(counts):
                self.scalar(f"moe-load/layer {layer} expert {e}", float(n), step)
            self.scalar(f"moe-dropped/layer {layer}", float(dropped), step)

    def stragglers(self, iteration: int, found: list[dict[str, Any]]) -> None:
        """Record the stragglers a log interval named (``straggler.Straggler`` as dicts)."""
        if self.enabled:
            self._write({"iteration": iteration, "stragglers": found})

    def evaluation(self, rec: EvalRecord) -> None:
        """Record one evaluation (the perplexity in TensorBoard with --log-validation-ppl-to-tensorboard)."""
        if not self.enabled:
            return
        self._write(asdict(rec))
        self.scalar("lm-loss-validation/lm loss validation", rec.valid_loss, rec.iteration)
        if self.options.log_validation_ppl_to_tensorboard:
            self.scalar("lm-loss-validation/lm loss validation ppl", rec.valid_ppl, rec.iteration)

    def harness(self, iteration: int, scores: dict[str, dict[str, float]]) -> None:
        """Record an --eval-harness-tasks evaluation: one JSONL record, and ``eval-harness/<task>/<metric>`` in
        TensorBoard and W&B."""
        if not self.enabled:
            return
        clean = {
            task: {metric: _json_value(float(v)) for metric, v in metrics.items()}
            for task, metrics in scores.items()
        }
        self._write({"iteration": iteration, "eval_harness": clean})
        for task, metrics in scores.items():
            for metric, value in metrics.items():
                self.scalar(f"eval-harness/{task}/{metric}", float(value), iteration)

    def test(self, rec: TestRecord) -> None:
        """Record the test-split evaluation."""
        if not self.enabled:
            return
        self._write(asdict(rec))
        self.scalar("lm-loss-test/lm loss test", rec.test_loss, rec.iteration)
        if self.options.log_validation_ppl_to_tensorboard:
            self.scalar("lm-loss-test/lm loss test ppl", rec.test_ppl, rec.iteration)

    def close(self) -> None:
        """Flush and close the file and the TensorBoard writer."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


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
