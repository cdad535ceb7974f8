"""``LoraConfig``: low-rank adapters on the linears of every transformer layer (``ModelConfig.lora``).

With ``--lora-rank R`` (> 0) each targeted linear ``y = W x`` becomes ``y = W x + (alpha / R) * B (A dropout(x))``
with ``A [R, in]`` (``lora_a``) and ``B [out, R]`` (``lora_b``, zero at the start, so training starts from the
base model exactly); every other parameter is frozen and the checkpoints hold the adapters only
(docs/fine-tuning.md). The target names are Megatron-LM's:

    qkv    self_attention.query_key_value   (column-parallel)
    dense  self_attention.dense             (row-parallel)
    fc1    mlp.dense_h_to_4h                (column-parallel; [gate; up] with --swiglu)
    fc2    mlp.dense_4h_to_h                (row-parallel)

Decisions written down (checked by :func:`check_lora`):

- ``--lora-alpha`` defaults to 32 (Megatron-LM's and PEFT's common choice), so the scaling is ``32 / R``.
- MoE: adapters on the attention linears only. DeepSpeed-MoE experts (and the Switch MLP's) are refused as
  targets (``fc1``/``fc2``): their parameters live in expert-parallel groups and files of their own.
- The base comes from ``--pretrained-checkpoint`` (Megatron-LM's flag), required with LoRA and read on every
  start, so ``--load``/``--save`` keep their meaning (the run's own, adapter-only checkpoints: auto-resume works
  as for any run). Plain ``--load``/``--finetune`` of the base would leave no place for the adapters' resume.
- ZeRO-3 is refused with LoRA: its partitioned parameters and DeepSpeed's frozen-parameter save were not
  verified together here (ZeRO 0-2 are).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.config.arguments import TridentConfig

LORA_TARGETS: dict[str, str] = {
    "qkv": "self_attention.query_key_value",
    "dense": "self_attention.dense",
    "fc1": "mlp.dense_h_to_4h",
    "fc2": "mlp.dense_4h_to_h",
}
"""``--lora-target-modules`` name -> the linear's name inside a transformer layer."""


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (fine-tuning): trainable low-rank updates on a frozen base model."""

    lora_rank: int = 0
    """Rank R of the low-rank adapters on the targeted linears (0: no LoRA, every parameter trains)."""
    lora_alpha: float = 32.0
    """LoRA alpha: the adapter output is scaled by alpha / rank."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input (the base linear sees the input unchanged)."""
    lora_target_modules: tuple[str, ...] = ("qkv", "dense", "fc1", "fc2")
    """Linears that get adapters, among qkv (fused QKV), dense (attention output), fc1 (MLP in), fc2 (MLP out)."""

    def __post_init__(self) -> None:
        # the saved ``dataclasses.asdict`` form (checkpoint meta) gives a list
        object.__setattr__(self, "lora_target_modules", tuple(self.lora_target_modules))

    @property
    def enabled(self) -> bool:
        """Adapters are built (``--lora-rank`` > 0)."""
        return self.lora_rank > 0

    @property
    def scaling(self) -> float:
        """``alpha / rank``, the factor of the adapter output."""
        return self.lora_alpha / self.lora_rank

    def targets(self, target: str) -> bool:
        """Whether the linear ``target`` (a key of :data:`LORA_TARGETS`) gets an adapter."""
        return self.enabled and target in self.lora_target_modules


def _check_targets(lora: LoraConfig) -> None:
    unknown = [t for t in lora.lora_target_modules if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(
            f"--lora-target-modules: unknown name(s) {unknown}; valid: {' '.join(LORA_TARGETS)}."
        )
    if not lora.lora_target_modules:
        raise ValueError(
            f"--lora-target-modules is empty with --lora-rank {lora.lora_rank}; name at least one of "
            f"{' '.join(LORA_TARGETS)}, or drop --lora-rank."
        )
    if len(set(lora.lora_target_modules)) != len(lora.lora_target_modules):
        raise ValueError(
            f"--lora-target-modules {' '.join(lora.lora_target_modules)} names a module twice; name each once."
        )


def check_lora(cfg: TridentConfig) -> None:
    """Raise ``ValueError`` for a LoRA setting this build cannot train (module docstring); ranges are
    ``ranges.py``'s."""
    lora = cfg.model.lora
    if not lora.enabled:
        if cfg.checkpoint.pretrained_checkpoint:
            raise ValueError(
                f"--pretrained-checkpoint {cfg.checkpoint.pretrained_checkpoint} is the frozen base of a LoRA run; "
                "add --lora-rank, or load a model to train in full with --load (and --finetune)."
            )
        return
    _check_targets(lora)
    m = cfg.model
    mlp_targets = [t for t in lora.lora_target_modules if t in ("fc1", "fc2")]
    if mlp_targets and (m.moe.is_moe(m.num_layers) or m.moe.num_experts_switch):
        raise ValueError(
            f"--lora-target-modules {' '.join(mlp_targets)}: LoRA on MoE experts is not supported; use "
            "--lora-target-modules qkv dense for an MoE model."
        )
    if not cfg.checkpoint.pretrained_checkpoint:
        raise ValueError(
            "--lora-rank trains adapters on a frozen base model: give the base checkpoint directory with "
            "--pretrained-checkpoint (--load and --save then hold the adapters)."
        )
    if cfg.checkpoint.universal_checkpoint:
        raise ValueError(
            "--universal-checkpoint with --lora-rank: adapter checkpoints resume at the layout they were saved "
            "at; drop --universal-checkpoint (the base in --pretrained-checkpoint is read at any layout)."
        )
    if cfg.parallel.zero_stage == 3:
        raise ValueError(
            "--lora-rank with --zero-stage 3 is not supported (frozen base + adapter-only checkpoints are "
            "verified with ZeRO 0-2); use --zero-stage 1 or 2."
        )
