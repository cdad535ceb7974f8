"""Hugging Face Mixtral (``MixtralForCausalLM``) <-> Megatron full state dict with DeepSpeed-MoE layers.

Legend: ``h`` hidden, ``f`` expert FFN width (HF ``intermediate_size``), ``E`` experts per layer, ``L`` layers.

The full (layout-free) state dict has Megatron-DeepSpeed's names with GLOBAL expert ids ``e`` in ``[0, E)``::

    language_model.encoder.layers.{i}.mlp.deepspeed_moe.gate.wg.weight                               [E, h]
    language_model.encoder.layers.{i}.mlp.deepspeed_moe.experts.deepspeed_experts.{e}.dense_h_to_4h.weight
                                                                                       [2f, h] = [w1; w3]
    language_model.encoder.layers.{i}.mlp.deepspeed_moe.experts.deepspeed_experts.{e}.dense_4h_to_h.weight
                                                                                       [h, f]  = w2

HF stores a layer's experts in one of two forms, both read here:

- the Hub / ``save_pretrained`` form (transformers 4 and 5): ``model.layers.{i}.block_sparse_moe.gate.weight`` and
  ``block_sparse_moe.experts.{e}.w1/w2/w3.weight`` (``w1`` gate, ``w3`` up, ``w2`` down; no biases);
- transformers 5's in-memory form (``model.state_dict()``): ``model.layers.{i}.mlp.gate.weight`` and fused
  ``mlp.experts.gate_up_proj [E, 2f, h]`` (``[w1; w3]`` per expert) and ``mlp.experts.down_proj [E, h, f]``.

Export writes the Hub form, which transformers 4 and 5 both load. Attention, norms, embeddings and RoPE are
LLaMA's (``hf_llama``).

Routing, HF vs DeepSpeed's ``top2gating`` (``deepspeed/moe/sharded_moe.py``), both fp32:

- HF: ``p = softmax(fp32 router logits)``; ``topk(p, 2)``; the two weights divided by their sum;
  output = sum over the two experts of ``weight x expert(x)``.
- DeepSpeed with ``--disable-moe-top2-2nd-expert-sampling`` and ``--disable-moe-token-dropping``:
  ``p = softmax(logits of x.float() @ wg.float().T)``; first = ``argmax p``, second = ``argmax`` of the logits
  with the first masked out (the same expert: softmax is monotone); ``g1, g2 = p1, p2 / max(p1 + p2, eps)``
  (``p1 + p2 >= 2/E`` so the eps clamp never acts); capacity = the busiest expert's load, so no token is dropped;
  output = ``g1 x expert1(x) + g2 x expert2(x)``. The same function, and on CPU the same bits: one DeepSpeed
  ``MoE`` layer holding converted weights matches HF's sparse MoE block exactly (``test_ckpt_mixtral.py``).
- What differs: 2nd-expert sampling (Gumbel noise, which DeepSpeed applies in eval too) and token dropping (capacity
  limits) change the routing, so the import turns both off and the export is verified with both off
  (:func:`verification_config`); top-1 (DeepSpeed's ``top1gating`` keeps the softmax probability, HF renormalizes
  it to 1) and an HF ``sliding_window`` shorter than the context are refused; ``router_jitter_noise`` acts in HF
  training only (ignored). The auxiliary loss differs in form (DeepSpeed counts first choices only); its
  coefficient ``router_aux_loss_coef`` <-> ``--moe-loss-coeff`` is carried over as is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from megatron.config.model import ModelConfig
from megatron.config.moe import MoEConfig
from megatron.conversion.hf_common import (
    MegatronKeys,
    StrictKeys,
    config_to_dict,
    require_size,
)
from megatron.conversion.hf_llama import (
    LlamaFamily,
    export_llama_family,
    import_llama_family,
    split_gate_up,
)
from megatron.layout.experts import expert_key, gate_key


def _check_mixtral_config(cfg: Mapping[str, Any]) -> None:
    model_type = cfg.get("model_type", "mixtral")
    if model_type != "mixtral":
        raise ValueError(
            f"config.json model_type is '{model_type}'; this converter reads 'mixtral'."
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(
            f"Mixtral hidden_act '{act}' is not supported; Trident's --swiglu uses SiLU."
        )
    topk = int(cfg.get("num_experts_per_tok", 2))
    if topk != 2:
        raise ValueError(
            f"Mixtral num_experts_per_tok={topk} is not supported: only top-2 routing converts exactly "
            "(DeepSpeed's top-1 gate keeps the softmax probability where HF renormalizes it to 1)."
        )
    window = cfg.get("sliding_window")
    max_pos = int(cfg.get("max_position_embeddings", 4096 * 32))
    if window is not None and int(window) < max_pos:
        raise ValueError(
            f"Mixtral sliding_window={window} is shorter than max_position_embeddings={max_pos}: Trident's "
            "attention is full causal attention; set sliding_window to null (or >= the context) to convert."
        )
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key, False):
            raise ValueError(f"Mixtral config {key}=True is not supported (no linear biases).")


def _experts_from_hf(
    keys: StrictKeys, i: int, num_experts: int, ffn: int
) -> dict[str, torch.Tensor]:
    """Gate and experts of layer ``i`` (either HF form, see the module docstring), Megatron names."""
    src = f"layers.{i}."
    out: dict[str, torch.Tensor] = {}
    if keys.has(f"{src}block_sparse_moe.gate.weight"):
        moe = f"{src}block_sparse_moe."
        out[gate_key(i)] = keys.take(f"{moe}gate.weight").clone()
        for e in range(num_experts):
            w1 = keys.take(f"{moe}experts.{e}.w1.weight")  # [f, h] gate
            w3 = keys.take(f"{moe}experts.{e}.w3.weight")  # [f, h] up
            out[expert_key(i, e, "dense_h_to_4h")] = torch.cat([w1, w3])  # -> [2f, h] = [gate; up]
            out[expert_key(i, e, "dense_4h_to_h")] = keys.take(
                f"{moe}experts.{e}.w2.weight"
            ).clone()
    else:
        out[gate_key(i)] = keys.take(f"{src}mlp.gate.weight").clone()
        gate_up = keys.take(f"{src}mlp.experts.gate_up_proj")  # [E, 2f, h]
        down = keys.take(f"{src}mlp.experts.down_proj")  # [E, h, f]
        if gate_up.shape[:2] != (num_experts, 2 * ffn) or down.shape[0] != num_experts:
            raise ValueError(
                f"Mixtral layer {i}: experts.gate_up_proj {tuple(gate_up.shape)} / down_proj "
                f"{tuple(down.shape)} do not match num_local_experts={num_experts}, intermediate_size={ffn}."
            )
        for e in range(num_experts):
            out[expert_key(i, e, "dense_h_to_4h")] = gate_up[e].clone()  # [2f, h] = [w1; w3]
            out[expert_key(i, e, "dense_4h_to_h")] = down[e].clone()  # [h, f]
    if out[gate_key(i)].shape[0] != num_experts:
        raise ValueError(
            f"Mixtral layer {i}: gate.weight has {out[gate_key(i)].shape[0]} rows, "
            f"num_local_experts is {num_experts}."
        )
    return out


def mixtral_hf_to_megatron(
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config: Any,
    *,
    padded_vocab: int | None = None,
    make_vocab_size_divisible_by: int = 128,
) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Convert an HF Mixtral state dict into Megatron's full (TP = EP = 1, global expert ids) fp32 state dict.

    Args:
        hf_state_dict: ``MixtralForCausalLM`` (``model.*`` + ``lm_head.weight``) or ``MixtralModel`` state dict,
            experts in either HF form.
        hf_config: its ``config.json`` dict or ``MixtralConfig``.
        padded_vocab: rows of the Megatron embedding/output layer; default Megatron's padding at TP = 1.
        make_vocab_size_divisible_by: used for the default padding and recorded in the returned config.

    Returns:
        ``(state_dict, model_config)``: rmsnorm, swiglu, RoPE, no biases, GQA, every layer an MoE layer
        (``--num-experts E --expert-interval 1 --topk 2 --disable-moe-token-dropping
        --disable-moe-top2-2nd-expert-sampling``); ``vocab_size`` is the true vocabulary.

    Raises:
        ValueError: an unsupported variant (see the module docstring), or keys missing / left unmapped.
    """
    cfg = config_to_dict(hf_config)
    _check_mixtral_config(cfg)
    ffn = require_size(cfg, "intermediate_size", "Mixtral")
    num_experts = require_size(cfg, "num_local_experts", "Mixtral")
    family = LlamaFamily(
        model="Mixtral",
        mlp=lambda keys, i: _experts_from_hf(keys, i, num_experts, ffn),
        default_max_positions=4096 * 32,
        default_eps=1e-5,
        moe=MoEConfig(
            num_experts=(num_experts,),
            expert_interval=1,
            topk=2,
            moe_token_dropping=False,
            moe_top2_2nd_expert_sampling=False,
            moe_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.001)),
        ),
    )
    return import_llama_family(
        hf_state_dict,
        cfg,
        family,
        padded_vocab=padded_vocab,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
    )


