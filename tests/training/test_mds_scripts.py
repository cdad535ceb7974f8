"""Megatron-DeepSpeed's own GPT/LLaMA launch scripts run unchanged on Trident (issue #11's acceptance test).

The flag lines of 12 scripts of ``examples_deepspeed/`` (microsoft/Megatron-DeepSpeed), written out here as data:
every flag and value the script passes with its default settings, in its order, with only these changes:

* sizes shrunk: layers, hidden, heads, FFN, sequence length, batch sizes, iterations / tokens / samples (so that
  every run is exactly 2 iterations), eval iterations, and the parallel layout folded into 1 or 4 CPU ranks (the
  TP/PP degrees kept where 4 ranks hold them; a degree > 1 that does not fit is halved to 2);
* paths: data, vocab, checkpoints and TensorBoard point at ``tests/fixtures/tiny`` and a tmp directory; the LLaMA
  scripts' SentencePiece tokenizer (a file we cannot ship) becomes ``--mock-data`` with a vocabulary size;
* dtype: ``--fp16`` (CUDA only) becomes ``--bf16`` and the DeepSpeed JSON the script writes is rebuilt with the shrunk
  batch sizes (its ``fp16`` section becomes ``bf16``; fp16-only flags such as ``--hysteresis`` stay: they are
  accepted and only act under fp16).

Each script runs 2 iterations. All scripts of one world size run one after another in ONE spawned process group
(``pretrain`` can be called again in the same process), so the whole test spawns twice. A script whose flags
include ones other parts of issue #11 are still building (``PENDING`` below) fails until they land; every other
script must pass.
"""

from __future__ import annotations

import json
import math
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from megatron.testing import run_distributed

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"

# Flags of other parts of issue #11 (activation checkpointing, logging, ramp-up) that some scripts use.
PENDING = {
    "--deepspeed-activation-checkpointing": "DeepSpeed activation checkpointing",
    "--partition-activations": "DeepSpeed activation checkpointing",
    "--tensorboard-queue-size": "logging",
    "--log-timers-to-tensorboard": "logging",
    "--log-batch-size-to-tensorboard": "logging",
    "--log-validation-ppl-to-tensorboard": "logging",
    "--log-optimizer-states-to-tensorboard": "logging",
    "--rampup-batch-size": "batch-size ramp-up",
}

SEQ = 16
GPT = ("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4")
GPT2_DATA = (
    "--vocab-file",
    "{VOCAB}",
    "--merge-file",
    "{MERGES}",
    "--data-path",
    "{DATA}",
    "--data-impl",
    "mmap",
)
TOKENS = str(2 * 4 * SEQ)  # 2 iterations of a 4-sequence global batch
"""--train-tokens of the token-scheduled scripts: the run stops on tokens after exactly 2 iterations."""


@dataclass(frozen=True)
class MdsScript:
    """One Megatron-DeepSpeed launch script, shrunk."""

    source: str
    """Its path in microsoft/Megatron-DeepSpeed."""
    world: int
    flags: tuple[str, ...]
    """Its flags in its order; {DATA} {VOCAB} {MERGES} {OUT} {DS_CONFIG} are filled in per run."""
    ds_config: dict[str, Any] | None = None
    """The DeepSpeed JSON the script writes (shrunk), written to {DS_CONFIG}."""
    tokens: int = 0
    """Token-based schedule: the tokens consumed when --train-tokens stops the run (0: not token-based)."""
    pending: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pending", tuple(f for f in self.flags if f in PENDING))


def _template_json(zero_stage: int, *, micro: int = 1) -> dict[str, Any]:
    """rebase/ and MoE/ ds_config_gpt_TEMPLATE.json with the sizes filled in (fp16 section -> bf16 on CPU)."""
    return {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": micro,
        "steps_per_print": 10,
        "zero_optimization": {"stage": zero_stage},
        "gradient_clipping": 1.0,
        "prescale_gradients": zero_stage == 0,
        "bf16": {"enabled": True},
        "wall_clock_breakdown": False,
    }


