"""The test oracle of the tensor-parallel core: every layer, mapping and loss against single-process PyTorch.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``o`` output features, ``p`` TP size, ``v`` vocab.

:func:`run_selfcheck` spawns the ranks on CPU (gloo), builds the process groups, checks every group against
:func:`megatron.mpu.parallel_state.rank_grid`, runs every TP layer, mapping and the cross-entropy against
``nn.Linear`` / ``nn.Embedding`` / ``F.cross_entropy`` (forward and every grad) and returns a PASS/FAIL table;
``python -m tools.mpu_selfcheck`` is its CLI (for a new machine or cluster), the test suite uses the same checks.

The ``compare_*`` functions each run one layer on the given TP group and
returns :class:`Comparison` pairs (this rank's value, the reference's matching slice). A pair is compared with
``torch.equal`` when the same floating-point operations run on the same numbers (copies, scatters and gathers,
embedding lookups, and every quantity at TP = 1), else with a relative tolerance of ``RTOL``: a sum over ranks
adds the same terms in another order, and a matrix product of another shape (a rank's slice against the full
reference) may too, because CPU BLAS kernels choose their blocking, and with it the order of the inner sum, by
matrix shape and processor (bit-identical on some x86 machines, 3e-8 apart on an AMD EPYC). fp32 rounding of a
few terms stays far below 1e-6 of the largest value.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.launch.spawn import spawn_local_ranks
from megatron.mpu.context import TPSettings
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.mpu.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightInit,
    gather_full_parameter,
)
from megatron.mpu.mappings import (
    all_reduce_sum_,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.mpu.parallel_state import (
    ParallelState,
    ProcessGroup,
    group_rank,
    group_world_size,
    initialize_model_parallel,
    rank_grid,
    validate_degrees,
)

logger = logging.getLogger(__name__)

RTOL = 1e-6
"""Max ``|actual - expected| / max|expected|`` for a pair whose path contains a cross-rank reduction."""

SEQ, BATCH, HIDDEN, OUT, VOCAB, TRUE_VOCAB = 8, 2, 16, 24, 32, 29
"""Problem sizes: divisible by p in {1, 2, 4} (and by 2 p for stride 2); TRUE_VOCAB < VOCAB leaves padding rows."""


@dataclass
class Comparison:
    """One quantity of one check on one rank: this rank's value and the reference's matching slice."""

    check: str
    quantity: str
    actual: torch.Tensor | None
    """None (a grad the layer never produced) fails the comparison."""
    expected: torch.Tensor
    exact: bool
    """True: must be bit-identical (``torch.equal``); False: relative error ``<= RTOL``."""

    def error(self) -> float:
        """``max|actual - expected| / max|expected|`` (inf on a shape mismatch)."""
        if self.actual is None or self.actual.shape != self.expected.shape:
            return float("inf")
        diff = (self.actual.detach().double() - self.expected.detach().double()).abs().max()
        scale = self.expected.detach().double().abs().max().clamp_min(1e-30)
        return float(diff / scale) if self.expected.numel() else 0.0

    def passed(self) -> bool:
        """Exact pairs must be equal; the others within ``RTOL``."""
        if self.actual is None or self.actual.shape != self.expected.shape:
            return False
        if self.exact:
            return torch.equal(self.actual.detach(), self.expected.detach())
        return self.error() <= RTOL


def randn(shape: Sequence[int], seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Deterministic N(0, 1) tensor, identical on every rank for the same seed."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def shard(full: torch.Tensor, dim: int, rank: int, world: int, stride: int = 1) -> torch.Tensor:
    """Reference slicing: the ``stride`` chunks ``rank, rank + p, ...`` of ``full`` along ``dim``, concatenated."""
    chunks = full.chunk(world * stride, dim=dim)
    return torch.cat([chunks[rank + k * world] for k in range(stride)], dim=dim)


def master_weight(
    shape: tuple[int, int], init_seed: int, std: float = 0.02, rows: int | None = None
) -> torch.Tensor:
    """The TP=1 weight the layout-invariant init defines: N(0, std) from ``init_seed`` (rows past ``rows`` zero)."""
    master = torch.zeros(shape)
    target = master if rows is None else master[:rows]
    target.normal_(0.0, std, generator=torch.Generator().manual_seed(init_seed))
    return master


def _grad(reference: torch.Tensor) -> torch.Tensor:
    """The grad of a reference tensor after its backward (missing: a bug of the check itself)."""
    if reference.grad is None:
        raise RuntimeError("self-check reference has no grad after backward")
    return reference.grad


def _set_bias(
    bias: torch.Tensor, full: torch.Tensor, rank: int, world: int, stride: int, parallel: bool
) -> None:
    with torch.no_grad():
        bias.copy_(shard(full, 0, rank, world, stride) if parallel else full)


def _name(base: str, **flags: object) -> str:
    on = [
        f"{k}={v}"
        for k, v in flags.items()
        if v is not None and v is not False and v != (k == "stride")
    ]
    return base + (f"({', '.join(on)})" if on else "")


def compare_column_parallel_linear(
    group: ProcessGroup | None,
    *,
    gather_output: bool = False,
    sequence_parallel: bool = False,
    stride: int = 1,
    skip_bias_add: bool = False,
    init_seed: int = 1234,
    device: torch.device | str = "cpu",
) -> list[Comparison]:
    """ColumnParallelLinear vs nn.Linear: init, output, input grad, weight and bias grad shards."""
    world, rank = group_world_size(group), group_rank(group)
    name = _name(
        "ColumnParallelLinear", gather_output=gather_output, sequence_parallel=sequence_parallel,
        stride=stride, skip_bias_add=skip_bias_add,
    )  # fmt: skip
    layer = ColumnParallelLinear(
        HIDDEN, OUT, gather_output=gather_output, stride=stride, skip_bias_add=skip_bias_add,
        init=WeightInit(seed=init_seed),
        tp=TPSettings(group=group, sequence_parallel=sequence_parallel, device=device),
    )  # fmt: skip
    _set_bias(layer.bias, randn([OUT], 3, device), rank, world, stride, True)
    x_full, g_full = randn([SEQ, BATCH, HIDDEN], 1, device), randn([SEQ, BATCH, OUT], 2, device)
    x = (shard(x_full, 0, rank, world) if sequence_parallel else x_full).clone().requires_grad_()
    out, bias = layer(x)  # [s, b, o/p] or [s, b, o]
    if skip_bias_add:
        out = out + bias
    out.backward(g_full if gather_output else shard(g_full, 2, rank, world, stride))

    ref = torch.nn.Linear(HIDDEN, OUT).to(device)
    with torch.no_grad():
        ref.weight.copy_(gather_full_parameter(layer.weight, group))
        ref.bias.copy_(gather_full_parameter(layer.bias, group))
    xr = x_full.clone().requires_grad_()
    yr = ref(xr)
    yr.backward(g_full)
    expected_x_grad = shard(_grad(xr), 0, rank, world) if sequence_parallel else _grad(xr)
    return [
        Comparison(
            name,
            "init == master",
            ref.weight.detach(),
            master_weight((OUT, HIDDEN), init_seed).to(device),
            True,
        ),
        # a rank's [s*b, o/p] product against the reference's [s*b, o] (see the module docstring)
        Comparison(
            name,
            "output",
            out,
            yr if gather_output else shard(yr, 2, rank, world, stride),
            world == 1,
        ),
        # the input grad is a sum over TP ranks of partial products (all-reduce / reduce-scatter)
        Comparison(name, "input grad", x.grad, expected_x_grad, world == 1),
        Comparison(
            name,
            "weight grad",
            layer.weight.grad,
            shard(_grad(ref.weight), 0, rank, world, stride),
            world == 1,
        ),
        # sum over s*b tokens of [s*b, o/p] vs [s*b, o]: CPU sum kernels vectorize by width, so the rounding
        # of the column sums may differ (seen at p = 4) although no rank-to-rank reduction is involved
        Comparison(
            name,
            "bias grad",
            layer.bias.grad,
            shard(_grad(ref.bias), 0, rank, world, stride),
            world == 1,
        ),
    ]


def compare_row_parallel_linear(
    group: ProcessGroup | None,
    *,
    input_is_parallel: bool = True,
    sequence_parallel: bool = False,
    stride: int = 1,
    skip_bias_add: bool = False,
    init_seed: int = 4321,
    device: torch.device | str = "cpu",
) -> list[Comparison]:
    """RowParallelLinear vs nn.Linear: init, output, input grad, weight grad shard, bias grad."""
    world, rank = group_world_size(group), group_rank(group)
    name = _name(
        "RowParallelLinear", input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel,
        stride=stride, skip_bias_add=skip_bias_add,
    )  # fmt: skip
    layer = RowParallelLinear(
        HIDDEN, OUT, input_is_parallel=input_is_parallel, stride=stride, skip_bias_add=skip_bias_add,
        init=WeightInit(seed=init_seed),
        tp=TPSettings(group=group, sequence_parallel=sequence_parallel, device=device),
    )  # fmt: skip
    _set_bias(layer.bias, randn([OUT], 6, device), rank, world, stride, False)
    x_full, g_full = randn([SEQ, BATCH, HIDDEN], 4, device), randn([SEQ, BATCH, OUT], 5, device)
    x = (
        (shard(x_full, 2, rank, world, stride) if input_is_parallel else x_full)
        .clone()
        .requires_grad_()
    )
    out, bias = layer(x)  # [s, b, o] or [s/p, b, o]
    if skip_bias_add:
        out = out + bias
    out.backward(shard(g_full, 0, rank, world) if sequence_parallel else g_full)

    ref = torch.nn.Linear(HIDDEN, OUT).to(device)
    with torch.no_grad():
        ref.weight.copy_(gather_full_parameter(layer.weight, group))
        ref.bias.copy_(layer.bias)
    xr = x_full.clone().requires_grad_()
    yr = ref(xr)
    yr.backward(g_full)
    return [
        Comparison(
            name,
            "init == master",
            ref.weight.detach(),
            master_weight((OUT, HIDDEN), init_seed).to(device),
            True,
        ),
        # the output is a sum over TP ranks of partial products (all-reduce / reduce-scatter)
        Comparison(
            name, "output", out, shard(yr, 0, rank, world) if sequence_parallel else yr, world == 1
        ),
        # products of a rank's slice against the full reference's (see the module docstring)
        Comparison(
            name,
            "input grad",
            x.grad,
            shard(_grad(xr), 2, rank, world, stride) if input_is_parallel else _grad(xr),
            world == 1,
        ),
        Comparison(
            name,
            "weight grad",
            layer.weight.grad,
            shard(_grad(ref.weight), 1, rank, world, stride),
            world == 1,
        ),
        # under sequence parallelism each rank sums its s/p rows; the bias grad all-reduces those partial sums
        Comparison(
            name, "bias grad", layer.bias.grad, _grad(ref.bias), world == 1 or not sequence_parallel
        ),
    ]


def compare_vocab_parallel_embedding(
    group: ProcessGroup | None, *, init_seed: int = 999, device: torch.device | str = "cpu"
) -> list[Comparison]:
    """VocabParallelEmbedding (padded vocab) vs nn.Embedding: init with zero padding rows, output, weight grad."""
    world, rank = group_world_size(group), group_rank(group)
    name = "VocabParallelEmbedding(padded)"
    layer = VocabParallelEmbedding(
        VOCAB,
        HIDDEN,
        true_vocab_size=TRUE_VOCAB,
        init=WeightInit(seed=init_seed),
        tp=TPSettings(device=device, group=group),
    )
    ids = torch.randint(0, TRUE_VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7)).to(
        device
    )
    ids[0, 0], ids[1, -1], ids[0, 1] = (
        0,
        TRUE_VOCAB - 1,
        ids[0, 2],
    )  # both ends of the vocabulary, a repeated id
    g_full = randn([BATCH, SEQ, HIDDEN], 8, device)
    out = layer(ids)  # [b, s, h]
    out.backward(g_full)

    ref = torch.nn.Embedding(VOCAB, HIDDEN).to(device)
    with torch.no_grad():
        ref.weight.copy_(gather_full_parameter(layer.weight, group))
    yr = ref(ids)
    yr.backward(g_full)
    master = master_weight((VOCAB, HIDDEN), init_seed, rows=TRUE_VOCAB).to(device)
    return [
        Comparison(name, "init == master", ref.weight.detach(), master, True),
        # each output row is one rank's row plus exact zeros from the others: the all-reduce is exact
        Comparison(name, "output", out, yr, True),
        Comparison(
            name, "weight grad", layer.weight.grad, shard(_grad(ref.weight), 0, rank, world), True
        ),
    ]


def compare_vocab_parallel_cross_entropy(
    group: ProcessGroup | None, *, label_smoothing: float = 0.0, device: torch.device | str = "cpu"
) -> list[Comparison]:
    """vocab_parallel_cross_entropy vs F.cross_entropy (label_smoothing a' = a v / (v - 1)): loss, logits grad."""
    world, rank = group_world_size(group), group_rank(group)
    name = _name("vocab_parallel_cross_entropy", label_smoothing=label_smoothing or None)
    logits_full = 3.0 * randn([SEQ, BATCH, VOCAB], 9, device)
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=torch.Generator().manual_seed(10)).to(
        device
    )
    g = randn([SEQ, BATCH], 11, device)
    logits = shard(logits_full, 2, rank, world).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, target, label_smoothing, group)  # [s, b]
    loss.backward(g)

    lr = logits_full.clone().requires_grad_()
    ref = F.cross_entropy(
        lr.reshape(-1, VOCAB), target.reshape(-1), reduction="none",
        label_smoothing=label_smoothing * VOCAB / (VOCAB - 1),
    ).view(SEQ, BATCH)  # fmt: skip
    ref.backward(g)
    # log-sum-exp and softmax are computed in another order than PyTorch's kernel (and summed over ranks)
    return [
        Comparison(name, "loss", loss, ref, False),
        Comparison(name, "logits grad", logits.grad, shard(_grad(lr), 2, rank, world), False),
    ]


