"""Seeds and RNG streams of tensor parallelism, and activation checkpointing that replays them exactly.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``p`` TP size.

Two random streams per process, on CPU and CUDA alike:

* the default generators (``torch.manual_seed``): identical on the ranks of a TP group, used for dropout on
  replicated activations (e.g. after a row-parallel all-reduce);
* the tracker's ``"model-parallel-rng"`` stream (``seed + 2718 + tp_rank``): different on every TP rank, used
  under ``get_cuda_rng_tracker().fork()`` for dropout on sharded activations (attention probabilities of the
  local heads) and for the optional per-shard weight init.

A tracker state covers the CPU default generator and, when the run's device is CUDA, the current CUDA device's
generator, so ``fork()`` is device-agnostic (the name ``CudaRNGStatesTracker`` is kept for Megatron users). The
run's device comes in with the seed (``model_parallel_cuda_manual_seed(seed, group, device_type=...)``, from
``megatron.launch.device``): a CPU run never calls into ``torch.cuda``, even where a GPU is visible (one CUDA
context per gloo rank on GPU 0 otherwise). Only a tracker that was never seeded with a device falls back to
"CUDA where torch sees a GPU" (Megatron's behaviour, for library callers).

With --deepspeed-activation-checkpointing this tracker is also DeepSpeed's (``deepspeed.checkpointing.
get_cuda_rng_tracker()`` returns this object, see ``megatron/training/activation_checkpointing.py``): one tracker,
whichever checkpoint function saves and restores it.

**The tracker is the second process-wide object** (``parallel_state`` is the first; a test in
``tests/test_style.py`` holds the list of module state). It stays global on purpose: DeepSpeed's activation
checkpointing and its pipeline engine reach it through ``deepspeed.checkpointing.get_cuda_rng_tracker()``, not
through anything Trident passes, and a checkpoint function must fork the very stream the forward used, so one
tracker per process is the contract. It holds no groups: the TP rank it seeds with is passed in
(``model_parallel_cuda_manual_seed(seed, group)``).

``param_seed(seed, name)`` gives each parameter its own seed from its global name; the TP layers use it for the
layout-invariant init (see :mod:`megatron.mpu.layers`).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron.mpu.mappings import all_gather_first_dim
from megatron.mpu.parallel_state import ProcessGroup, group_rank, group_world_size, resolve_group
from megatron.mpu.utils import split_tensor_into_1d_equal_chunks

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
TENSOR_MODEL_PARALLEL_SEED_OFFSET = 2718
"""The tracker stream of TP rank r is seeded with ``seed + 2718 + r`` (Megatron's offset)."""

RNGState = dict[str, torch.Tensor]
"""``{"cpu": state}`` plus ``"cuda": state`` when the tracker's device is CUDA."""


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed for the parameter called ``name`` (global state-dict name) under the run seed ``seed``.

    sha256 of ``"<seed>:<name>"``: the same on every process, platform and Python version, and independent of
    the layout (TP / PP / DP), so a parameter's initial value depends only on ``(seed, name)``.

    Raises:
        ValueError: ``seed`` is not an int or ``name`` is empty.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"param_seed: seed must be an int, got {seed!r}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"param_seed: name must be a non-empty parameter name, got {name!r}")
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def _get_rng_state(device_type: str) -> RNGState:
    state = {"cpu": torch.get_rng_state()}
    if device_type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: RNGState, device_type: str) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device_type == "cuda":
        torch.cuda.set_rng_state(state["cuda"])


def _seeded_state(seed: int, device_type: str) -> RNGState:
    state = {"cpu": torch.Generator().manual_seed(seed).get_state()}
    if device_type == "cuda":
        saved = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(seed)
        state["cuda"] = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(saved)
    return state


