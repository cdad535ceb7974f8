"""DeepSpeed-MoE expert parameters: their names, which expert-parallel rank holds which expert, and how they are
split over tensor-parallel ranks (pure functions of names and sizes, like the rest of ``megatron.layout``).

Legend: ``E`` experts of a layer, ``ep`` expert-parallel size, ``El = E / ep`` local experts per EP rank, ``p`` TP
size, ``f`` expert FFN width, ``h`` hidden.

Names (Megatron-DeepSpeed's, from DeepSpeed's ``MoE`` module in place of ``mlp``)::

    language_model.encoder.layers.{i}.mlp.deepspeed_moe.gate.wg.weight                                  [E, h]
    language_model.encoder.layers.{i}.mlp.deepspeed_moe.experts.deepspeed_experts.{j}.dense_h_to_4h.weight
    language_model.encoder.layers.{i}.mlp.deepspeed_moe.experts.deepspeed_experts.{j}.dense_4h_to_h.weight

In a model on EP rank ``r`` the index ``j`` is LOCAL (``0 <= j < El``); the expert's global id is ``r * El + j``
(DeepSpeed's ``_save_moe_checkpoint`` / ``load_moe_state_dict``). A full (layout-free) state dict and DeepSpeed's
expert files use global ids. EP rank ``r`` is the data-parallel rank modulo ``ep`` (DeepSpeed's
``_get_expert_parallel_ranks``: each DP group is cut into consecutive EP groups), e.g. dp = 4, ep = 2, E = 4::

    DP rank        0        1        2        3
    EP rank        0        1        0        1
    experts     {0, 1}   {2, 3}   {0, 1}   {2, 3}      (expert-data-parallel pairs: DP ranks {0, 2}, {1, 3})

Tensor parallelism: the router ``gate.wg`` is replicated on every TP rank. The experts are replicated too (every
TP rank holds whole experts) unless ``--enable-expert-tensor-parallelism``, which splits each expert's MLP like the
dense one (``dense_h_to_4h`` dim 0 with the SwiGLU stride 2, ``dense_4h_to_h`` dim 1).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from megatron.config.model import ModelConfig
from megatron.layout.names import ENCODER_PREFIX, layer_prefix
from megatron.layout.tensor_parallel import Partition, tp_partition

MOE_EXPERTS = "mlp.deepspeed_moe.experts.deepspeed_experts"
"""Key infix of DeepSpeed-MoE expert parameters (``{layer}.{MOE_EXPERTS}.{expert id}.{linear}.{weight|bias}``)."""
MOE_GATE = "mlp.deepspeed_moe.gate.wg.weight"
"""Layer-relative name of the router weight."""

_EXPERT_RE = re.compile(rf"(.*\.{re.escape(MOE_EXPERTS)}\.)(\d+)(\..+)")
_LAYER_RE = re.compile(rf"{re.escape(ENCODER_PREFIX)}\.layers\.(\d+)\.")


def gate_key(i: int) -> str:
    """Router weight of layer ``i``: ``language_model.encoder.layers.{i}.mlp.deepspeed_moe.gate.wg.weight``."""
    return f"{layer_prefix(i)}.{MOE_GATE}"


def expert_key(i: int, e: int, linear: str, kind: str = "weight") -> str:
    """``kind`` (weight/bias) of ``linear`` (``dense_h_to_4h`` / ``dense_4h_to_h``) of expert ``e`` of layer ``i``."""
    return f"{layer_prefix(i)}.{MOE_EXPERTS}.{e}.{linear}.{kind}"


def expert_id(key: str) -> int | None:
    """The expert index in a DeepSpeed-MoE expert parameter name (None: not an expert parameter)."""
    m = _EXPERT_RE.fullmatch(key)
    return int(m.group(2)) if m else None


def with_expert_id(key: str, new_id: int) -> str:
    """``key`` with its expert index replaced (local <-> global).

    Raises:
        ValueError: ``key`` is not an expert parameter.
    """
    m = _EXPERT_RE.fullmatch(key)
    if m is None:
        raise ValueError(f"'{key}' is not a DeepSpeed-MoE expert parameter.")
    return f"{m.group(1)}{new_id}{m.group(3)}"


def is_moe_key(key: str) -> bool:
    """Whether ``key`` belongs to a DeepSpeed-MoE layer (router or expert)."""
    return ".mlp.deepspeed_moe." in key or key.startswith("mlp.deepspeed_moe.")


def _experts_of_layer(key: str, config: ModelConfig) -> int:
    m = _LAYER_RE.match(key)
    if m is None:
        raise ValueError(
            f"'{key}' is not a Megatron layer parameter (language_model.encoder.layers.*)."
        )
    return config.moe.experts_per_layer(config.num_layers)[int(m.group(1))]


def check_expert_parallel(config: ModelConfig, ep: int, flag: str = "--ep") -> None:
    """Every MoE layer's expert count divides by ``ep``.

    Raises:
        ValueError: naming ``flag``, the counts and the sizes that work.
    """
    counts = sorted({n for n in config.moe.experts_per_layer(config.num_layers) if n > 1})
    if ep < 1:
        raise ValueError(f"{flag} ({ep}) must be >= 1.")
    if ep > 1 and not counts:
        raise ValueError(f"{flag} ({ep}) needs an MoE model; this model has no MoE layer, use 1.")
    bad = [n for n in counts if n % ep]
    if bad:
        ok = [d for d in range(1, min(counts) + 1) if all(n % d == 0 for n in counts)]
        raise ValueError(
            f"{flag} ({ep}) must divide every MoE layer's expert count ({counts}); use one of {ok}."
        )


def local_experts(
    full: Mapping[str, torch.Tensor], config: ModelConfig, *, ep: int, ep_rank: int
) -> dict[str, torch.Tensor]:
    """The state dict of EP rank ``ep_rank``: every non-expert tensor, and the experts it holds renamed to local
    indices (global ``ep_rank * El + j`` -> ``j``). The tensors are the same objects (no copy)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in full.items():
        e = expert_id(key)
        if e is None:
            out[key] = t
            continue
        local = _experts_of_layer(key, config) // ep
        if e // local == ep_rank:
            out[with_expert_id(key, e % local)] = t
    return out


