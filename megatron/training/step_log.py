"""What the loop logs besides the progress line: Megatron-DeepSpeed's optional statistics, timers and memory.

Called on EVERY rank after every iteration (the statistics are collectives, so all ranks compute them at the same
iterations, decided by the flags alone); only the writing rank (global rank 0) writes.

    every --tensorboard-log-interval   loss, LR, loss scale, grad norm (+ "vs samples"/"vs tokens"), and with
                                       their flags: batch size, world size, params norm, num zeros, memory,
                                       optimizer states, timers (max over ranks, running mean of the interval)
    every --log-interval               params norm / num zeros in the progress line, the timer block in the console,
                                       iteration-time to TensorBoard (--log-timers-to-tensorboard), stragglers
                                       named (--log-straggler, ``straggler.py``)

Definitions (Megatron's where it has one):

* params norm: L2 norm of the model parameters, each counted once (TP-replicated ones on TP rank 0 only, the tied
  embedding on the first pipeline stage only), summed over the model-parallel group.
* num zeros: zero entries of the gradients the optimizer steps on (after reduction and clipping), counted by a
  pre-step hook on the torch optimizer, so it sees fp32 master gradients under bf16/fp16 and the flat partitions
  under ZeRO (their alignment padding subtracted), summed over the ranks that hold distinct parts. Megatron-DeepSpeed
  reports nothing on its DeepSpeed path; TP-replicated parameters count once per TP rank here.
* optimizer states (Adam): L2 and L1 norms and abs-max of ``exp_avg_sq``, ``sqrt(exp_avg_sq)``, ``exp_avg`` and the
  weights the optimizer updates, summed (max) over the model-parallel group, and over data parallel under ZeRO, as
  Megatron-DeepSpeed does.
* memory: CUDA allocator stats (reserved, allocated bytes and allocation count); on CPU the process RSS as
  ``mem-allocated-bytes``.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from megatron.config import LoggingConfig, RunPlan, TridentConfig
from megatron.log import global_rank
from megatron.mpu.layers import param_is_not_tensor_parallel_duplicate
from megatron.mpu.mappings import all_reduce_max_, all_reduce_sum_, communication_device
from megatron.mpu.parallel_state import ParallelState
from megatron.training.metrics import MetricsWriter, TrainRecord
from megatron.training.model_setup import EngineBundle
from megatron.training.state import TrainState
from megatron.training.step import StepResult
from megatron.training.straggler import StragglerDetector
from megatron.training.timers import Timers
from megatron.training.trainer import Trainer
from megatron.training.wandb_writer import WandbWriter, flat_config, wandb_dir, wandb_requested

logger = logging.getLogger(__name__)

_OPT_L2 = ("variance_l2", "variance_sqrt_l2", "momentum_l2", "weight_l2")
_OPT_L1 = ("variance_l1", "variance_sqrt_l1", "momentum_l1", "weight_l1")
_OPT_MAX = ("variance_abs_max", "variance_sqrt_abs_max", "momentum_abs_max", "weight_abs_max")


def _groups(state: ParallelState, partitioned: bool) -> list[Any]:
    """The groups a per-rank statistic is summed over: model parallel (TP x PP), plus DP when ZeRO partitions."""
    groups = [state.get_model_parallel_group()]
    if partitioned:
        groups.append(state.get_data_parallel_group())
    return groups


def _sum(t: torch.Tensor, state: ParallelState, partitioned: bool) -> torch.Tensor:
    for g in _groups(state, partitioned):
        all_reduce_sum_(t, group=g)
    return t


def params_norm(module: torch.nn.Module, state: ParallelState, *, pipe: bool) -> float:
    """L2 norm of the model's parameters, each counted once over the model-parallel group of ``state``. Every rank
    calls."""
    first_stage = state.get_pipeline_model_parallel_rank() == 0
    tp_group = state.get_tensor_model_parallel_group()
    total = torch.zeros(1, dtype=torch.float64)
    for name, p in module.named_parameters():
        if pipe and not first_stage and name.startswith("tied_modules."):
            continue  # the tied embedding also lives on the first stage
        if param_is_not_tensor_parallel_duplicate(p, tp_group):
            total += p.detach().double().pow(2).sum().cpu()
    dev = communication_device(state.get_model_parallel_group())
    return float(_sum(total.to(dev), state, partitioned=False).item()) ** 0.5


def optimizer_states(
    optimizer: torch.optim.Optimizer, state: ParallelState, *, partitioned: bool
) -> dict[str, float]:
    """Megatron-DeepSpeed's Adam-state statistics (see the module docstring). Every rank calls."""
    sums = torch.zeros(8, dtype=torch.float64)
    maxima = torch.zeros(4, dtype=torch.float64)
    for group in optimizer.param_groups:
        for p in group["params"]:
            adam = optimizer.state.get(p, {})
            if "exp_avg_sq" not in adam:
                continue
            tensors = (
                adam["exp_avg_sq"],
                adam["exp_avg_sq"].sqrt(),
                adam["exp_avg"],
                p.detach(),
            )
            for i, t in enumerate(tensors):
                t = t.double()
                sums[i] += t.pow(2).sum().item()
                sums[4 + i] += t.abs().sum().item()
                maxima[i] = max(maxima[i].item(), t.abs().max().item())
    dev = communication_device(state.get_model_parallel_group())
    sums, maxima = _sum(sums.to(dev), state, partitioned).cpu(), maxima.to(dev)
    for g in _groups(state, partitioned):
        all_reduce_max_(maxima, group=g)
    out = {name: sums[i].item() ** 0.5 for i, name in enumerate(_OPT_L2)}
    out.update({name: sums[4 + i].item() for i, name in enumerate(_OPT_L1)})
    out.update({name: maxima[i].item() for i, name in enumerate(_OPT_MAX)})
    return out