def _rebase(source: str, *, tp: int, pp: int, zero: int, extra: tuple[str, ...] = (),
            ds: bool = True, ckpt: tuple[str, ...] = ("--checkpoint-activations",)) -> MdsScript:  # fmt: skip
    """examples_deepspeed/rebase/ds_pretrain_gpt_*.sh: one template, model size and layout vary."""
    megatron = (
        "--override-opt_param-scheduler", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--tensor-model-parallel-size", str(tp), "--init-method-std", "0.013",
        "--lr-decay-tokens", TOKENS, "--lr-warmup-tokens", str(SEQ * 4),
        "--micro-batch-size", "1", "--exit-duration-in-mins", "30000000", "--global-batch-size", "4",
        *GPT, "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
        "--train-tokens", TOKENS, "--train-samples", "24", "--lr", "2.0e-4", "--min-lr", "1.0e-6",
        "--lr-decay-style", "cosine", "--split", "949,50,1", "--log-interval", "10", "--eval-interval", "100",
        "--eval-iters", "1", "--save-interval", "100", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--hysteresis", "2", "--num-workers", "0", "--bf16", "--seed", "1234",
        "--load", "{OUT}/checkpoint", "--save", "{OUT}/checkpoint",
        "--no-async-tensor-model-parallel-allreduce", "--tensorboard-queue-size", "1",
        "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
        "--tensorboard-dir", "{OUT}/tensorboard", *extra, *ckpt, "--log-optimizer-states-to-tensorboard",
    )  # fmt: skip
    deepspeed: tuple[str, ...] = ("--pipeline-model-parallel-size", str(pp))
    if ds:
        deepspeed = (
            "--deepspeed",
            "--deepspeed_config",
            "{DS_CONFIG}",
            "--zero-stage",
            str(zero),
            *deepspeed,
        )
    if pp == 1:
        deepspeed += ("--no-pipeline-parallel",)
    if ds and ckpt == ("--checkpoint-activations",):
        deepspeed += ("--deepspeed-activation-checkpointing",)
    return MdsScript(
        source, 4 if tp * pp > 1 else 1, (*megatron, *GPT2_DATA, *deepspeed),
        _template_json(zero) if ds else None, tokens=int(TOKENS),
    )  # fmt: skip


def _moe_dense(source: str) -> MdsScript:
    """examples_deepspeed/MoE/ds_pretrain_gpt_*_dense.sh: a dense model through the MoE template (EP_SIZE=1)."""
    megatron = (
        "--override-opt_param-scheduler", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--tensor-model-parallel-size", "1", "--moe-expert-parallel-size", "1", "--num-experts", "1",
        "--moe-loss-coeff", "0.01", "--moe-train-capacity-factor", "1.0", "--moe-eval-capacity-factor", "1.0",
        "--moe-min-capacity", "4", "--init-method-std", "0.014",
        "--lr-decay-tokens", TOKENS, "--lr-warmup-tokens", str(SEQ * 4),
        "--micro-batch-size", "2", "--exit-duration-in-mins", "30000000", "--global-batch-size", "4",
        *GPT, "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
        "--train-tokens", TOKENS, "--train-samples", "24", "--lr", "3.0e-4", "--min-lr", "3.0e-5",
        "--lr-decay-style", "cosine", "--split", "98,2,0", "--log-interval", "10", "--eval-interval", "100",
        "--eval-iters", "1", "--save-interval", "1000", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--hysteresis", "2", "--num-workers", "0", "--bf16",
        "--load", "{OUT}/checkpoint", "--save", "{OUT}/checkpoint", "--tensorboard-queue-size", "1",
        "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
        "--tensorboard-dir", "{OUT}/tensorboard", "--checkpoint-activations",
    )  # fmt: skip
    deepspeed = (
        "--deepspeed", "--deepspeed_config", "{DS_CONFIG}", "--pipeline-model-parallel-size", "1",
        "--no-pipeline-parallel", "--deepspeed-activation-checkpointing",
    )  # fmt: skip
    return MdsScript(
        source,
        1,
        (*megatron, *GPT2_DATA, *deepspeed),
        _template_json(0, micro=2),
        tokens=int(TOKENS),
    )