class RNGStatesTracker:
    """Named RNG streams that can be swapped in around a block of code (``fork``).

    Invariant: a name and a seed are each added at most once until ``reset``. ``device_type`` ('cpu' or
    'cuda', set by ``reset``) says whether the CUDA generator is part of every state; None (never set): 'cuda'
    where torch sees a GPU.
    """

    def __init__(self) -> None:
        self.states: dict[str, RNGState] = {}
        self.seeds: set[int] = set()
        self.device_type: str | None = None

    def reset(self, device_type: str | None = None) -> None:
        """Forget every stream; ``device_type`` given: the run's device type from now on."""
        self.states = {}
        self.seeds = set()
        if device_type is not None:
            self.device_type = "cuda" if device_type == "cuda" else "cpu"

    def rng_device_type(self) -> str:
        """'cuda' when the CUDA generator is saved and restored with the CPU one, else 'cpu'."""
        if self.device_type is None:
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device_type

    def get_rng_state(self) -> RNGState:
        """The default generators' states (CPU, plus CUDA on a CUDA tracker)."""
        return _get_rng_state(self.rng_device_type())

    def set_rng_state(self, state: RNGState) -> None:
        """Restore the default generators from :meth:`get_rng_state` (its CUDA part on a CUDA tracker only)."""
        _set_rng_state(state, self.rng_device_type())

    def get_states(self) -> dict[str, RNGState]:
        """A copy of every stream's state (for checkpoints)."""
        return {name: dict(state) for name, state in self.states.items()}

    def set_states(self, states: dict[str, RNGState]) -> None:
        """Replace every stream's state (from :meth:`get_states`)."""
        self.states = {name: dict(state) for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create the stream ``name`` seeded with ``seed`` (the current streams are not disturbed).

        Raises:
            ValueError: ``name`` or ``seed`` was already added.
        """
        if seed in self.seeds:
            raise ValueError(f"RNG tracker: seed {seed} is already used by another stream")
        if name in self.states:
            raise ValueError(f"RNG tracker: stream {name!r} already exists; call reset() first")
        self.seeds.add(seed)
        self.states[name] = _seeded_state(seed, self.rng_device_type())

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block on stream ``name``; the default generators continue where they were afterwards.

        Raises:
            RuntimeError: ``name`` was never added (call ``model_parallel_cuda_manual_seed`` first).
        """
        if name not in self.states:
            raise RuntimeError(
                f"RNG stream {name!r} does not exist; call megatron.mpu.model_parallel_cuda_manual_seed(seed) "
                "after initialize_model_parallel (or give the layer init=WeightInit(seed=...))"
            )
        saved = self.get_rng_state()
        self.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self.get_rng_state()
            self.set_rng_state(saved)


CudaRNGStatesTracker = RNGStatesTracker
_RNG_STATE_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (Megatron's name; CPU and CUDA alike)."""
    return _RNG_STATE_TRACKER


@contextlib.contextmanager
def preserved_rng_states() -> Iterator[None]:
    """Run the block, then put back every random state a training run draws from: the default generators (CPU,
    and CUDA on a CUDA tracker), the tracker's streams, Python's ``random`` and NumPy's global generator. Code in
    the block (an evaluation that seeds its own sampling) then leaves training's random numbers unchanged."""
    import random

    import numpy as np

    tracker = _RNG_STATE_TRACKER
    default, streams = tracker.get_rng_state(), tracker.get_states()
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        tracker.set_rng_state(default)
        tracker.set_states(streams)
        random.setstate(py_state)
        np.random.set_state(np_state)


def model_parallel_cuda_manual_seed(
    seed: int, group: ProcessGroup | None = None, *, device_type: str | None = None
) -> None:
    """Seed the default generators with ``seed`` and the tracker stream with ``seed + 2718 + tp_rank``.

    Args:
        seed: identical on the ranks of a TP group (Megatron adds ``100 * pp_rank`` before calling this).
        group: the TP group; None = the default one (a world of 1 without torch.distributed).
        device_type: the run's device type ('cpu' or 'cuda', ``megatron.launch.device``): only a 'cuda' run
            saves and restores CUDA generators. None: keep the tracker's (CUDA where torch sees a GPU if never
            set).
    """
    tp_rank = group_rank(resolve_group(group))
    torch.manual_seed(seed)
    _RNG_STATE_TRACKER.reset(device_type)
    _RNG_STATE_TRACKER.add(
        _MODEL_PARALLEL_RNG_TRACKER_NAME, seed + TENSOR_MODEL_PARALLEL_SEED_OFFSET + tp_rank
    )


class CheckpointFunction(torch.autograd.Function):
    """Forward without keeping activations; backward replays the forward on the saved RNG states."""

    @staticmethod
    def forward(
        ctx: Any,
        run_function: Callable[..., Any],
        distribute_saved_activations: bool,
        group: ProcessGroup | None,
        *args: Any,
    ) -> Any:
        ctx.run_function = run_function
        ctx.distribute = distribute_saved_activations
        ctx.group = group
        ctx.rng_state = _RNG_STATE_TRACKER.get_rng_state()
        ctx.tracker_states = _RNG_STATE_TRACKER.get_states()
        with torch.no_grad():
            outputs = run_function(*args)
        tensors = [a if torch.is_tensor(a) else None for a in args]
        ctx.arg_is_tensor = [t is not None for t in tensors]
        ctx.plain_args = [None if torch.is_tensor(a) else a for a in args]
        ctx.input_requires_grad = [torch.is_tensor(a) and a.requires_grad for a in args]
        if distribute_saved_activations:
            # keep 1/p of the first input; backward all-gathers it back ([numel] -> [numel/p])
            first = args[0].detach()
            ctx.first_shape = first.shape
            tensors[0] = split_tensor_into_1d_equal_chunks(
                first, group_rank(group), group_world_size(group)
            ).clone()
        ctx.save_for_backward(*[t for t in tensors if t is not None])
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "activation checkpointing works with .backward() only, not torch.autograd.grad()"
            )
        saved = iter(ctx.saved_tensors)
        args = [
            next(saved) if is_t else plain for is_t, plain in zip(ctx.arg_is_tensor, ctx.plain_args)
        ]
        if ctx.distribute:
            args[0] = all_gather_first_dim(args[0], ctx.group)[: ctx.first_shape.numel()]
            args[0] = args[0].view(ctx.first_shape)
        inputs = [
            a.detach().requires_grad_(rg) if torch.is_tensor(a) else a
            for a, rg in zip(args, ctx.input_requires_grad)
        ]
        tracker = _RNG_STATE_TRACKER
        current_rng, current_tracker = tracker.get_rng_state(), tracker.get_states()
        tracker.set_rng_state(ctx.rng_state)
        _RNG_STATE_TRACKER.set_states(ctx.tracker_states)
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*inputs)
        finally:
            tracker.set_rng_state(current_rng)
            tracker.set_states(current_tracker)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [a.grad if torch.is_tensor(a) else None for a in inputs]
        return (None, None, None, *input_grads)


def checkpoint(
    function: Callable[..., Any],
    distribute_saved_activations: bool,
    *args: Any,
    group: ProcessGroup | None = None,
) -> Any:
    """Run ``function(*args)`` without storing its activations; recompute them in backward.

    The CPU/CUDA default RNG states and the tracker streams are saved before the forward and restored for the
    recomputation, so dropout masks (replicated or forked) are identical in both passes. With
    ``distribute_saved_activations`` each TP rank keeps only ``1/p`` of ``args[0]`` (flattened; its numel must be
    divisible by ``p``) and the full tensor is all-gathered over ``group`` (the model's TP group; None = the
    default one) in backward.

    Returns:
        whatever ``function`` returns (a tensor or a tuple of tensors).
    """
    group = resolve_group(group) if distribute_saved_activations else None
    if distribute_saved_activations and not torch.is_tensor(args[0] if args else None):
        raise ValueError(
            "checkpoint(distribute_saved_activations=True) needs a tensor as first argument"
        )
    return CheckpointFunction.apply(function, distribute_saved_activations, group, *args)