def global_experts(
    per_ep_rank: Sequence[Mapping[str, torch.Tensor]], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`local_experts`: one state dict from the ``ep`` ranks' (in EP-rank order; non-expert
    tensors taken from rank 0)."""
    ep = len(per_ep_rank)
    out: dict[str, torch.Tensor] = {}
    for r, sd in enumerate(per_ep_rank):
        for key, t in sd.items():
            e = expert_id(key)
            if e is None:
                if r == 0:
                    out[key] = t
                continue
            local = _experts_of_layer(key, config) // ep
            out[with_expert_id(key, r * local + e)] = t
    return out


def moe_partition(config: ModelConfig, *, expert_tensor_parallel: bool) -> Partition:
    """The TP split rule of a model with DeepSpeed-MoE layers: :func:`tp_partition` extended with the router
    (replicated), PR-MoE's ``mlp.coefficient`` (replicated; its ``mlp.mlp.*`` is a dense TP MLP) and the experts
    (replicated, or split like the dense MLP with ``expert_tensor_parallel``)."""

    def rule(key: str) -> tuple[int, int] | None:
        if expert_id(key) is not None:
            if not expert_tensor_parallel or key.endswith("dense_4h_to_h.bias"):
                return None
            if key.endswith("dense_4h_to_h.weight"):
                return (1, 1)
            return (0, 2 if config.swiglu else 1)
        if key.endswith(MOE_GATE) or re.match(r"(.*\.)?mlp\.coefficient\.(weight|bias)$", key):
            return None
        return tp_partition(key, config)

    return rule


def _expert_layer(key: str) -> int | None:
    """The layer of an expert parameter (None: not an expert parameter)."""
    m = _LAYER_RE.match(key)
    return int(m.group(1)) if m and expert_id(key) is not None else None


def to_global_expert(key: str, config: ModelConfig, *, ep: int, ep_rank: int) -> str:
    """``key`` of a model on EP rank ``ep_rank`` (of ``ep``) with its expert index made global (``ep_rank * El +
    j``); non-expert keys unchanged."""
    e = expert_id(key)
    if e is None:
        return key
    return with_expert_id(key, ep_rank * (_experts_of_layer(key, config) // ep) + e)


def expert_order_at(
    names: Sequence[str], config: ModelConfig, *, ep: int, ep_rank: int
) -> list[str]:
    """``names`` (one optimizer group's parameters in order, global expert ids, as the model at some EP size lists
    them) as the same group lists them on EP rank ``ep_rank`` of size ``ep``: every run of one layer's expert
    parameters becomes that rank's experts (global ids ``ep_rank * El`` .. ``(ep_rank + 1) * El - 1``), each with
    the parameters of the run's first expert in their order. A group lists a layer's experts one after the other
    (``named_parameters`` order of DeepSpeed's ``deepspeed_experts`` list), so the runs are whole. E.g. E = 4::

        ep 1:   a  x.0.w1 x.0.w2 x.1.w1 x.1.w2 x.2.w1 x.2.w2 x.3.w1 x.3.w2  b
        ep 2, rank 1:   a  x.2.w1 x.2.w2 x.3.w1 x.3.w2  b
    """
    out: list[str] = []
    i = 0
    while i < len(names):
        first = expert_id(names[i])
        if first is None:
            out.append(names[i])
            i += 1
            continue
        local = (
            _experts_of_layer(names[i], config) // ep
        )  # (a ValueError for a key outside the layers)
        end = i
        while end < len(names) and _expert_layer(names[end]) == _expert_layer(names[i]):
            end += 1
        pattern = [n for n in names[i:end] if expert_id(n) == first]
        for g in range(ep_rank * local, (ep_rank + 1) * local):
            out.extend(with_expert_id(n, g) for n in pattern)
        i = end
    return out