def _llama(source: str, *, gqa: bool, wandb: bool = False) -> MdsScript:
    """examples_deepspeed/pretrain_llama{,2}_distributed.sh (TP 2 x PP 2, ZeRO 0, bf16)."""
    flags = (
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        *GPT, "--ffn-hidden-size", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--train-iters", "2",
        "--save", "{OUT}/checkpoint", "--load", "{OUT}/checkpoint", "--mock-data", "--vocab-size", "320",
        "--data-impl", "mmap", "--split", "949,50,1", "--distributed-backend", "gloo",
        "--lr", "3e-4", "--lr-decay-style", "cosine", "--min-lr", "3e-5", "--weight-decay", "0.1",
        "--clip-grad", "1", "--lr-warmup-iters", "1", "--optimizer", "adam", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
        "--eval-iters", "1", "--bf16", "--no-query-key-layer-scaling", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights",
        "--swiglu", "--normalization", "rmsnorm", "--disable-bias-linear",
    )  # fmt: skip
    if gqa:
        flags += ("--num-key-value-heads", "2")
    if wandb:
        flags += (
            "--wandb-project",
            "pretrain-llama2",
            "--wandb-exp-name",
            "exp0",
            "--wandb-save-dir",
            "{OUT}/wandb",
        )
    flags += ("--zero-stage=0", "--deepspeed_config={DS_CONFIG}", "--deepspeed")
    ds = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 1,
        "zero_optimization": {"stage": 0},
        "bf16": {"enabled": True},
    }
    return MdsScript(source, 4, flags, ds)


def _universal(source: str, *, llama: bool) -> MdsScript:
    """examples_deepspeed/universal_checkpointing/{megatron_gpt,llama}/run_*bf16.sh (TP 2 x PP 2, ZeRO 1)."""
    flags = (
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--ds-sequence-parallel-size", "1", *GPT,
    )  # fmt: skip
    if llama:
        flags += ("--ffn-hidden-size", "64")
    flags += (
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1",
        "--global-batch-size", "4", "--train-iters", "2", "--lr", "6.0e-3", "--min-lr", "6.0e-4",
        "--lr-decay-style", "cosine", "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "10",
    )  # fmt: skip
    if llama:
        flags += ("--mock-data", "--vocab-size", "320", "--data-impl", "mmap", "--split", "949,50,1",
                  "--optimizer", "adam", "--save", "{OUT}/checkpoint", "--load", "{OUT}/checkpoint",
                  "--bf16", "--no-query-key-layer-scaling", "--attention-dropout", "0", "--hidden-dropout", "0",
                  "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights", "--swiglu",
                  "--normalization", "rmsnorm", "--disable-bias-linear", "--exit-interval", "2")  # fmt: skip
    else:
        flags += ("--data-path", "{DATA}", "--vocab-file", "{VOCAB}", "--merge-file", "{MERGES}",
                  "--save-interval", "100", "--split", "98,2,0", "--clip-grad", "1.0", "--weight-decay", "0.1",
                  "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006", "--bf16",
                  "--checkpoint-activations", "--exit-interval", "2", "--save", "{OUT}/checkpoint",
                  "--load", "{OUT}/checkpoint", "--make-vocab-size-divisible-by", "256",
                  "--tensorboard-dir", "{OUT}/tensorboard")  # fmt: skip
    flags += ("--deepspeed", "--deepspeed_config={DS_CONFIG}", "--zero-stage=1")
    if not llama:
        flags += ("--deepspeed-activation-checkpointing",)
    ds = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 1,
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": True},
        "wall_clock_breakdown": False,
    }
    return MdsScript(source, 4, flags, ds)


