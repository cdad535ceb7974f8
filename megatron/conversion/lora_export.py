"""LoRA adapters of a Trident model, exported for Hugging Face: merged into the weights, or as a PEFT adapter.

A model trained with ``--lora-rank r`` holds, beside each targeted linear's frozen ``weight`` ``W [out, in]``, the
parameters ``<linear>.lora_a`` ``A [r, in]`` and ``<linear>.lora_b`` ``B [out, r]`` (full, TP-merged shapes) and
computes ``W x + (alpha / r) * B A x``. Two exports of a full Megatron state dict holding them:

- merged (:func:`merge_lora`, ``--merge-lora``): ``W' = W + (alpha / r) * B @ A`` for every target, then the
  family's usual export (:mod:`megatron.conversion.hf_export`): a plain HF model, no PEFT needed to run it.
- PEFT (:func:`peft_adapter`, ``--peft-output DIR``): the base exported as usual and, in ``DIR``,
  ``adapter_config.json`` + ``adapter_model.safetensors`` that ``peft.PeftModel.from_pretrained(base, DIR)``
  loads. PEFT's keys are ``base_model.model.<HF module>.lora_A.weight`` ``[r, in]`` and ``.lora_B.weight``
  ``[out, r]``, its scaling ``lora_alpha / r`` (``use_rslora`` off), as ours.

Targets and the HF modules they become. ``A`` acts on the input, so the parts of a fused linear share it; ``B``'s
rows split exactly as the fused weight's rows do on export (the per-K/V-group QKV order of
:mod:`megatron.layout.qkv`, SwiGLU's ``[gate; up]``)::

    target  Megatron linear                   LLaMA family (llama, qwen2, qwen3, mistral)  GPT-2 (Conv1D)
    qkv     self_attention.query_key_value    q_proj, k_proj, v_proj                       attn.c_attn ([q; k; v])
    dense   self_attention.dense              o_proj                                       attn.c_proj
    fc1     mlp.dense_h_to_4h                 gate_proj, up_proj                           mlp.c_fc
    fc2     mlp.dense_4h_to_h                 down_proj                                    mlp.c_proj

GPT-2's linears are ``Conv1D`` (weight ``[in, out]``): PEFT adapts them with ``fan_in_fan_out`` on, its
``lora_A``/``lora_B`` keep the ``[r, in]`` / ``[out, r]`` shapes. Mixtral gets a PEFT folder for its attention
(LoRA trains no MoE expert here: ``megatron/config/lora.py``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.lora import LORA_BASE_KEY, read_lora_checkpoint
from megatron.checkpointing.readers import (
    CheckpointRead,
    Progress,
    read_checkpoint_config,
    read_checkpoint_weights,
)
from megatron.config.lora import LORA_TARGETS, LoraConfig
from megatron.config.model import ModelConfig
from megatron.conversion.hf_llama import HeadLayout
from megatron.conversion.output_dirs import check_output_dir_path, check_output_not_input
from megatron.layout.names import layer_prefix
from megatron.layout.qkv import split_qkv

_LORA_KEY = re.compile(r"(.+)\.(lora_a|lora_b)$")
LORA_A, LORA_B = "lora_a", "lora_b"

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before the HF module name in ``adapter_model.safetensors``."""

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class Adapter:
    """One targeted linear's adapter (full shapes)."""

    a: torch.Tensor
    """``lora_a`` ``[r, in]``."""
    b: torch.Tensor
    """``lora_b`` ``[out, r]``."""


def has_lora(full: Mapping[str, torch.Tensor]) -> bool:
    """Whether a Megatron state dict holds LoRA adapters (any ``*.lora_a`` / ``*.lora_b``)."""
    return any(_LORA_KEY.match(k) for k in full)