def is_mixtral(cfg: ModelConfig) -> bool:
    """Whether the model has DeepSpeed-MoE layers (exported as HF Mixtral)."""
    return cfg.moe.is_moe(cfg.num_layers)


def verification_config(cfg: ModelConfig) -> ModelConfig:
    """The config a converted model is verified with against HF: the PyTorch reference kernels for every model, and
    for MoE models also HF Mixtral's routing (no token dropping, no 2nd-expert sampling: a checkpoint trained with
    either routes differently, the weights are the same).

    The check is of the converted weights. The fused CPU kernels differ from PyTorch's composites by a few ulps per
    op (their own tests bound that), which a model's logits sum to about 1e-5 (LLaMA, AVX512 kernels: 1.3e-5; with
    Mixtral's renormalized top-2 router weights more), the tools' default tolerance; with the reference kernels a
    converted model computes HF's logits to rounding, a converted Mixtral bit for bit."""
    refs = {
        "persist_layer_norm": False,
        "apply_rope_fusion": False,
        "bias_swiglu_fusion": False,
        "bias_gelu_fusion": False,
        "masked_softmax_fusion": False,
        "cross_entropy_loss_fusion": False,
    }
    if not cfg.moe.is_moe(cfg.num_layers):
        return dataclasses.replace(cfg, **refs)  # type: ignore[arg-type]
    moe = dataclasses.replace(cfg.moe, moe_token_dropping=False, moe_top2_2nd_expert_sampling=False)
    return dataclasses.replace(cfg, moe=moe, **refs)  # type: ignore[arg-type]


