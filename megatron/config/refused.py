"""Megatron-DeepSpeed flags Trident knows by name and refuses: the feature is not here, so the run stops at once.

A launch script that passes one of these gets one line and exit 2 (``pretrain_gpt.py``'s bad-flag path) naming the
feature and what to use instead, rather than argparse's "unrecognized arguments" or, worse, a run that silently
trains something else. A few accept the one value that means "feature off" (``--transformer-impl local``),
which Megatron-DeepSpeed's own scripts pass; any other value is refused. The compatibility table of docs/megatron-deepspeed.md
lists every entry with its reason (``scripts/mds_flag_table.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RefusedFlag:
    """A Megatron-DeepSpeed flag whose feature Trident does not have."""

    flags: tuple[str, ...]
    """Every spelling."""
    takes_value: bool
    """Whether it takes values (a switch otherwise)."""
    why: str
    """The feature and why it is not here, e.g. "knowledge distillation is not built"."""
    instead: str
    """What to do instead (drop the flag, the Trident flag or tool that does the job)."""
    accepts: tuple[str, ...] = ()
    """Values that mean "feature off", accepted with no effect; anything else is refused."""

    def message(self, flag: str) -> str:
        """The one line a run that passes ``flag`` stops with."""
        allowed = f" (only {' '.join(self.accepts)} is accepted)" if self.accepts else ""
        return f"{flag} is refused{allowed}: {self.why}; {self.instead}"


class RefusedFlagError(ValueError):
    """A refused flag was given (``pretrain_gpt.py`` prints it as one ``error:`` line and exits 2)."""


class RefuseAction(argparse.Action):
    """argparse action of a refused flag: raises :class:`RefusedFlagError` as soon as the flag is parsed."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, refused: RefusedFlag, **kw: Any
    ):
        self.refused = refused
        super().__init__(option_strings, dest, nargs="*" if refused.takes_value else 0, **kw)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = [str(v) for v in values] if isinstance(values, list) else []
        if self.refused.accepts and given and all(v in self.refused.accepts for v in given):
            return  # the "feature off" value: nothing to do
        raise RefusedFlagError(self.refused.message(option_string or self.option_strings[0]))


def _r(
    flags: str, why: str, instead: str, *, value: bool = False, accepts: str = ""
) -> RefusedFlag:
    return RefusedFlag(tuple(flags.split()), value, why, instead, tuple(accepts.split()))


_LONG_SEQ = "for long sequences use DeepSpeed-Ulysses (--ds-sequence-parallel-size N) without FPDT"
_NOT_GPT = "Trident trains GPT/LLaMA decoder models only"
_KD = "knowledge distillation (teacher model, KD loss) is not built"
_FP8 = "FP8 training through NVIDIA Transformer Engine is not built"
_INFER = "Trident's pretrain_gpt.py only trains"
_GEN = "generate with tools/generate_text.py or serve with tools/run_text_generation_server.py"
_DROP = "drop the flag"