def split_lora(
    full: Mapping[str, torch.Tensor], cfg: ModelConfig
) -> tuple[dict[str, torch.Tensor], dict[str, Adapter]]:
    """``(base, adapters)``: the state dict without its adapter tensors, and the adapters by linear prefix
    (``language_model.encoder.layers.{i}.self_attention.query_key_value``), checked against ``cfg.lora``.

    Raises:
        ValueError: a model without LoRA, an adapter of a linear that is not a target (or has no weight), a
            target of some layer without its adapter, half an adapter, or shapes that disagree with the weight
            or the rank.
    """
    lora = cfg.lora
    if not lora.enabled:
        raise ValueError(
            "the model has no LoRA adapters (--lora-rank 0 in its config); export it as a plain model."
        )
    base = {k: v for k, v in full.items() if not _LORA_KEY.match(k)}
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in full.items():
        m = _LORA_KEY.match(key)
        if m:
            found.setdefault(m.group(1), {})[m.group(2)] = value
    expected = {
        f"{layer_prefix(i)}.{LORA_TARGETS[t]}"
        for i in range(cfg.num_layers)
        for t in lora.lora_target_modules
    }
    _check_adapter_names(set(found), expected, lora)
    adapters = {}
    for linear in sorted(expected):
        parts = found[linear]
        if set(parts) != {LORA_A, LORA_B}:
            raise ValueError(
                f"{linear} has {sorted(parts)} but an adapter needs both {LORA_A} and {LORA_B}; the "
                "checkpoint is incomplete."
            )
        adapters[linear] = Adapter(parts[LORA_A].float(), parts[LORA_B].float())
        _check_shapes(linear, adapters[linear], base.get(f"{linear}.weight"), lora.lora_rank)
    return base, adapters


def _check_adapter_names(found: set[str], expected: set[str], lora: LoraConfig) -> None:
    targets = " ".join(lora.lora_target_modules)
    if extra := sorted(found - expected):
        raise ValueError(
            f"the state dict has LoRA adapters on {extra[:3]}, which --lora-target-modules ({targets}) does "
            "not name; the adapters and the recorded LoRA config disagree."
        )
    if missing := sorted(expected - found):
        raise ValueError(
            f"--lora-target-modules ({targets}) names {len(missing)} linears that have no adapter in the "
            f"state dict (e.g. {missing[:3]}); the adapters and the recorded LoRA config disagree."
        )


def _check_shapes(linear: str, ad: Adapter, weight: torch.Tensor | None, rank: int) -> None:
    if weight is None:
        raise ValueError(f"{linear} has a LoRA adapter but no weight; pass the full model.")
    out, inp = weight.shape
    want = {LORA_A: (rank, inp), LORA_B: (out, rank)}
    got = {LORA_A: tuple(ad.a.shape), LORA_B: tuple(ad.b.shape)}
    if got != want:
        raise ValueError(
            f"{linear}: adapter shapes {got} do not fit its weight [{out}, {inp}] at --lora-rank {rank} "
            f"(expected {want}); pass the TP-merged adapters of this model."
        )