def _per_rank(
    shape: Sequence[int], seed: int, world: int, device: torch.device | str
) -> list[torch.Tensor]:
    return [randn(shape, seed + 1000 * r, device) for r in range(world)]


def compare_mappings(
    group: ProcessGroup | None, device: torch.device | str = "cpu"
) -> list[Comparison]:
    """Every region function: forward and backward against stack/sum/cat/slice of all ranks' tensors."""
    world, rank = group_world_size(group), group_rank(group)
    hp, sp = HIDDEN // world, SEQ // world
    last = slice(rank * hp, (rank + 1) * hp)
    first = slice(rank * sp, (rank + 1) * sp)
    out: list[Comparison] = []

    def run(name: str, fn, given, expected, exact, param=False) -> None:  # noqa: ANN001
        """``given`` (input, output grad), ``expected`` (output, input grad), ``exact`` (forward, backward)."""
        x_in, grad_in = given
        x = torch.nn.Parameter(x_in.clone()) if param else x_in.clone().requires_grad_()
        y = fn(x)
        y.backward(grad_in)
        out.append(Comparison(name, "forward", y, expected[0], exact[0]))
        out.append(Comparison(name, "backward", x.grad, expected[1], exact[1]))

    full = _per_rank([SEQ, BATCH, HIDDEN], 20, world, device)  # rank r's [s, b, h]
    g_full = _per_rank([SEQ, BATCH, HIDDEN], 30, world, device)
    g_last = _per_rank([SEQ, BATCH, hp], 40, world, device)  # rank r's [s, b, h/p]
    g_first = _per_rank([sp, BATCH, HIDDEN], 50, world, device)  # rank r's [s/p, b, h]
    one = world == 1  # sums over ranks are exact only for a single term
    total = torch.stack(full).sum(0)
    g_total = torch.stack(g_full).sum(0)

    def copy(x):  # noqa: ANN001, ANN202
        return copy_to_tensor_model_parallel_region(x, group)

    run("copy_to_tensor_model_parallel_region", copy, (full[rank], g_full[rank]), (full[rank], g_total),
        (True, one))  # fmt: skip
    run("copy_to_tensor_model_parallel_region(Parameter)", copy, (full[rank], g_full[rank]), (full[rank], g_total),
        (True, one), param=True)  # fmt: skip
    run("reduce_from_tensor_model_parallel_region", lambda x: reduce_from_tensor_model_parallel_region(x, group),
        (full[rank], g_full[rank]), (total, g_full[rank]), (one, True))  # fmt: skip
    run("scatter_to_tensor_model_parallel_region", lambda x: scatter_to_tensor_model_parallel_region(x, group),
        (full[0], g_last[rank]), (full[0][..., last], torch.cat(g_last, -1)), (True, True))  # fmt: skip
    run("gather_from_tensor_model_parallel_region", lambda x: gather_from_tensor_model_parallel_region(x, group),
        (full[rank][..., :hp], g_full[rank]), (torch.cat([f[..., :hp] for f in full], -1), g_full[rank][..., last]),
        (True, True))  # fmt: skip
    run("scatter_to_sequence_parallel_region", lambda x: scatter_to_sequence_parallel_region(x, group),
        (full[0], g_first[rank]), (full[0][first], torch.cat(g_first, 0)), (True, True))  # fmt: skip
    run("gather_from_sequence_parallel_region", lambda x: gather_from_sequence_parallel_region(x, True, group),
        (full[rank][:sp], g_full[rank]), (torch.cat([f[:sp] for f in full], 0), g_total[first]),
        (True, one))  # fmt: skip
    run("gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)",
        lambda x: gather_from_sequence_parallel_region(x, False, group), (full[rank][:sp], g_full[rank]),
        (torch.cat([f[:sp] for f in full], 0), g_full[rank][first]), (True, True))  # fmt: skip
    run("reduce_scatter_to_sequence_parallel_region",
        lambda x: reduce_scatter_to_sequence_parallel_region(x, group), (full[rank], g_first[rank]),
        (total[first], torch.cat(g_first, 0)), (one, True))  # fmt: skip
    return out