REFUSED: tuple[RefusedFlag, ...] = (
    # MoE kernel libraries; FPDT (DeepSpeed-Ulysses itself is --ds-sequence-parallel-size).
    _r(
        "--use-tutel",
        "Tutel (an MoE kernel library) is not built",
        "DeepSpeed-MoE runs without it: drop the flag",
    ),
    _r(
        "--ds-sequence-parallel-fpdt",
        "FPDT (Ulysses with chunked, offloaded attention) is not built",
        _LONG_SEQ,
    ),
    _r("--ds-sequence-parallel-fpdt-chunk-size", "FPDT is not built", _LONG_SEQ, value=True),
    _r("--ds-sequence-parallel-fpdt-offloading", "FPDT is not built", _LONG_SEQ),
    # Knowledge distillation and Mixture-of-Students.
    _r("--kd", _KD, f"train the student as a plain GPT and {_DROP}"),
    _r(
        "--mos",
        "Mixture-of-Students (MoE knowledge distillation) is not built",
        f"train a dense model and {_DROP}",
    ),
    _r("--kd-alpha-ce", _KD, _DROP, value=True),
    _r("--kd-beta-ce", _KD, _DROP, value=True),
    _r("--kd-temp", _KD, _DROP, value=True),
    _r("--load-teacher", _KD + " (no teacher checkpoint is read)", _DROP, value=True),
    _r("--num-layers-teacher", _KD, _DROP, value=True),
    _r("--num-experts-teacher", _KD, _DROP, value=True),
    _r("--hidden-size-teacher", _KD, _DROP, value=True),
    _r("--num-attention-heads-teacher", _KD, _DROP, value=True),
    # DeepSpeed data-efficiency and schedule features.
    _r(
        "--random-ltd",
        "random layerwise token dropping (DeepSpeed data efficiency) is not built",
        f"{_DROP}; every layer sees every token",
    ),
    _r(
        "--enable-zbh1-pipeline",
        "the zero-bubble (ZB-H1) pipeline schedule is not built",
        "DeepSpeed's 1F1B pipeline schedule runs; drop the flag",
    ),
    _r(
        "--enable-zbh1-exact-semantics",
        "the zero-bubble (ZB-H1) pipeline schedule is not built",
        _DROP,
    ),
    _r(
        "--num-layers-per-virtual-pipeline-stage",
        "the interleaved (virtual) pipeline schedule is not built (DeepSpeed's pipeline engine runs 1F1B)",
        "drop the flag; --pipeline-model-parallel-size sets the stages",
    ),
    _r(
        "--standalone-embedding-stage",
        "a pipeline stage holding only the embedding is not built",
        "drop the flag; the embedding sits on the first stage",
    ),
    _r(
        "--split-transformers",
        "splitting each layer into two checkpointed halves is not built",
        "use --recompute-granularity selective",
    ),
    _r(
        "--distribute-saved-activations --distribute-checkpointed-activations",
        "Megatron's own distributed checkpoint buffers are not built",
        "use --deepspeed-activation-checkpointing --partition-activations",
    ),
    # Inference modes that need other entry points.
    _r("--inference", _INFER + " (no optimizer-free inference mode)", _GEN),
    _r("--ds-inference", _INFER + " (no DeepSpeed inference engine)", _GEN),
    _r("--inference-batch-times-seqlen-threshold", _INFER, _GEN, value=True),
    _r("--max-tokens-to-oom", _INFER, _GEN, value=True),
    # FP8 / Transformer Engine.
    _r(
        "--transformer-impl",
        _FP8,
        "drop the flag (local is accepted); train in --bf16",
        value=True,
        accepts="local",
    ),
    _r("--fp8-e4m3", _FP8, "train in --bf16"),
    _r("--fp8-hybrid", _FP8, "train in --bf16"),
    _r("--no-fp8-wgrad", _FP8, "train in --bf16"),
    _r("--fp8-margin", _FP8, "train in --bf16", value=True),
    _r("--fp8-interval", _FP8, "train in --bf16", value=True),
    _r("--fp8-amax-history-len", _FP8, "train in --bf16", value=True),
    _r("--fp8-amax-compute-algo", _FP8, "train in --bf16", value=True),
    # Model variants Trident does not build.
    _r(
        "--apply-residual-connection-post-layernorm",
        "the original BERT residual ordering (residual from after the layernorm) is not built",
        f"{_DROP}: the GPT pre-LN ordering runs",
    ),
    _r(
        "--squared-relu",
        "the squared-ReLU activation is not built",
        f"{_DROP} (GeLU) or use --swiglu",
    ),
    _r(
        "--embedding-weights-in-fp32",
        "fp32 word-embedding weights inside a bf16/fp16 model are not built",
        _DROP,
    ),
    _r(
        "--fp32-residual-connection",
        "fp32 residual connections inside a bf16/fp16 model are not built",
        _DROP,
    ),
    _r(
        "--fp16-lm-cross-entropy",
        "the fp16 cross-entropy is not built (the loss is always computed in fp32)",
        _DROP,
    ),
    _r("--onnx-safe", "ONNX export (and its workarounds) is not built", _DROP, value=True),
    _r(
        "--init-method-xavier-uniform",
        "Xavier-uniform initialization is not built",
        "use the normal init with --init-method-std",
    ),
    _r(
        "--data-parallel-random-init",
        "different weights per data-parallel rank are not built",
        "drop the flag: weights are the same on every rank at any layout",
    ),
    # Megatron flags it deprecated itself (Megatron-DeepSpeed stops on them too).
    _r(
        "--batch-size",
        "the old batch-size flag is deprecated",
        "use --micro-batch-size",
        value=True,
    ),
    _r(
        "--warmup",
        "the old warmup flag is deprecated",
        "use --lr-warmup-iters or --lr-warmup-fraction",
        value=True,
    ),
    _r(
        "--model-parallel-size",
        "the old model-parallel flag is deprecated",
        "use --tensor-model-parallel-size",
        value=True,
    ),
    # Training-loop features not built.
    _r(
        "--start-weight-decay --end-weight-decay --weight-decay-incr-style",
        "a weight-decay schedule is not built",
        "use a constant --weight-decay",
        value=True,
    ),
    _r(
        "--use-distributed-optimizer",
        "Megatron's distributed optimizer is not used",
        "use --zero-stage 1 (DeepSpeed ZeRO shards the optimizer state the same way)",
    ),
    _r(
        "--remote-device",
        "ZeRO-3 builds the model inside deepspeed.zero.Init, which takes the placement from the DeepSpeed JSON",
        "drop the flag (none is accepted); set zero_optimization.offload_param.device (cpu or nvme) in the "
        "DeepSpeed JSON",
        value=True,
        accepts="none",
    ),
    _r(
        "--empty-unused-memory-level",
        "emptying the CUDA cache every iteration is not built",
        "drop the flag (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces fragmentation)",
        value=True,
        accepts="0",
    ),
    _r(
        "--no-save-optim --no-save-rng",
        "checkpoints always hold the optimizer and RNG state (exact resume)",
        "drop the flag; tools/checkpoint converts to a weights-only format",
    ),
    _r(
        "--kill-switch-file",
        "the kill-switch file is not built",
        "send SIGTERM (saves a checkpoint and exits) or use --exit-duration-in-mins",
        value=True,
    ),
    _r(
        "--adlr-autoresume --adlr-autoresume-interval",
        "ADLR cluster autoresume is not built",
        "send SIGTERM (saves a checkpoint and exits) and relaunch with --load",
        value=True,
    ),
    _r(
        "--repeated-dataloader",
        "re-iterating an exhausted loader is not built",
        "use --dataloader-type cyclic (a fresh permutation each pass)",
    ),
    _r(
        "--use-dataset-only",
        "driving Megatron's datasets from an external trainer is not built",
        _DROP,
        value=True,
    ),
    _r("--lazy-mpu-init", "an external DDP manager is not supported", _DROP, value=True),
    _r(
        "--profile --profile_steps --profile-ranks",
        "the built-in torch profiler hook is not built",
        "profile with nsys or torch.profiler around pretrain()",
        value=True,
    ),
    # Other model families: T5, BERT, ICT / REALM / ORQA biencoder, Retro, vision.
    _r(
        "--decoder-num-layers --decoder-seq-length --pipeline-model-parallel-split-rank --vocab-extra-ids",
        _NOT_GPT + " (these are T5 encoder-decoder settings)",
        _DROP,
        value=True,
    ),
    _r("--bert-no-binary-head --output-bert-embeddings", _NOT_GPT + " (BERT settings)", _DROP),
    _r(
        "--bert-embedder-type --mask-prob --short-seq-prob --train-idx-path",
        _NOT_GPT + " (BERT settings)",
        _DROP,
        value=True,
    ),
    _r(
        "--ict-head-size --biencoder-projection-dim --ict-load --bert-load --titles-data-path "
        "--query-in-block-prob --evidence-data-path --retriever-report-topk-accuracies --block-data-path "
        "--embedding-path --indexer-batch-size --indexer-log-interval --retriever-seq-length --sample-rate",
        _NOT_GPT + " (ICT/REALM/ORQA retriever settings)",
        _DROP,
        value=True,
    ),
    _r(
        "--biencoder-shared-query-context-model --use-one-sent-docs --retriever-score-scaling",
        _NOT_GPT + " (ICT/REALM/ORQA retriever settings)",
        _DROP,
    ),
    _r(
        "--retro-workdir --retro-cyclic-train-iters --retro-encoder-layers --retro-encoder-hidden-dropout "
        "--retro-encoder-attention-dropout --retro-num-neighbors --retro-num-retrieved-chunks",
        _NOT_GPT + " (Retro settings)",
        _DROP,
        value=True,
    ),
    _r("--retro-add-retriever --retro-return-doc-ids", _NOT_GPT + " (Retro settings)", _DROP),
    _r(
        "--num-classes --img-h --img-w --num-channels --patch-dim --classes-fraction "
        "--data-per-class-fraction --head-lr-mult --vision-pretraining-type --vision-backbone-type "
        "--swin-backbone-type --mask-type --mask-factor --iter-per-epoch --dino-local-img-size "
        "--dino-local-crops-number --dino-head-hidden-size --dino-bottleneck-size --dino-freeze-last-layer "
        "--dino-warmup-teacher-temp --dino-teacher-temp --dino-warmup-teacher-temp-epochs",
        _NOT_GPT + " (vision ViT/Swin/DINO settings)",
        _DROP,
        value=True,
    ),
    _r(
        "--no-data-sharding --vision-pretraining --dino-norm-last-layer",
        _NOT_GPT + " (vision ViT/Swin/DINO settings)",
        _DROP,
    ),
)
"""Every refused Megatron-DeepSpeed flag, with its reason and what to use instead."""


def refused_by_flag() -> dict[str, RefusedFlag]:
    """Spelling -> its entry."""
    return {flag: entry for entry in REFUSED for flag in entry.flags}
