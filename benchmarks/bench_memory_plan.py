"""Benchmark: the memory planner (``megatron/planning/memory_plan.py``) against real short CPU runs.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m benchmarks.bench_memory_plan            # every layout
    python -m benchmarks.bench_memory_plan --only zero1-dp2 --json out.jsonl
    python -m benchmarks.bench_memory_plan --model-flags=--bf16                           # bf16 (or any other flags)

For each layout (ZeRO 0-3 x TP 1-2 x PP 1-2, SP, recompute) a real ``pretrain``-built engine (the same preflight,
engine, iterators and step function as a run) trains ``--steps`` steps on mock data, and per rank we report the
planner's prediction next to what was measured. Not a test: it spawns up to 4 ranks per layout.

What "measured" means on CPU (torch 2.13 has no CPU allocator statistics; ``torch.cuda.max_memory_allocated`` is
used where CUDA runs):

* states: bytes of every live tensor storage in the process (``gc`` walk, each storage once, minus what was live
  before the engine was built), sampled after each micro-batch's backward, just before the optimizer step (inside
  DeepSpeed: gradients and buckets alive) and after it, and from the second step on after every parameter's
  gradient and at the activations' peak (below); the largest sample.
* activations: a ``torch.autograd.graph.saved_tensors_hooks`` pair around the whole step wraps every tensor saved
  for backward (parameters excluded) in a holder whose lifetime is the autograd graph's; a per-storage refcount
  gives the bytes alive at every moment and their peak, through the 1F1B schedule and recomputation alike.
* total: the largest sum of the two alive at the same moment, over the states' samples; from the second step on
  these include every moment the saved activations reach their peak again. What exists only after backward (ZeRO-0's
  flat all-reduce copy, ZeRO-2's fp32 gradient copy at the step) does not add to the activations' peak. The sum of
  both maxima, whenever they occurred (this bench's total before), is reported as ``states_plus_activations``.
* collectives: Trident's own are reported by ``megatron.mpu.observe_collectives``; DeepSpeed's are counted by
  wrapping ``torch.distributed``'s functions in this process before DeepSpeed binds them (calls made from
  ``megatron.mpu.mappings`` are skipped there: the observer saw them). Each call adds its tensor's bytes
  (all-gather: the output, reduce-scatter: the input) to its group (TP, DP, PP by rank set; point-to-point is PP,
  all-to-all is EP: DeepSpeed-MoE's token exchange), counted over the last step only.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from megatron.launch.spawn import spawn_local_ranks

MODEL = [
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--vocab-size", "1000", "--mock-data", "--micro-batch-size", "2",
    "--train-iters", "3", "--lr", "1e-4", "--lr-decay-style", "constant", "--attention-dropout", "0",
    "--hidden-dropout", "0.1", "--eval-iters", "0", "--log-level", "WARNING",
]  # fmt: skip
"""~0.95M parameters, activations ~2.4 MB per layer per micro-batch: states and activations both measurable."""

MOE = [
    "--num-experts",
    "4",
    "--expert-interval",
    "2",
    "--moe-expert-parallel-size",
    "2",
    "--create-moe-param-group",
]
"""DeepSpeed-MoE on layers 2 and 4 of 4, EP 2 (4 experts, 2 local), the default capacity factor 1."""

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "zero0-dp2": (2, ["--zero-stage", "0"]),
    "zero1-dp2": (2, ["--zero-stage", "1"]),
    "zero2-dp2": (2, ["--zero-stage", "2"]),
    "zero3-dp2": (2, ["--zero-stage", "3"]),
    "tp2-zero0": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2-sp-dp2-zero1": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "1"]),
    "pp2-zero1": (2, ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"]),
    "tp2-pp2-zero1": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "1"]),
    "full-recompute-zero1-dp2": (2, ["--zero-stage", "1", "--recompute-granularity", "full"]),
    "selective-recompute-zero2-dp2": (2, ["--zero-stage", "2", "--recompute-granularity", "selective"]),
    "moe-top1-ep2-zero1-dp2": (2, [*MOE, "--zero-stage", "1"]),
    "moe-top2-ep2-zero1-dp2": (2, [*MOE, "--topk", "2", "--zero-stage", "1"]),
    "moe-top1-tp2-ep2-zero1": (4, [*MOE, "--tensor-model-parallel-size", "2", "--zero-stage", "1"]),
    "moe-top2-tp2-ept-ep2-zero1": (4, [*MOE, "--topk", "2", "--tensor-model-parallel-size", "2",
                                       "--enable-expert-tensor-parallelism", "--zero-stage", "1"]),
    "moe-top1-residual-nodrop-dp2": (2, [*MOE, "--mlp-type", "residual", "--disable-moe-token-dropping"]),
}  # fmt: skip

BUCKETS = {"reduce_bucket_size": 200_000, "allgather_bucket_size": 200_000}
BUCKETS3 = {
    "stage3_prefetch_bucket_size": 200_000,
    "stage3_max_live_parameters": 200_000,
    "stage3_param_persistence_threshold": 1000,  # every weight partitioned, as in a large model
}


def _largest_tensors(exclude: Any, n: int = 40) -> list[tuple[int, list[int], str]]:
    """(bytes, shape, dtype) of the ``n`` largest live storages, gradients included (BENCH_MEMORY_DEBUG=1: the
    states at the total's peak)."""
    seen: dict[int, tuple[int, list[int], str]] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                for t, kind in ((obj, ""), (obj.grad, " grad")) if obj.is_leaf else ((obj, ""),):
                    st = t.untyped_storage() if t is not None else None
                    if st is not None and st.data_ptr() not in exclude:
                        seen[st.data_ptr()] = (st.nbytes(), list(t.shape), str(t.dtype) + kind)
        except Exception:  # noqa: BLE001, S112
            continue
    return sorted(seen.values(), reverse=True)[:n]


def _spare_logits() -> set[int]:
    """Storages of the logits memory the CPU model keeps between a backward and the next forward."""
    from megatron.model.output_logits import LogitsBuffer

    return {
        obj.spare.untyped_storage().data_ptr()
        for obj in gc.get_objects()
        if isinstance(obj, LogitsBuffer) and obj.spare is not None
    }


def live_tensor_bytes(exclude: Any = ()) -> int:
    """Bytes of every live tensor storage reachable from Python (each storage once), but those in ``exclude``.

    A leaf's ``.grad`` has no Python object until Python asks for it (DeepSpeed's all-reduce does; a step that skips
    it, at DP 1, does not), so each tensor's gradient is looked up too."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                for t in (obj, obj.grad) if obj.is_leaf else (obj,):
                    if t is not None:
                        st = t.untyped_storage()
                        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        except Exception:  # noqa: BLE001, S112 - some tensor subclasses refuse storage access
            continue
    return sum(n for ptr, n in seen.items() if ptr not in exclude)


class SavedTensors:
    """Bytes of tensors saved for backward alive now and at peak (see the module docstring)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude, self.live, self.current, self.peak = exclude, {}, 0, 0
        self.at_peak: Any = None
        """Called when the bytes alive reach the peak so far again (set once the first step has run)."""

    def pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, torch.nn.Parameter) or hasattr(t, "ds_id"):
            return (
                t  # a parameter (ZeRO-3: gathered, then released by DeepSpeed) is not an activation
            )
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.exclude or key == 0:
            return t
        count, size = self.live.get(key, (0, st.nbytes()))
        self.live[key] = (count + 1, size)
        if count == 0:
            self.current += size
            self.peak = max(self.peak, self.current)
            if self.at_peak is not None and self.current == self.peak:
                self.at_peak()
        return _Holder(t, self, key)

    @staticmethod
    def unpack(x: Any) -> torch.Tensor:
        return x.t if isinstance(x, _Holder) else x

    def release(self, key: int) -> None:
        count, size = self.live[key]
        if count == 1:
            del self.live[key]
            self.current -= size
        else:
            self.live[key] = (count - 1, size)