def memory_stats(device: torch.device) -> dict[str, float]:
    """Memory scalars under Megatron's tags (CUDA allocator; the process RSS on CPU)."""
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        return {
            "mem-reserved-bytes": float(s.get("reserved_bytes.all.current", 0)),
            "mem-allocated-bytes": float(s.get("allocated_bytes.all.current", 0)),
            "mem-allocated-count": float(s.get("allocation.all.current", 0)),
        }
    import psutil  # type: ignore[import-untyped]

    return {"mem-allocated-bytes": float(psutil.Process().memory_info().rss)}


class ZeroCounter:
    """Counts the zero gradient entries each optimizer step sees (a pre-step hook on the torch optimizer)."""

    def __init__(self, optimizer: torch.optim.Optimizer, wrapper: Any) -> None:
        self._optimizer = optimizer
        self._padding = [int(x) for x in getattr(wrapper, "groups_padding", []) or []]
        self.last: int = 0
        optimizer.register_step_pre_hook(self._count)

    def _count(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        zeros = 0
        for i, group in enumerate(self._optimizer.param_groups):
            for p in group["params"]:
                if p.grad is not None:
                    zeros += int(p.grad.numel() - torch.count_nonzero(p.grad).item())
            if i < len(self._padding):
                zeros -= self._padding[i]  # ZeRO's alignment padding of this rank's flat partition
        self.last = zeros

    def take(self, state: ParallelState, *, partitioned: bool) -> float:
        """The latest step's count summed over the ranks holding distinct parts (resets it). Every rank calls."""
        dev = communication_device(state.get_model_parallel_group())
        t = torch.tensor([float(self.last)], dtype=torch.float64, device=dev)
        self.last = 0
        return float(_sum(t, state, partitioned).item())


class StepLogger:
    """The optional per-iteration statistics and timers of a run (see the module docstring).

    Args:
        options: the run's ``LoggingConfig``.
        writer: the run's metrics writer.
        timers: the run's timers.
        bundle: the engine (its module for the params norm; DeepSpeed's optimizer wrapper for ZeRO's padding),
            the torch optimizer inside it (optimizer states, num zeros) and whether it is the pipeline engine.
        zero_stage: the ZeRO stage (>0: optimizer states and gradients are partitioned over DP).
        world_size: the job's world size.
        device: this rank's device.
        state: the run's model-parallel groups (the statistics are summed over them).
    """

    def __init__(
        self,
        options: LoggingConfig,
        *,
        writer: MetricsWriter,
        timers: Timers,
        bundle: EngineBundle,
        zero_stage: int,
        world_size: int,
        device: torch.device,
        state: ParallelState,
    ) -> None:
        self.o, self.writer, self.timers = options, writer, timers
        self.straggler: StragglerDetector | None = None
        """The straggler detector (--log-straggler; ``build_run_logging`` sets it), or None."""
        self._module, self._optimizer = bundle.engine.module, bundle.client_optimizer
        self._pipe, self._state = bundle.is_pipe, state
        self._partitioned = zero_stage > 0
        self._world_size, self._device = world_size, device
        wrapper = getattr(bundle.engine, "optimizer", None)
        self._zeros = (
            ZeroCounter(self._optimizer, wrapper) if options.log_num_zeros_in_grad else None
        )
        self._iters_in_interval = 0
        self.params_norm: float | None = None
        self.num_zeros: float | None = None

    def after_step(
        self,
        state: TrainState,
        result: StepResult,
        lr: float,
        *,
        batch_size: int,
        log_now: bool,
    ) -> None:
        """Every rank, after each iteration (``log_now``: a progress line follows)."""
        rec = TrainRecord(
            iteration=state.iteration,
            consumed_samples=state.consumed_train_samples,
            lm_loss=result.loss,
            lr=lr,
            grad_norm=result.grad_norm,
            loss_scale=result.loss_scale,
            skipped_iter=int(result.skipped),
            tokens_per_sec=0.0,
            tflops_per_device=0.0,
            mfu=None,
        )
        consumed_tokens = state.consumed_train_tokens
        self._iters_in_interval += 1
        it = rec.iteration
        tb_now = it % self.o.tensorboard_log_interval == 0
        self.params_norm = self.num_zeros = None
        if self.o.log_params_norm and (tb_now or log_now):
            self.params_norm = params_norm(self._module, self._state, pipe=self._pipe)
        if self._zeros is not None:
            self.num_zeros = self._zeros.take(self._state, partitioned=self._partitioned)
        if not tb_now:
            return
        w = self.writer
        w.train_scalars(
            rec, consumed_tokens=consumed_tokens, batch_size=batch_size, world_size=self._world_size
        )
        extra: dict[str, float] = {}
        if self.params_norm is not None:
            extra["params-norm/params-norm"] = self.params_norm
        if self.num_zeros is not None:
            extra["num-zeros/num-zeros"] = self.num_zeros
        if self.o.log_memory_to_tensorboard:
            extra.update(memory_stats(self._device))
        if self.o.log_optimizer_states_to_tensorboard:
            stats = optimizer_states(self._optimizer, self._state, partitioned=self._partitioned)
            extra.update({f"optimizer/{k}": v for k, v in stats.items()})
        for tag, value in extra.items():
            w.scalar(tag, value, it)
        if self.o.log_timers_to_tensorboard and self.timers.log_level > 0:
            self.timers.write(w, it, normalizer=float(self._iters_in_interval))

    def timed_step(self) -> AbstractContextManager[None]:
        """Around each training step: the straggler detector's timing (--log-straggler), else nothing."""
        return nullcontext() if self.straggler is None else self.straggler.step()

    def at_log_interval(self, iteration: int, seconds_per_iteration: float) -> None:
        """Every rank, at each progress line: stragglers named (--log-straggler), the timer block to the console
        (timers reset for the next interval) and the iteration time to TensorBoard."""
        if self.straggler is not None:
            self.straggler.at_log_interval(iteration, self.writer)
        if self.o.log_timers_to_tensorboard:
            self.writer.scalar("iteration-time/iteration-time", seconds_per_iteration, iteration)
        iters, self._iters_in_interval = max(1, self._iters_in_interval), 0
        if self.timers.log_level == 0:
            return  # no timer exists: skip the collective
        block = self.timers.log_string(normalizer=float(iters))
        if block is not None and self.writer.enabled:
            logger.info(block)


def build_run_logging(
    cfg: TridentConfig, plan: RunPlan, trainer: Trainer, *, resume_from: int
) -> tuple[MetricsWriter, StepLogger]:
    """The run's metrics writer (JSONL, TensorBoard, W&B on global rank 0) and its :class:`StepLogger`."""
    o = cfg.logging
    enabled = global_rank() == 0
    wandb = None
    if enabled and wandb_requested(o.wandb_project, o.wandb_exp_name):
        wandb = WandbWriter(
            project=o.wandb_project,
            name=o.wandb_exp_name,
            save_dir=wandb_dir(o.wandb_save_dir, cfg.checkpoint.save),
            config=flat_config(cfg),
        )
        logger.info("Weights & Biases run files: %s", wandb.run_dir)
    writer = MetricsWriter(
        o.metrics_file,
        o.tensorboard_dir,
        enabled=enabled,
        resume_from=resume_from,
        queue_size=o.tensorboard_queue_size,
        wandb=wandb,
        options=o,
    )
    step_log = StepLogger(
        o,
        writer=writer,
        timers=trainer.timers,
        bundle=trainer.bundle,
        zero_stage=plan.zero_stage,
        world_size=plan.world_size,
        device=trainer.device,
        state=trainer.state,
    )
    if o.log_straggler:
        step_log.straggler = StragglerDetector(
            o.straggler_threshold_or_default,
            stage=trainer.state.get_pipeline_model_parallel_rank(),
            tp_rank=trainer.state.get_tensor_model_parallel_rank(),
            device=communication_device(dist.group.WORLD),
        )
    return writer, step_log


def timers_of(o: LoggingConfig) -> Timers:
    """The run's timers per --timing-log-level, --timing-log-option, --no-barrier-with-level-1-timing."""
    return Timers(
        o.timing_log_level, o.timing_log_option, barrier_level_1=o.barrier_with_level_1_timing
    )
