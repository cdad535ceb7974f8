"""Tensor-parallel self-attention: fused QKV (per-KV-group interleaved), RoPE, MHA/GQA, SDPA or reference path.

Legend: ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``n`` query heads, ``g`` key/value groups, ``p`` TP size,
``np = n/p``, ``gp = g/p``, ``hn`` head dim, ``r = n/g`` query heads per group.

Fused QKV layout (what Megatron's converters read and write; compat doc 4.3). The full (TP=1) weight of
``query_key_value`` has ``(n + 2g) * hn`` rows, grouped per KV group ``j = 0 .. g-1``::

    [ q heads j*r .. j*r+r-1  (r*hn rows) | k_j (hn rows) | v_j (hn rows) ]   for j = 0, 1, ..., g-1

A column-parallel split into ``p`` contiguous chunks gives TP rank ``t`` the groups ``t*gp .. (t+1)*gp-1``, so each
rank's local output ``[s, b, gp*(r+2)*hn]`` is viewed as ``[s, b, gp, r+2, hn]`` and split ``[r, 1, 1]``. For MHA
(``r = 1``) this is Megatron's classic per-head ``[q_h; k_h; v_h]`` interleave. Query head ``i`` uses K/V group
``i // r`` (``repeat_interleave`` semantics, as HF ``repeat_kv`` and SDPA's ``enable_gqa``).

QKV bias (``--add-qkv-bias``, or every linear's bias): one ``[(n + 2g) * hn]`` vector in the same row layout, so
it splits over TP with the weight. QK-norm (``--qk-layernorm``, Qwen3): ``q_layernorm`` and ``k_layernorm``, each one
``[hn]`` weight shared by all heads, normalize every query and key head over its ``hn`` channels after the split and
before RoPE. They are replicated over TP, but each TP rank normalizes its own heads, so each rank's weight gradient
is a partial sum: it is summed over TP (the norm's ``sequence_parallel`` switch, whose backward all-reduce is the
same), with or without sequence parallelism.

Attention is causal; ``--window-size L`` (sliding window) lets query ``i`` see keys ``i - L .. i`` only: the
explicit mask of :func:`window_mask`, used by both paths (SDPA takes it as ``attn_mask``; no kernel here expresses a
window on its own), skipped when the window reaches back over every key (``L >= S - 1``). Default path: ``torch.nn.functional.scaled_dot_product_attention`` (flash kernels on GPU);
``use_flash_attn=False`` selects an explicit softmax(QK^T/sqrt(hn))V path (fp32 scores and softmax), whose scaled,
masked softmax is one fused kernel where built (unless ``--no-masked-softmax-fusion``). Attention dropout
runs under ``get_cuda_rng_tracker().fork()`` (it acts on TP-sharded heads).

DeepSpeed-Ulysses (a ``ParallelContext`` with ``sp_group``): the block sees ``s/N`` tokens; the core attention runs
through ``model/ulysses.py`` (all-to-all to ``[s, b, np/N, hn]``, attention, all-to-all back), after RoPE.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron import fused_kernels
from megatron.config import ModelConfig
from megatron.layout.names import layer_param_name
from megatron.model.context_parallel import context_attention
from megatron.model.inference import InferenceParams
from megatron.model.lora import maybe_add_lora
from megatron.model.norms import norm_class
from megatron.model.rotary import apply_rotary_pos_emb
from megatron.model.token_layout import PackedDocuments
from megatron.model.ulysses import UlyssesAttention
from megatron.model.utils import init_seed
from megatron.mpu.context import ParallelContext
from megatron.mpu.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    WeightInit,
    init_method_normal,
    scaled_init_method_normal,
)
from megatron.mpu.random import checkpoint, get_cuda_rng_tracker

AttentionMask = torch.Tensor | PackedDocuments | None
"""What a model, its layers and attention take as ``attention_mask``: None (causal), a dense bool
``[b or 1, 1, s, s]`` mask (True = masked), or packed documents' ids (``token_layout.PackedDocuments``)."""