def _offload_pp() -> MdsScript:
    """examples_deepspeed/offload_pp/ds_pretrain_gpt_350M.sh: the MoE-template dense run with batch-size ramp-up."""
    base = _moe_dense("examples_deepspeed/offload_pp/ds_pretrain_gpt_350M.sh")
    flags = list(base.flags)
    at = flags.index("--global-batch-size")
    flags[at:at] = [
        "--rampup-batch-size",
        "2",
        "2",
        "8",
    ]  # 2 sequences for the first 8 samples, then 4
    flags[flags.index("--train-tokens") + 1] = str(
        2 * 2 * SEQ
    )  # 2 iterations of 2 sequences: still ramping
    return MdsScript(base.source, 1, tuple(flags), base.ds_config, tokens=2 * 2 * SEQ)


SCRIPTS: tuple[MdsScript, ...] = (
    _rebase("examples_deepspeed/rebase/ds_pretrain_gpt_125M.sh", tp=1, pp=2, zero=1),
    _rebase("examples_deepspeed/rebase/ds_pretrain_gpt_1.3B.sh", tp=2, pp=1, zero=0),
    _rebase("examples_deepspeed/rebase/ds_pretrain_gpt_13B.sh", tp=4, pp=1, zero=0),
    _rebase(
        "examples_deepspeed/rebase/ds_pretrain_gpt_1.3B_rope.sh",
        tp=2,
        pp=2,
        zero=1,
        extra=("--use-rotary-position-embeddings", "--rotary-percent", "0.25"),
    ),  # fmt: skip
    _rebase(
        "examples_deepspeed/rebase/ds_pretrain_gpt_125M_flashattn.sh",
        tp=1,
        pp=2,
        zero=1,
        extra=("--use-flash-attn",),
    ),  # fmt: skip
    _rebase(
        "examples_deepspeed/rebase/ds_pretrain_gpt_1.3B_megatron_checkpointing.sh",
        tp=2,
        pp=1,
        zero=0,
        ds=False,
        ckpt=(
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ),
    ),  # fmt: skip
    _moe_dense("examples_deepspeed/MoE/ds_pretrain_gpt_350M_dense.sh"),
    _offload_pp(),
    _llama("examples_deepspeed/pretrain_llama_distributed.sh", gqa=False),
    _llama("examples_deepspeed/pretrain_llama2_distributed.sh", gqa=True),
    _universal("examples_deepspeed/universal_checkpointing/megatron_gpt/run_bf16.sh", llama=False),
    _universal("examples_deepspeed/universal_checkpointing/llama/run_llama_bf16.sh", llama=True),
)


def _argv(script: MdsScript, out: Path) -> list[str]:
    fill = {
        "{DATA}": str(TINY / "tiny_text_document"),
        "{VOCAB}": str(TINY / "vocab.json"),
        "{MERGES}": str(TINY / "merges.txt"),
        "{OUT}": str(out),
        "{DS_CONFIG}": str(out / "ds_config.json"),
    }
    argv = []
    for flag in script.flags:
        for key, value in fill.items():
            flag = flag.replace(key, value)
        argv.append(flag)
    return [*argv, "--data-cache-path", str(out / "cache"), "--log-level", "WARNING"]