def _check_exportable(m: ModelConfig) -> int:
    """The experts per layer of a model HF Mixtral can represent; ValueError listing every obstacle."""
    problems = []
    if m.normalization != "rmsnorm":
        problems.append("--normalization must be rmsnorm")
    if not m.swiglu:
        problems.append("--swiglu must be on")
    if not m.use_rotary_position_embeddings:
        problems.append("--use-rotary-position-embeddings must be on")
    if m.rotary_percent != 1.0:
        problems.append(f"--rotary-percent must be 1 (got {m.rotary_percent})")
    if m.add_bias_linear:
        problems.append("--disable-bias-linear must be on")
    for flag, on in (
        ("--add-qkv-bias", m.add_qkv_bias),
        ("--qk-layernorm", m.qk_layernorm),
        ("--window-size", m.window_size is not None),
    ):
        if on:
            problems.append(f"{flag} must be off (HF Mixtral has no such attention)")
    per_layer = m.moe.experts_per_layer(m.num_layers)
    if len(set(per_layer)) != 1 or per_layer[0] < 2:
        problems.append(
            f"every layer must be an MoE layer with the same expert count (experts per layer: {per_layer}; "
            "use --expert-interval 1 and one --num-experts value)"
        )
    if m.moe.topk != 2:
        problems.append(f"--topk must be 2 (got {m.moe.topk})")
    if m.moe.mlp_type != "standard":
        problems.append(
            f"--mlp-type must be standard (got {m.moe.mlp_type}; PR-MoE has no HF form)"
        )
    if problems:
        raise ValueError(
            "this model cannot be exported as HF Mixtral: " + "; ".join(problems) + "."
        )
    return per_layer[0]


def megatron_to_mixtral_hf(
    full_state_dict: Mapping[str, torch.Tensor],
    model_config: ModelConfig,
    true_vocab_size: int,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Convert Megatron's full state dict (global expert ids) into an HF ``MixtralForCausalLM`` state dict and
    ``config.json`` dict (Hub form: ``block_sparse_moe.experts.{e}.w1/w2/w3``).

    Args:
        full_state_dict: Megatron names, merged over TP, PP and EP.
        model_config: a Mixtral-shaped MoE model (see :func:`_check_exportable`).
        true_vocab_size: the tokenizer's vocabulary; padding rows beyond it are dropped.
        bos_token_id, eos_token_id: the tokenizer's special ids for ``config.json`` (None writes null).

    Raises:
        ValueError: the model has no HF Mixtral form, or the state dict does not match its config.
    """
    num_experts = _check_exportable(model_config)

    def mlp(take: MegatronKeys, i: int) -> dict[str, torch.Tensor]:
        moe = f"model.layers.{i}.block_sparse_moe."
        out = {f"{moe}gate.weight": take(gate_key(i)).clone()}
        for e in range(num_experts):
            key = expert_key(i, e, "dense_h_to_4h")  # [2f, h] = [gate; up]
            gate, up = split_gate_up(take, key, model_config.ffn_size)
            out[f"{moe}experts.{e}.w1.weight"] = gate
            out[f"{moe}experts.{e}.w3.weight"] = up
            out[f"{moe}experts.{e}.w2.weight"] = take(expert_key(i, e, "dense_4h_to_h")).clone()
        return out

    out, config = export_llama_family(
        full_state_dict, model_config, true_vocab_size, mlp, bos_token_id, eos_token_id
    )
    config.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        sliding_window=None,
        num_local_experts=num_experts,
        num_experts_per_tok=2,
        router_aux_loss_coef=model_config.moe.moe_loss_coeff,
        router_jitter_noise=0.0,
        output_router_logits=False,
    )
    return out, config