def all_comparisons(
    group: ProcessGroup | None, device: torch.device | str = "cpu"
) -> list[Comparison]:
    """Every check of the self-check on one TP group."""
    comps = compare_mappings(group, device)
    for kwargs in (
        {},
        {"gather_output": True},
        {"gather_output": True, "stride": 2},
        {"sequence_parallel": True},
        {"skip_bias_add": True, "stride": 2},
    ):
        comps += compare_column_parallel_linear(group, device=device, **kwargs)
    for kwargs in (
        {},
        {"input_is_parallel": False},
        {"input_is_parallel": False, "stride": 2},
        {"sequence_parallel": True},
        {"sequence_parallel": True, "skip_bias_add": True},
    ):
        comps += compare_row_parallel_linear(group, device=device, **kwargs)
    comps += compare_vocab_parallel_embedding(group, device=device)
    comps += compare_vocab_parallel_cross_entropy(group, device=device)
    comps += compare_vocab_parallel_cross_entropy(group, label_smoothing=0.1, device=device)
    return comps


def check_groups(state: ParallelState) -> list[tuple[str, bool, str]]:
    """Each group of this rank has the ranks ``rank_grid`` lists, and an all-reduce over it sums those ranks."""
    rows = []
    for kind, group in state.groups.items():
        expected = state.grid.group_of(kind, state.rank)
        if group is None:
            rows.append((f"group {kind}", expected is None, "rank in no group"))
            continue
        ranks = dist.get_process_group_ranks(group)
        total = torch.tensor([float(state.rank)])
        all_reduce_sum_(total, group)
        ok = ranks == expected and float(total) == float(sum(expected or []))
        rows.append((f"group {kind}", ok, f"{ranks}"))
    return rows