class _Holder:
    __slots__ = ("key", "owner", "t")

    def __init__(self, t: torch.Tensor, owner: SavedTensors, key: int) -> None:
        self.t, self.owner, self.key = t, owner, key

    def __del__(self) -> None:
        self.owner.release(self.key)


_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
    "broadcast", "reduce", "send", "recv", "isend", "irecv", "all_to_all_single",
)  # fmt: skip


def _called_from_mappings() -> bool:
    """Whether the ``torch.distributed`` call being counted came from ``megatron.mpu.mappings``: the first frame
    outside this module and ``torch.distributed`` (``batch_isend_irecv`` calls its ops from inside torch)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if name != __name__ and not name.startswith("torch.distributed"):
                return name == "megatron.mpu.mappings"
            frame = frame.f_back
        return False
    finally:
        del frame  # no frame cycle keeping callers' tensors alive until the next gc


class CollectiveCounter:
    """Bytes per group name while ``active``: Trident's collectives through :meth:`observe` (register it with
    ``megatron.mpu.observe_collectives``), everyone else's (DeepSpeed) through wrapped ``torch.distributed``."""

    def __init__(self) -> None:
        self.active = False
        self.bytes: dict[str, int] = defaultdict(int)
        self.by_op: dict[str, int] = defaultdict(int)
        """Bytes per ``group/op`` (diagnostics)."""
        self.groups: dict[frozenset[int], str] = {}

    def install(self) -> None:
        """Wrap ``torch.distributed``'s collectives (before DeepSpeed binds some of them at engine build)."""
        import torch.distributed as dist

        for name in _COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def observe(self, op: str, nbytes: int, group: Any) -> None:
        """The ``megatron.mpu.observe_collectives`` observer: one of Trident's collectives."""
        if self.active:
            self._add(op, nbytes, group)

    def name_groups(self, state: Any) -> None:
        """Map the TP/DP/PP groups' rank sets of ``state`` (the run's ``ParallelState``) to names."""
        import torch.distributed as dist

        for name, group in (
            ("tp", state.get_tensor_model_parallel_group()),
            ("dp", state.get_data_parallel_group()),
            ("pp", state.get_pipeline_model_parallel_group()),
        ):
            self.groups.setdefault(frozenset(dist.get_process_group_ranks(group)), name)

    def _wrap(self, name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.active and not _called_from_mappings():
                self._count(name, args, kwargs)
            return fn(*args, **kwargs)

        return counted

    def _count(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        import torch.distributed as dist

        tensors = [a for a in args if isinstance(a, torch.Tensor)] + [
            v for v in kwargs.values() if isinstance(v, torch.Tensor)
        ]
        if name == "reduce_scatter_tensor":
            t = tensors[1] if len(tensors) > 1 else tensors[0]
        elif name == "all_gather" and args and isinstance(args[0], list):
            t = None
            size = sum(x.numel() * x.element_size() for x in args[0])
        else:
            t = tensors[0] if tensors else None
        if t is not None:
            size = t.numel() * t.element_size()
        elif name != "all_gather":
            return
        group = kwargs.get("group") or next(
            (a for a in args if isinstance(a, dist.ProcessGroup)), None
        )
        self._add(name, size, group)

    def _add(self, name: str, size: int, group: Any) -> None:
        import torch.distributed as dist

        if name in ("send", "recv", "isend", "irecv"):
            self.bytes["pp"] += size
            self.by_op[f"pp/{name}"] += size
            return
        ranks = frozenset(
            dist.get_process_group_ranks(group)
            if group is not None
            else range(dist.get_world_size())
        )
        if len(ranks) == 1:
            return  # a group of one rank moves nothing (DeepSpeed still calls it at DP = 1)
        # DeepSpeed-MoE's token all-to-all runs over the expert-parallel group, whose ranks may be the TP or DP group's
        group_name = (
            "ep" if name == "all_to_all_single" else self.groups.get(ranks, f"other{len(ranks)}")
        )
        self.bytes[group_name] += size
        self.by_op[f"{group_name}/{name}"] += size


def _wrap_step_sampling(engine: Any, sample: Any) -> None:
    """Sample live tensor bytes just before and after DeepSpeed's optimizer step (gradients alive before it)."""

    def around(fn: Any) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            sample()
            out = fn(*a, **k)
            sample()
            return out

        return wrapped

    if hasattr(engine, "_INSTRUCTION_MAP"):  # PipelineEngine: its schedule's OptimizerStep
        from deepspeed.runtime.pipe import schedule

        m = engine._INSTRUCTION_MAP = dict(type(engine)._INSTRUCTION_MAP)  # this engine only
        m[schedule.OptimizerStep] = around(m[schedule.OptimizerStep])
        m[schedule.BackwardPass] = around(m[schedule.BackwardPass])
    else:
        engine._take_model_step = around(engine._take_model_step)
        engine.backward = around(engine.backward)


def measure_worker(argv: list[str], steps: int) -> dict[str, Any]:
    """One rank: plan, build the run's engine, train ``steps`` steps, measure (see the module docstring)."""
    from megatron import mpu
    from megatron.config import parse_args
    from megatron.planning.memory_plan import plan_memory
    from megatron.planning.planner_config import PlannerConfig
    from megatron.training import initialize
    from megatron.training.preflight import preflight
    from megatron.training.pretrain import build_trainer
    from megatron.training.state import TrainState

    counter = CollectiveCounter()
    counter.install()  # before DeepSpeed binds its all-gather / reduce-scatter functions
    pre = preflight(parse_args(argv))
    run = initialize.init_distributed(pre.cfg.parallel)
    counter.name_groups(run.state)
    initialize.set_seeds(pre.cfg.training.seed, run.state)
    stage = run.state.get_pipeline_model_parallel_rank()
    cfg = pre.cfg
    memory = plan_memory(
        PlannerConfig.from_configs(cfg.model, cfg.parallel, cfg.training), pre.plan, pre.ds_config
    )
    predicted = memory.stages[stage]
    gc.collect()
    base = live_tensor_bytes()
    trainer = build_trainer(pre, run, None, TrainState())
    states, total = [0], [0]
    params = {p.untyped_storage().data_ptr() for p in trainer.engine.module.parameters()}
    saved = SavedTensors(params)

    top: list[Any] = []

    def sample() -> None:
        # saved activations (Python-visible through their holders) are counted apart, and so is the CPU logits
        # buffer kept between steps: its memory is the next forward's logits (an activation), not a state
        gc.collect()
        now = live_tensor_bytes(exclude=set(saved.live) | _spare_logits()) - base
        if now + saved.current > total[0] and os.environ.get("BENCH_MEMORY_DEBUG"):
            top[:] = _largest_tensors(saved.live)
        states[0] = max(states[0], now)
        total[0] = max(total[0], now + saved.current)

    _wrap_step_sampling(trainer.engine, sample)
    # inside backward, once the last gradient of a micro-batch exists (DeepSpeed's gradient buckets alive); from
    # the second step on after every parameter's gradient too, where states grow as activations are freed
    first, *rest = (p for p in trainer.engine.module.parameters() if p.requires_grad)
    first.register_post_accumulate_grad_hook(lambda _: sample())
    for p in rest:
        p.register_post_accumulate_grad_hook(lambda _: sample() if saved.at_peak else None)
    with mpu.observe_collectives(counter.observe):
        for i in range(steps):
            counter.active = i == steps - 1
            if i == 1:  # the optimizer states exist now: sample again wherever the activations peak
                saved.at_peak = sample
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                trainer.train_step()
    counter.active = False
    cuda_peak = torch.cuda.max_memory_allocated() if run.device.type == "cuda" else None
    mpu.destroy_model_parallel()
    return {
        "rank": torch.distributed.get_rank(),
        "stage": stage,
        "predicted": {
            "states": predicted.total - predicted.activation_bytes,
            "activations": predicted.activation_bytes,
            "total": predicted.total,
        },
        "measured": {
            "states": states[0],
            "activations": saved.peak,
            "total": total[0],
            "states_plus_activations": states[0] + saved.peak,
            "cuda_max_allocated": cuda_peak,
        },
        "collectives_predicted": dict(memory.collective_bytes),
        "collectives_measured": dict(counter.bytes),
        "collectives_by_op": dict(counter.by_op),
        "largest_at_peak": top,
    }


def run_layout(
    name: str, world: int, extra: list[str], ds_json: Path, steps: int, model_flags: list[str]
) -> list[dict[str, Any]]:
    """Spawn ``world`` ranks for one layout; the per-rank rows."""
    gas_batch = (
        2 * 2 * world
    )  # 2 micro-batches per rank at TP = PP = 1; 2 x TP x PP with model parallelism
    argv = [
        *MODEL,
        *model_flags,  # argparse keeps the last value: these override MODEL's
        *extra,
        "--global-batch-size",
        str(gas_batch),
        "--deepspeed_config",
        str(ds_json),
    ]
    rows = spawn_local_ranks(
        measure_worker, world, argv, steps, init_process_group=False, timeout=900
    )
    for r in rows:
        r["layout"] = name
    return rows


def _err(pred: int, meas: int) -> str:
    return f"{100.0 * (pred - meas) / meas:+.1f}%" if meas else "n/a"


def format_row(r: dict[str, Any]) -> str:
    """One table line: layout, rank, stage, predicted/measured MiB (states, activations, total), error."""
    p, m = r["predicted"], r["measured"]
    mib = 2**20
    return (
        f"{r['layout']:<30} r{r['rank']} s{r['stage']}  states {p['states'] / mib:7.2f}/{m['states'] / mib:7.2f}"
        f"  act {p['activations'] / mib:7.2f}/{m['activations'] / mib:7.2f}  total {p['total'] / mib:7.2f}/"
        f"{m['total'] / mib:7.2f} MiB  err {_err(p['total'], m['total'])}"
    )


def collective_errors(r: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(predicted, counted) bytes per group; the planner's SP traffic runs in the TP group."""
    p, m = r["collectives_predicted"], r["collectives_measured"]
    out = {}
    for g in ("tp", "pp", "dp", "ep"):
        pred = p.get(g, 0) + (p.get("sp", 0) if g == "tp" else 0)
        if pred or m.get(g):
            out[g] = (pred, m.get(g, 0))
    return out


def format_collectives(r: dict[str, Any]) -> str:
    """``TP 9.00/9.02 MiB (-0.2%)`` for each group with traffic."""
    return (
        ", ".join(
            f"{g.upper()} {pred / 2**20:.2f}/{meas / 2**20:.2f} MiB ({_err(pred, meas)})"
            for g, (pred, meas) in collective_errors(r).items()
        )
        or "none"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--only", nargs="*", default=None, choices=sorted(LAYOUTS), help="layouts to run"
    )
    p.add_argument("--steps", type=int, default=2, help="steps per run (the last is counted)")
    p.add_argument("--json", default=None, help="also write every row as JSON lines here")
    p.add_argument(
        "--model-flags",
        default="",
        help='pretrain flags overriding the default model, e.g. "--num-layers 6 --hidden-size 192"',
    )
    a = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp = Path(tempfile.mkdtemp())
    rows: list[dict[str, Any]] = []
    for name in a.only or list(LAYOUTS):
        world, extra = LAYOUTS[name]
        ds_json = tmp / f"{name}.json"
        zero = dict(BUCKETS, **(BUCKETS3 if "zero3" in name else {}))
        ds_json.write_text(json.dumps({"zero_optimization": zero}))
        layout_rows = run_layout(name, world, extra, ds_json, a.steps, a.model_flags.split())
        for r in layout_rows:
            print(format_row(r), flush=True)
        print(f"{'':<30} collectives per step per rank: {format_collectives(layout_rows[0])}")
        rows += layout_rows
    if a.json:
        Path(a.json).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