def _run_scripts(tmp: str, indices: list[int]) -> dict[int, dict[str, Any]]:
    """On every rank: run each script 2 iterations, one after another; a failure is recorded, not raised."""
    from megatron.config import parse_args
    from megatron.training import pretrain

    results: dict[int, dict[str, Any]] = {}
    for i in indices:
        script = SCRIPTS[i]
        try:
            cfg = parse_args(_argv(script, Path(tmp) / f"s{i}"))
        except ValueError as e:  # the same on every rank: no collective was started
            results[i] = {"error": f"parse: {e}"}
            continue
        try:
            r = pretrain(cfg)
        except Exception:  # noqa: BLE001 - reported per script by the test
            results[i] = {"error": traceback.format_exc(limit=-3)}
            break  # the process group may be mid-collective: stop this world's run here
        results[i] = {
            "exit_code": r.exit_code,
            "iteration": r.iteration,
            "losses": r.losses,
            "tokens": r.consumed_train_tokens,
            "out": str(Path(tmp) / f"s{i}"),
        }
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("mds_scripts")
    merged: dict[int, dict[str, Any]] = {}
    for world in (1, 4):
        # Scripts that need nothing pending first: a failure that breaks the group then hits pending ones only.
        indices = sorted(
            (i for i, s in enumerate(SCRIPTS) if s.world == world),
            key=lambda i: bool(SCRIPTS[i].pending),
        )
        for i in indices:  # the JSON each script writes before it launches
            out = tmp / f"w{world}" / f"s{i}"
            out.mkdir(parents=True)
            if SCRIPTS[i].ds_config is not None:
                (out / "ds_config.json").write_text(json.dumps(SCRIPTS[i].ds_config))
        ranks = run_distributed(
            _run_scripts,
            world,
            str(tmp / f"w{world}"),
            indices,
            timeout=300,
            init_process_group=False,
        )
        merged.update(ranks[0])
    return merged


def test_at_least_ten_scripts() -> None:
    assert len({s.source for s in SCRIPTS}) >= 10
    assert (
        sum(1 for s in SCRIPTS if s.world == 4) >= 5 and sum(1 for s in SCRIPTS if s.pending) >= 5
    )


@pytest.mark.parametrize("index", range(len(SCRIPTS)), ids=[Path(s.source).name for s in SCRIPTS])
def test_mds_script_trains_two_iterations(results: dict[int, dict[str, Any]], index: int) -> None:
    script = SCRIPTS[index]
    r = results.get(index)
    waiting = f" (needs pending flags {', '.join(script.pending)})" if script.pending else ""
    assert r is not None, (
        f"{script.source}: not run (an earlier script broke the process group){waiting}"
    )
    assert "error" not in r, f"{script.source}{waiting}:\n{r['error']}"
    assert r["exit_code"] == 0 and r["iteration"] == 2, r
    assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"]), r
    if script.tokens:  # stopped by --train-tokens, well before --train-samples
        assert r["tokens"] == script.tokens, r
    if "--tensorboard-dir" in script.flags:
        assert list((Path(r["out"]) / "tensorboard").glob("events.out.tfevents.*")), r
    if (
        "--save" in script.flags
    ):  # saved at the last iteration (Trident saves at the end of every run)
        assert (Path(r["out"]) / "checkpoint" / "latest").read_text().strip() == "global_step2", r


def test_their_json_may_repeat_a_raised_zero_stage() -> None:
    """pretrain_llama2_distributed.sh writes "stage": 0 with --zero-stage 0 and PP 2, which Trident runs as ZeRO-1
    (pipeline + clipping): the JSON agrees with the flag, so it is accepted; another stage is still an error."""
    from megatron.config import parse_args
    from megatron.config.plan import RunPlan
    from megatron.training.ds_config import build_ds_config

    cfg = parse_args(
        [*GPT, "--pipeline-model-parallel-size", "2", "--zero-stage", "0", "--train-iters", "2"]
    )
    plan = RunPlan.build(cfg, world_size=2, true_vocab=100)
    assert (plan.requested_zero_stage, plan.zero_stage) == (0, 1)
    ds = build_ds_config(cfg, plan, {"zero_optimization": {"stage": 0}})
    assert ds["zero_optimization"]["stage"] == 1
    with pytest.raises(ValueError, match=r"--zero-stage \(1\).*has zero_optimization.stage = 2"):
        build_ds_config(cfg, plan, {"zero_optimization": {"stage": 2}})
