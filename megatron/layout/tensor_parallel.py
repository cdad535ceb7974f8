"""How every parameter is split over tensor-parallel ranks (the one rule), and resharding of state dicts by it.

Which dimension each Megatron parameter is split on (``p`` = TP size, ``r`` = TP rank)::

    word_embeddings.weight, output_layer.weight   [vpad, h]        dim 0 (vocab rows [r*vpad/p, (r+1)*vpad/p))
    query_key_value.{weight,bias}                 [(n+2G)*hn, h]    dim 0, contiguous (K/V groups [r*G/p, ...))
    mlp.dense_h_to_4h.{weight,bias}               [ffn, h]          dim 0
        with --swiglu                             [2*ffn, h]        dim 0, stride 2: full [gate; up],
                                                                    shard r = [gate_r; up_r]
    self_attention.dense.weight                   [h, n*hn]         dim 1 (row-parallel)
    mlp.dense_4h_to_h.weight                      [h, ffn]          dim 1 (row-parallel)
    norms (q_layernorm, k_layernorm too), row-parallel biases,
    position_embeddings                                             replicated
    LoRA (--lora-rank): <column linear>.lora_b    [o, r]            dim 0, the linear's stride
                        <row linear>.lora_a       [r, h]            dim 1
                        <column linear>.lora_a, <row linear>.lora_b replicated

``merge_tp_shards(shard_state_dict(x, p, r) for r in range(p)) == x`` exactly (no arithmetic, only slicing).

The rule is written once, as the regular expressions DeepSpeed's ``ds_to_universal`` reads (they match both the
Megatron names and ``GPTModelPipe``'s, see :mod:`megatron.layout.universal_info`); :func:`tp_partition` and
:func:`param_layout` read them for offline tools, and the TP layers carry the same facts as attributes
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``), which a test compares.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import torch

from megatron.config.model import ModelConfig
from megatron.config.rules import check_tensor_parallel_split
from megatron.layout.vocab import is_vocab_rows

ROW_PARALLEL_PATTERNS = [
    r".*self_attention\.dense\.weight$",
    r".*mlp\.dense_4h_to_h\.weight$",
    r".*(self_attention\.dense|mlp\.dense_4h_to_h)\.lora_a$",
]
"""Split on dim 1 (the input features)."""
VOCABULARY_PATTERNS = [
    r".*word_embeddings\.weight$",
    r".*output_layer\.weight$",
    r".*lm_head\.weight$",
]
"""Split on dim 0, rows = the (padded) vocabulary."""
COLUMN_PARALLEL_PATTERNS = [
    r".*self_attention\.query_key_value\.(weight|bias|lora_b)$",
    r".*mlp\.dense_h_to_4h\.(weight|bias|lora_b)$",
    *VOCABULARY_PATTERNS,
]
"""Split on dim 0 (the output features)."""
SWIGLU_PATTERNS = [r".*mlp\.dense_h_to_4h\.(weight|bias|lora_b)$"]
"""With --swiglu: two sub-parameters [gate; up] concatenated on dim 0 (partition stride 2)."""
PIPELINE_REPLICATED_PATTERNS = [r"tied_modules\.embed\.word_embeddings\.weight$"]
"""Held by the first and the last pipeline stage (the tied word embeddings)."""


def tp_replicated_patterns(num_layers: int) -> list[str]:
    """Parameters identical on every TP rank (the pipeline's final norm is the bare layer ``{L+2}``)."""
    return [
        r".*position_embeddings\.weight$",
        r".*(input_layernorm|post_attention_layernorm|final_layernorm)\.(weight|bias)$",
        r".*self_attention\.(q_layernorm|k_layernorm)\.(weight|bias)$",
        r".*(self_attention\.dense|mlp\.dense_4h_to_h)\.bias$",
        r".*(self_attention\.query_key_value|mlp\.dense_h_to_4h)\.lora_a$",
        r".*(self_attention\.dense|mlp\.dense_4h_to_h)\.lora_b$",
        rf"{num_layers + 2}\.(weight|bias)$",
    ]


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(re.match(p, name) for p in patterns)


def tp_partition(key: str, model_config: ModelConfig) -> tuple[int, int] | None:
    """How the parameter ``key`` (Megatron or ``GPTModelPipe`` name) is split over TP ranks.

    Returns:
        ``(partition_dim, partition_stride)``, or ``None`` for a parameter replicated on every TP rank.

    Raises:
        ValueError: ``key`` is not a parameter name of the GPT model.
    """
    if _matches(key, tp_replicated_patterns(model_config.num_layers)):
        return None
    if _matches(key, ROW_PARALLEL_PATTERNS):
        return (1, 1)
    if _matches(key, COLUMN_PARALLEL_PATTERNS):
        return (0, 2 if model_config.swiglu and _matches(key, SWIGLU_PATTERNS) else 1)
    raise ValueError(
        f"don't know how '{key}' is tensor-parallel sharded; it is not a Megatron GPT parameter name "
        "(see megatron/layout/tensor_parallel.py for the known ones)."
    )


def param_layout(name: str, config: ModelConfig) -> tuple[bool, int, int]:
    """``(tensor_parallel, partition_dim, stride)`` of a parameter from its name alone (either naming scheme):
    the attributes the TP layers set. Replicated parameters give ``(False, -1, 1)``."""
    part = tp_partition(name, config)
    return (False, -1, 1) if part is None else (True, part[0], part[1])


def _check_tp(tp: int, tp_rank: int | None = None) -> None:
    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size ({tp}) must be >= 1.")
    if tp_rank is not None and not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank ({tp_rank}) must be in [0, {tp}).")


Partition = Callable[[str], "tuple[int, int] | None"]
"""``key -> (partition_dim, stride)`` or None (replicated): :func:`tp_partition` of a config, or a rule that extends
it (DeepSpeed-MoE parameters: ``megatron.layout.experts.moe_partition``)."""


def _check_divisible(
    full: Mapping[str, torch.Tensor], model_config: ModelConfig, tp: int, partition: Partition
) -> None:
    check_tensor_parallel_split(model_config, tp)
    for key, t in full.items():
        part = partition(key)
        if part is None:
            continue
        dim, stride = part
        if t.shape[dim] % (tp * stride):
            what = "padded vocab rows" if is_vocab_rows(key) else f"dim {dim}"
            fix = (
                " Re-pad it with repad_vocab(t, true_vocab, padded_vocab_size(true_vocab, divisible_by, tp))."
                if is_vocab_rows(key)
                else ""
            )
            raise ValueError(
                f"'{key}' {what} ({t.shape[dim]}) is not divisible by "
                f"{tp * stride} (--tensor-model-parallel-size {tp} x stride {stride}).{fix}"
            )


def _shard(t: torch.Tensor, dim: int, stride: int, tp: int, rank: int) -> torch.Tensor:
    chunks = torch.chunk(
        t, stride * tp, dim=dim
    )  # [.., D, ..] -> stride*tp x [.., D/(stride*tp), ..]
    return torch.cat([chunks[s * tp + rank] for s in range(stride)], dim=dim).clone()


def shard_state_dict(
    full_sd: Mapping[str, torch.Tensor],
    model_config: ModelConfig,
    tp: int,
    tp_rank: int,
    *,
    partition: Partition | None = None,
) -> dict[str, torch.Tensor]:
    """The TP rank ``tp_rank`` shard of a full (TP=1) Megatron state dict.

    Args:
        full_sd: Megatron names -> full tensors (padded vocab rows divisible by ``tp``).
        model_config: the architecture (``swiglu`` decides the stride of ``dense_h_to_4h``).
        tp: TP size ``p``.
        tp_rank: ``r`` in ``[0, p)``.
        partition: the split rule (default :func:`tp_partition` of ``model_config``).

    Returns:
        Same keys; every tensor a fresh contiguous copy (safe to save: no view of the full storage).
    """
    rule = partition or (lambda key: tp_partition(key, model_config))
    _check_tp(tp, tp_rank)
    _check_divisible(full_sd, model_config, tp, rule)
    out: dict[str, torch.Tensor] = {}
    for key, t in full_sd.items():
        part = rule(key)
        out[key] = t.clone() if part is None else _shard(t, part[0], part[1], tp, tp_rank)
    return out


def merge_tp_shards(
    shards: Sequence[Mapping[str, torch.Tensor]],
    model_config: ModelConfig,
    *,
    check_replicated: bool = True,
    partition: Partition | None = None,
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`shard_state_dict`: the full state dict from all TP shards, in rank order.

    Args:
        shards: ``p`` state dicts with identical keys, ``shards[r]`` from TP rank ``r``.
        model_config: the architecture.
        check_replicated: require replicated tensors to be bitwise equal on every rank (they are in a
            correct run); ``False`` takes rank 0's copy.
        partition: the split rule (default :func:`tp_partition` of ``model_config``).

    Raises:
        ValueError: missing/extra keys across shards, or diverged replicated tensors.
    """
    if not shards:
        raise ValueError("merge_tp_shards needs at least one shard.")
    tp = len(shards)
    keys = list(shards[0])
    for r, shard in enumerate(shards[1:], start=1):
        if set(shard) != set(keys):
            diff = sorted(set(shard) ^ set(keys))[:5]
            raise ValueError(f"TP shard {r} has different keys from shard 0 (e.g. {diff}).")
    rule = partition or (lambda key: tp_partition(key, model_config))
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        part = rule(key)
        if part is None:
            ref = shards[0][key]
            if check_replicated:
                for r in range(1, tp):
                    if not torch.equal(shards[r][key], ref):
                        raise ValueError(
                            f"replicated parameter '{key}' differs between TP rank 0 and rank {r}; "
                            "the checkpoint is inconsistent (pass check_replicated=False to take rank 0's)."
                        )
            out[key] = ref.clone()
            continue
        dim, stride = part
        # each shard: stride pieces along dim; full = [piece s of rank 0, ..., piece s of rank p-1] for s = 0..
        pieces = [torch.chunk(shards[r][key], stride, dim=dim) for r in range(tp)]
        out[key] = torch.cat([pieces[r][s] for s in range(stride) for r in range(tp)], dim=dim)
    return out
