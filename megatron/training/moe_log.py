"""Per-layer expert load of an MoE model for the log: tokens routed to each expert and tokens dropped, per step.

Each rank's MoE layers count what their gate routed in this step's training forwards (``MoEMLP.read_load``: every
expert of the layer, over the rank's local tokens). :func:`collect_expert_load` sums them over the whole job: over
data-parallel ranks (their tokens differ) and pipeline stages (each holds its own layers, the rest add zeros),
divided by the TP size (TP ranks route the same tokens). The result is the same on every rank: the global batch's
load, which the metrics file and TensorBoard record (``metrics.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.model.moe import moe_layers
from megatron.mpu.mappings import all_reduce_sum_, communication_device


@dataclass(frozen=True)
class ExpertLoad:
    """Expert load of one step (global batch), per MoE layer."""

    layers: tuple[int, ...]
    """0-based index of each MoE layer."""
    tokens_per_expert: tuple[tuple[int, ...], ...]
    """Per layer: (token, expert) routings to each expert (top-2 counts each token twice), before dropping."""
    dropped_tokens: tuple[int, ...]
    """Per layer: routings beyond an expert's capacity (0 with --disable-moe-token-dropping)."""

    def as_dict(self) -> dict[str, list]:
        """The metrics-file form (JSON lists)."""
        return {
            "layers": list(self.layers),
            "tokens_per_expert": [list(t) for t in self.tokens_per_expert],
            "dropped_tokens": list(self.dropped_tokens),
        }


def collect_expert_load(
    model: torch.nn.Module, num_layers: int, experts: tuple[int, ...], *, tp_size: int
) -> ExpertLoad | None:
    """The step's :class:`ExpertLoad` on every rank (a collective: every rank calls it each step); None for a
    dense model.

    Args:
        model: this rank's module (its MoE layers, ``MoEMLP``, hold this step's counts; reading resets them).
        num_layers: L of the whole model.
        experts: experts of each layer 0..L-1 (``MoEConfig.experts_per_layer``).
        tp_size: the run's TP size (its ranks route the same tokens: the sum counts them ``tp_size`` times).
    """
    moe_ids = [i for i in range(num_layers) if experts[i] > 1]
    if not moe_ids:
        return None
    width = max(experts) + 1  # per layer: E counts, then the dropped tokens
    table = torch.zeros(len(moe_ids), width, dtype=torch.float64)
    for layer in moe_layers(model):
        counts, dropped = layer.read_load()
        row = moe_ids.index(layer.layer_number)
        table[row, : counts.numel()] = counts
        table[row, -1] = dropped
    if dist.is_available() and dist.is_initialized():
        device = communication_device(dist.group.WORLD)
        summed = all_reduce_sum_(table.to(device), group=dist.group.WORLD).cpu()
        table = summed / tp_size
    rows = table.round().to(torch.int64).tolist()
    return ExpertLoad(
        layers=tuple(moe_ids),
        tokens_per_expert=tuple(tuple(r[: experts[i]]) for r, i in zip(rows, moe_ids, strict=True)),
        dropped_tokens=tuple(r[-1] for r in rows),
    )