def _expand_kv(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """``[s, b, gp, hn] -> [s, b, gp*repeats, hn]``: each K/V group repeated for its ``repeats`` query heads."""
    return x if repeats == 1 else x.repeat_interleave(repeats, dim=2)


def window_mask(s: int, total: int, left: int, device: torch.device) -> torch.Tensor:
    """Causal sliding-window mask, bool ``[1, 1, s, S]`` (True = masked), for the last ``s`` of ``S = total``
    positions (``s = S`` in training; the new tokens after the KV cache in generation): query ``i`` (absolute
    ``S - s + i``) sees keys ``S - s + i - left .. S - s + i``."""
    q = torch.arange(total - s, total, device=device).view(s, 1)  # [s, 1] absolute query positions
    k = torch.arange(total, device=device).view(1, total)  # [1, S]
    return ((k > q) | (k < q - left)).view(1, 1, s, total)  # [s, S] -> [1, 1, s, S]


def with_window(
    mask: torch.Tensor | None, s: int, total: int, left: int | None, device: torch.device
) -> torch.Tensor | None:
    """``mask`` (None = causal) with the sliding window of ``left`` keys added, or ``mask`` itself when there is
    no window or it reaches every key."""
    if left is None or left >= total - 1:
        return mask
    window = window_mask(s, total, left, device)
    return window if mask is None else mask | window  # [b or 1, 1, s, S]


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    fused_softmax: bool = False,
) -> torch.Tensor:
    """Plain causal attention, the math spelled out (``use_flash_attn=False``).

    Args:
        q: ``[s, b, np, hn]``; k, v: ``[S, b, gp, hn]`` with ``gp`` dividing ``np`` (``S = s`` except with a KV
            cache, where the mask must be given).
        attention_mask: None for causal (with ``s = 1`` query and ``S`` cached keys: it sees them all), else bool
            ``[b or 1, 1, s, S]``, True = masked (Megatron convention).
        dropout_p: dropout on the probabilities (the caller picks the RNG state).
        fused_softmax: the scaled, masked softmax as one kernel where built (same math; a fully masked row gives
            zeros either way).

    Returns:
        context ``[s, b, np*hn]``.
    """
    s, b, heads, hn = q.shape
    repeats = heads // k.shape[2]
    qh = q.permute(1, 2, 0, 3)  # [s, b, np, hn] -> [b, np, s, hn]
    kh = _expand_kv(k, repeats).permute(1, 2, 3, 0)  # [S, b, gp, hn] -> [b, np, hn, S]
    vh = _expand_kv(v, repeats).permute(1, 2, 0, 3)  # [S, b, gp, hn] -> [b, np, S, hn]
    scores = torch.matmul(qh.float(), kh.float())  # [b, np, s, S], scaled inside the softmax
    scale = 1.0 / math.sqrt(hn)
    if attention_mask is None and s == 1:  # one new query after the cache: nothing to mask
        probs = torch.softmax(scores * scale, dim=-1)
    elif attention_mask is None:
        probs = fused_kernels.scaled_upper_triang_masked_softmax(
            scores.view(b * heads, s, s), scale, fused=fused_softmax
        ).view(b, heads, s, s)  # [b, np, s, s] -> [b*np, s, s] -> [b, np, s, s]
    else:
        probs = fused_kernels.scaled_masked_softmax(
            scores, attention_mask, scale, fused=fused_softmax
        )
    probs = probs.to(q.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    ctx = torch.matmul(probs, vh)  # [b, np, s, S] x [b, np, S, hn] -> [b, np, s, hn]
    return ctx.permute(2, 0, 1, 3).reshape(s, b, heads * hn)  # [b, np, s, hn] -> [s, b, np*hn]


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention through ``F.scaled_dot_product_attention``; same contract as :func:`reference_attention`."""
    s, b, heads, hn = q.shape
    qh = q.permute(1, 2, 0, 3)  # [s, b, np, hn] -> [b, np, s, hn]
    kh = k.permute(1, 2, 0, 3)  # [S, b, gp, hn] -> [b, gp, S, hn]
    vh = v.permute(1, 2, 0, 3)  # [S, b, gp, hn] -> [b, gp, S, hn]
    ctx = F.scaled_dot_product_attention(
        qh,
        kh,
        vh,
        attn_mask=None if attention_mask is None else ~attention_mask,
        dropout_p=dropout_p,
        is_causal=attention_mask is None and s > 1,  # one query after the cache sees every key
        enable_gqa=k.shape[2] != heads,
    )  # [b, np, s, hn]
    return ctx.permute(2, 0, 1, 3).reshape(s, b, heads * hn)  # [b, np, s, hn] -> [s, b, np*hn]


def _qk_norm(config: ModelConfig, parallel: ParallelContext) -> nn.Module:
    """A QK-norm over ``[*, hn]``: the model's norm kind and epsilon, weight replicated over TP with its gradient
    summed over TP (each rank normalizes its own heads; see the module docstring)."""
    return norm_class(config.normalization)(
        config.head_dim,
        eps=config.layernorm_epsilon,
        apply_layernorm_1p=config.apply_layernorm_1p,
        sequence_parallel=parallel.tp_size > 1,
        group=parallel.tp_group,
        params_dtype=parallel.params_dtype,
        device=parallel.device,
        fused=config.persist_layer_norm,
    )


class ParallelAttention(nn.Module):
    """Self-attention block: column-parallel fused QKV, RoPE, core attention, row-parallel output projection.

    Args:
        config: model shape (heads, groups, head dim, bias, dropout, flash, recompute, init std).
        parallel: the TP group the heads are split over; sequence parallelism (input and output
            ``[s/p, b, h]``, else full ``s``); the seed (weights from ``param_seed(seed, global name)``); dtype, device.
        layer_number: global 0-based layer index (names and seeds: ``layers.{i}.self_attention.*``).

    The forward returns ``(output, bias)`` like Megatron: the output projection's bias is NOT added (the caller's
    bias-dropout-add does it), ``bias`` is None with ``--disable-bias-linear``.
    """

    def __init__(
        self, config: ModelConfig, parallel: ParallelContext, *, layer_number: int
    ) -> None:
        super().__init__()
        self.tp_group = parallel.tp_group
        n, g, hn = config.num_attention_heads, config.num_query_groups, config.head_dim
        self.layer_number = layer_number
        self.head_dim = hn
        self.group_size = n // g
        self.attention_dropout = config.attention_dropout
        self.use_flash_attn = config.use_flash_attn
        self.masked_softmax_fusion = config.masked_softmax_fusion
        self.rope_fusion = config.apply_rope_fusion
        self.window_left = None if config.window_size is None else config.window_size[0]
        self.selective_recompute = config.recompute_granularity == "selective"
        # DeepSpeed-Ulysses: the core attention runs on all tokens and n/N heads (``ulysses.py``); no parameters.
        self.ulysses = None if parallel.sp_group is None else UlyssesAttention(parallel.sp_group)
        self.cp_group = (
            parallel.cp_group
        )  # context parallelism: K/V exchanged over it (``context_parallel.py``)

        def seed_of(suffix: str) -> int | None:
            return init_seed(
                config, parallel, layer_param_name(layer_number, f"self_attention.{suffix}")
            )

        self.query_key_value = ColumnParallelLinear(
            config.hidden_size,
            (n + 2 * g) * hn,
            bias=config.qkv_bias,
            gather_output=False,
            init=WeightInit(
                init_method_normal(config.init_method_std), seed_of("query_key_value.weight")
            ),
            tp=parallel.tp_settings,
        )
        self.dense = RowParallelLinear(
            n * hn,
            config.hidden_size,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            init=WeightInit(
                scaled_init_method_normal(config.init_method_std, config.num_layers),
                seed_of("dense.weight"),
            ),
            skip_bias_add=True,
            tp=parallel.tp_settings,
        )
        for linear, target, local in (
            (self.query_key_value, "qkv", "query_key_value"),
            (self.dense, "dense", "dense"),
        ):
            name = layer_param_name(layer_number, f"self_attention.{local}")
            maybe_add_lora(linear, config.lora, target, name=name, parallel=parallel)
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            self.q_layernorm, self.k_layernorm = (_qk_norm(config, parallel) for _ in range(2))

    def split_qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[s, b, gp*(r+2)*hn] -> q [s, b, np, hn], k [s, b, gp, hn], v [s, b, gp, hn]`` (layout above)."""
        s, b, width = mixed.shape
        r, hn = self.group_size, self.head_dim
        gp = width // ((r + 2) * hn)
        grouped = mixed.view(s, b, gp, r + 2, hn)  # [s, b, gp*(r+2)*hn] -> [s, b, gp, r+2, hn]
        q, k, v = torch.split(grouped, [r, 1, 1], dim=3)  # -> [s,b,gp,r,hn], [s,b,gp,1,hn] x2
        q = q.reshape(s, b, gp * r, hn)  # [s, b, gp, r, hn] -> [s, b, np, hn]
        return q, k.squeeze(3), v.squeeze(3)  # [s, b, gp, 1, hn] -> [s, b, gp, hn]

    def _core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        p = self.attention_dropout if self.training else 0.0
        s, total = q.shape[0], k.shape[0]
        attention_mask = with_window(attention_mask, s, total, self.window_left, q.device)
        kwargs = {} if self.use_flash_attn else {"fused_softmax": self.masked_softmax_fusion}
        fn = sdpa_attention if self.use_flash_attn else reference_attention
        if p == 0.0:
            return fn(q, k, v, attention_mask=attention_mask, **kwargs)
        with get_cuda_rng_tracker().fork():
            return fn(q, k, v, attention_mask=attention_mask, dropout_p=p, **kwargs)

    def _layout_core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | PackedDocuments | None,
    ) -> torch.Tensor:
        """Core attention under context parallelism or packed documents (``context_parallel.py``): no dense mask."""
        documents = attention_mask if isinstance(attention_mask, PackedDocuments) else None
        return context_attention(
            q, k, v, documents=documents, group=self.cp_group, window_left=self.window_left
        )

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | PackedDocuments | None,
    ) -> torch.Tensor:
        """The core attention ``[s, b, np*hn]``; under Ulysses over the whole sequence via all-to-alls."""
        by_layout = self.cp_group is not None or isinstance(attention_mask, PackedDocuments)
        core = self._layout_core if by_layout else self._core
        if self.ulysses is None:
            if isinstance(attention_mask, PackedDocuments) or by_layout:
                return self._layout_core(q, k, v, attention_mask)
            return self._core(q, k, v, attention_mask)
        # [s/N, b, np, hn] -> [s/N, b, np*hn]: all-to-all, core attention over s, all-to-all back
        return self.ulysses(core, q, k, v, attention_mask)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: AttentionMask = None,
        inference_params: InferenceParams | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Self-attention of ``hidden_states``.

        Args:
            hidden_states: ``[s, b, h]`` (``[s/p, b, h]`` under sequence parallelism, ``[s/N, b, h]`` under
                DeepSpeed-Ulysses, with ``rotary`` and the output likewise ``s/N``).
            rotary: ``(cos, sin)`` each ``[s, b, 1, hn]`` (see ``rotary_cos_sin``), or None for no RoPE.
            attention_mask: None = causal; bool ``[b or 1, 1, s, s]``, True = masked; or ``PackedDocuments``
                (``--reset-attention-mask`` without a dense mask: ``context_attention``).
            inference_params: KV cache for generation (``inference.py``): K/V of earlier tokens are reused and
                ``attention_mask`` is replaced by the cache's causal mask; None in training.

        Returns:
            ``(output [s, b, h] or [s/p, b, h], bias [h] or None)``.
        """
        mixed, _ = self.query_key_value(hidden_states)  # [s(/p), b, h] -> [s, b, gp*(r+2)*hn]
        q, k, v = self.split_qkv(mixed)
        if self.q_layernorm is not None and self.k_layernorm is not None:
            q = self.q_layernorm(q)  # [s, b, np, hn], each head over hn
            k = self.k_layernorm(k)  # [s, b, gp, hn]
        if rotary is not None:
            cos, sin = rotary
            q = apply_rotary_pos_emb(q, cos, sin, fused=self.rope_fusion)
            k = apply_rotary_pos_emb(k, cos, sin, fused=self.rope_fusion)
        if inference_params is not None:
            if self.ulysses is not None or self.cp_group is not None:
                raise RuntimeError(
                    "generation with a KV cache is not supported under --ds-sequence-parallel-size > 1 or "
                    "--context-parallel-size > 1; build the model for generation without them (CP = 1: "
                    "megatron/text_generation loads any checkpoint so)"
                )
            attention_mask = inference_params.attention_mask(q.shape[0], q.device)
            k, v = inference_params.update_kv(self.layer_number, k, v)  # -> [S, b, gp, hn]
        if self.selective_recompute and self.training:
            ctx = checkpoint(
                lambda q_, k_, v_: self._attend(q_, k_, v_, attention_mask),
                False,
                q,
                k,
                v,
                group=self.tp_group,
            )
        else:
            ctx = self._attend(q, k, v, attention_mask)  # [s, b, np*hn]
        return self.dense(ctx)  # [s, b, np*hn] -> [s(/p), b, h] (+ bias, not added)