def merge_lora(full: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The plain model the LoRA model computes: every target's ``W' = W + (alpha / r) * B @ A`` (``[out, r] @
    [r, in] -> [out, in]``, accumulated in fp64 and rounded once to ``W``'s dtype), adapters dropped."""
    base, adapters = split_lora(full, cfg)
    for linear, ad in adapters.items():
        w = base[f"{linear}.weight"]
        delta = (
            ad.b.double() @ ad.a.double()
        ) * cfg.lora.scaling  # [out, r] @ [r, in] -> [out, in]
        base[f"{linear}.weight"] = (w.double() + delta).to(w.dtype)
    return base


def _llama_modules(cfg: ModelConfig, target: str, ad: Adapter) -> dict[str, Adapter]:
    """HF LLaMA-family module names (inside ``model.layers.{i}.``) and their adapters for one target."""
    if target == "qkv":
        # [(n+2G)*hn, r] -> [n*hn, r], [G*hn, r], [G*hn, r]
        q, k, v = HeadLayout.of(cfg).split(ad.b)
        return {f"self_attn.{x}_proj": Adapter(ad.a, b) for x, b in zip("qkv", (q, k, v))}
    if target == "fc1":
        f = cfg.ffn_size
        # [2f, r] = [gate; up] -> [f, r], [f, r]
        return {"mlp.gate_proj": Adapter(ad.a, ad.b[:f]), "mlp.up_proj": Adapter(ad.a, ad.b[f:])}
    return {{"dense": "self_attn.o_proj", "fc2": "mlp.down_proj"}[target]: ad}


def _gpt2_modules(cfg: ModelConfig, target: str, ad: Adapter) -> dict[str, Adapter]:
    """HF GPT-2 module names (inside ``transformer.h.{i}.``) and their adapters for one target."""
    if target == "qkv":
        n = cfg.num_attention_heads
        q, k, v = split_qkv(ad.b, num_heads=n, num_groups=n, head_dim=cfg.head_dim)
        return {"attn.c_attn": Adapter(ad.a, torch.cat([q, k, v]))}  # per-head -> [q; k; v] rows
    return {{"dense": "attn.c_proj", "fc1": "mlp.c_fc", "fc2": "mlp.c_proj"}[target]: ad}


_PEFT_TARGETS = {
    "llama": {
        "qkv": ("q_proj", "k_proj", "v_proj"),
        "dense": ("o_proj",),
        "fc1": ("gate_proj", "up_proj"),
        "fc2": ("down_proj",),
    },
    # GPT-2's attention and MLP output projections are both ``c_proj``: PEFT matches name suffixes.
    "gpt2": {
        "qkv": ("attn.c_attn",),
        "dense": ("attn.c_proj",),
        "fc1": ("mlp.c_fc",),
        "fc2": ("mlp.c_proj",),
    },
}
"""PEFT ``target_modules`` of each ``--lora-target-modules`` name, per family."""


def peft_adapter(
    full: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    *,
    family: str,
    base_model: str | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, adapter_config)`` of a PEFT LoRA adapter for the HF export of ``full``'s base.

    Args:
        full: full (TP- and PP-merged) Megatron state dict with the adapters.
        cfg: its architecture and LoRA settings (``cfg.lora``).
        family: ``"llama"`` (the LLaMA family: llama, qwen2, qwen3, mistral; Mixtral's attention) or
            ``"gpt2"``.
        base_model: ``base_model_name_or_path`` (the HF export directory of the base).

    Returns:
        PEFT-named fp32 tensors (each its own storage) and the ``adapter_config.json`` dict.

    Raises:
        ValueError: an unknown family, adapters on an MoE model's MLP, or adapters that disagree with
            ``cfg.lora`` (:func:`split_lora`).
    """
    lora = cfg.lora
    if family not in _PEFT_TARGETS:
        raise ValueError(f"no PEFT export for the {family} family; use the merged export.")
    mlp = [t for t in lora.lora_target_modules if t in ("fc1", "fc2")]
    if mlp and (cfg.moe.is_moe(cfg.num_layers) or cfg.moe.num_experts_switch):
        raise ValueError(
            f"adapters on an MoE model's MLP ({' '.join(mlp)}) have no PEFT counterpart here; export the "
            "merged model (--merge-lora) instead."
        )
    _, adapters = split_lora(full, cfg)
    modules, hf_layer = (
        (_llama_modules, "model.layers") if family == "llama" else (_gpt2_modules, "transformer.h")
    )
    tensors: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        for target in lora.lora_target_modules:
            ad = adapters[f"{layer_prefix(i)}.{LORA_TARGETS[target]}"]
            for name, part in modules(cfg, target, ad).items():
                key = f"{PEFT_PREFIX}{hf_layer}.{i}.{name}"
                # a copy each: q/k/v (gate/up) share A, and safetensors refuses shared storage
                tensors[f"{key}.lora_A.weight"] = part.a.float().clone(
                    memory_format=torch.contiguous_format
                )
                tensors[f"{key}.lora_B.weight"] = part.b.float().clone(
                    memory_format=torch.contiguous_format
                )
    return tensors, _adapter_config(lora, family, base_model)


def _adapter_config(lora: LoraConfig, family: str, base_model: str | None) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` fields (the rest take PEFT's defaults)."""
    alpha = int(lora.lora_alpha) if float(lora.lora_alpha).is_integer() else lora.lora_alpha
    targets = [m for t in lora.lora_target_modules for m in _PEFT_TARGETS[family][t]]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.lora_rank,
        "lora_alpha": alpha,
        "lora_dropout": lora.lora_dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": family == "gpt2",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def write_peft_adapter(
    out_dir: str | Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> None:
    """Write ``out_dir/adapter_config.json`` and ``out_dir/adapter_model.safetensors`` (created if needed)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")


STALE_ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, "adapter_model.bin", "README.md")
"""What an ``overwrite`` export removes from ``--peft-output`` first (files of an earlier adapter)."""


@dataclass(frozen=True)
class LoraOutput:
    """What ``export_to_hf`` writes for a LoRA adapter checkpoint (the ``--save`` of a ``--lora-rank`` run)."""

    merge: bool = False
    """``--merge-lora``: ``--out`` gets the merged model (``W + (alpha / r) B A``), a plain HF model."""
    peft_dir: str | Path | None = None
    """``--peft-output DIR``: ``--out`` gets the base model, ``DIR`` the PEFT adapter folder naming it as its
    ``base_model_name_or_path``."""

    @property
    def requested(self) -> bool:
        """Either export was asked for."""
        return self.merge or self.peft_dir is not None

    def check_dirs(self, load: str | Path, out: str | Path, *, overwrite: bool) -> None:
        """Before anything is read: one of the two exports, and a ``--peft-output`` that is new or empty (or any
        directory with ``overwrite``), not ``--out`` and not inside ``--load``.

        Raises:
            ValueError: naming the flags and the fix.
        """
        if self.peft_dir is None:
            return
        if self.merge:
            raise ValueError(
                "--merge-lora and --peft-output exclude each other: the PEFT folder's base must be the base "
                "model, not the merged one; run the export twice (two --out directories) for both."
            )
        check_output_dir_path(self.peft_dir, "--peft-output")
        check_output_not_input(self.peft_dir, "--peft-output", load, "--load")
        peft = Path(self.peft_dir)
        if Path(os.path.realpath(peft)) == Path(os.path.realpath(out)):
            raise ValueError(
                f"--peft-output {peft} is --out: the adapter folder and the base model it points at need a "
                "directory each; give --peft-output another directory."
            )
        if not overwrite and peft.is_dir() and any(peft.iterdir()):
            raise ValueError(
                f"--peft-output {peft} is not empty; choose a new or empty directory, or pass --overwrite to "
                f"replace the adapter files there ({', '.join(STALE_ADAPTER_FILES)})."
            )


def read_export_weights(
    ckpt_dir: str | Path,
    read: CheckpointRead,
    progress: Progress,
    lora: LoraOutput,
) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """``(full, cfg, meta)`` of the checkpoint ``export_to_hf`` exports: a plain one as it is; an adapter
    checkpoint as its recorded base plus the adapters (``read_lora_checkpoint``), when ``lora`` asks for one of
    its exports.

    Raises:
        ValueError: an adapter checkpoint without ``--merge-lora``/``--peft-output``, or either flag for a
            checkpoint without adapters; what the readers raise.
    """
    _, cfg, _ = read_checkpoint_config(ckpt_dir, read.tag)
    if not cfg.lora.enabled:
        if lora.requested:
            flag = "--merge-lora" if lora.merge else "--peft-output"
            raise ValueError(
                f"{flag}: --load {ckpt_dir} holds no LoRA adapters (its model has --lora-rank 0); export it "
                f"without {flag}."
            )
        return read_checkpoint_weights(
            ckpt_dir, read.tag, progress, verify_checksums=read.verify_checksums
        )
    if not lora.requested:
        raise ValueError(
            f"--load {ckpt_dir} is a LoRA adapter checkpoint (--lora-rank {cfg.lora.lora_rank}, targets "
            f"{' '.join(cfg.lora.lora_target_modules)}): pass --merge-lora for a plain HF model with the "
            "adapters merged in, or --peft-output DIR for the base model in --out plus a PEFT adapter folder."
        )
    adapters, base, cfg, meta = read_lora_checkpoint(
        ckpt_dir, read.tag, verify_checksums=read.verify_checksums, progress=progress
    )
    return {**base, **adapters}, cfg, _with_base_records(meta)


INHERITED_META = ("hf_model_type", "tokenizer")
"""``trident_meta.json`` entries an adapter checkpoint takes from its base when it has none: the HF family the base
was imported from (the export writes that family) and the tokenizer (a LoRA run on mock data records none)."""


def _with_base_records(meta: dict[str, Any]) -> dict[str, Any]:
    record = meta[LORA_BASE_KEY]
    missing = [k for k in INHERITED_META if not meta.get(k)]
    if not missing:
        return meta
    _, _, base_meta = read_checkpoint_config(record["dir"], record["tag"])
    return {**meta, **{k: base_meta[k] for k in missing if base_meta.get(k)}}


def hf_weights(
    full: dict[str, torch.Tensor], cfg: ModelConfig, lora: LoraOutput
) -> dict[str, torch.Tensor]:
    """The Megatron weights the HF export writes: ``full`` itself without LoRA, else the merged model
    (``--merge-lora``) or the base (``--peft-output``)."""
    if not cfg.lora.enabled:
        return full
    return merge_lora(full, cfg) if lora.merge else split_lora(full, cfg)[0]