def _rank_main(tp: int, pp: int) -> list[tuple[str, str, bool, bool, float]]:
    state = initialize_model_parallel(tp, pp)
    rows = [(name, "ranks + all-reduce", True, ok, 0.0) for name, ok, _ in check_groups(state)]
    for c in all_comparisons(state.get_tensor_model_parallel_group()):
        rows.append((c.check, c.quantity, c.exact, c.passed(), c.error()))
    return rows


def run_selfcheck(world_size: int, tp: int, pp: int) -> tuple[bool, str]:
    """Spawn ``world_size`` CPU ranks, run every check; returns (all passed, the PASS/FAIL table)."""
    validate_degrees(world_size, tp, pp)
    start = time.monotonic()
    per_rank = spawn_local_ranks(_rank_main, world_size, tp, pp, timeout=300, backend="gloo")
    worst: dict[tuple[str, str], tuple[bool, bool, float]] = {}
    for rows in per_rank:
        for check, quantity, exact, ok, err in rows:
            prev = worst.get((check, quantity), (exact, True, 0.0))
            worst[(check, quantity)] = (exact, prev[1] and ok, max(prev[2], err))
    by_check: dict[str, list[tuple[str, bool, bool, float]]] = {}
    for (check, quantity), (exact, ok, err) in worst.items():
        by_check.setdefault(check, []).append((quantity, exact, ok, err))
    grid = rank_grid(world_size, tp, pp)
    lines = [
        f"mpu self-check: world {world_size}, tp {tp}, pp {pp}, dp {grid.data_parallel_size} "
        f"(gloo, {time.monotonic() - start:.1f} s). exact: bit-identical to the reference; "
        f"rtol: a reduction over ranks on the path, max error / max value <= {RTOL:g}",
        f"{'check':<86} {'exact':>5} {'rtol':>5} {'worst rtol':>10}  result",
    ]
    for check, items in by_check.items():
        n_exact = sum(1 for _, exact, _, _ in items if exact)
        n_rtol = len(items) - n_exact
        worst_rtol = max((err for _, exact, _, err in items if not exact), default=0.0)
        failed = [q for q, _, ok, _ in items if not ok]
        result = "PASS" if not failed else f"FAIL ({', '.join(failed)})"
        lines.append(f"{check:<86} {n_exact:>5} {n_rtol:>5} {worst_rtol:>10.1e}  {result}")
    passed = all(ok for _, ok, _ in worst.values())
    n_fail = sum(not ok for _, ok, _ in worst.values())
    summary = "ALL PASS" if passed else f"{n_fail} FAILED"
    lines.append(
        f"{summary}: {len(worst)} quantities in {len(by_check)} checks, on each of {world_size} ranks"
    )
    return passed, "\n".join(lines)
