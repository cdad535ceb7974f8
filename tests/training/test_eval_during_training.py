"""--eval-harness-tasks during training: the harness runs on the training model's own weights (an inference engine
at the training layout) every --eval-harness-interval iterations, its scores land in the metrics file and
TensorBoard, and the training losses are bit-identical to the same run without it.

The harness here scores a fixed prompt through ``training_inference_engine`` (what ``megatron.evaluation``'s
harness runs lm-evaluation-harness on) and, like lm-evaluation-harness, seeds and draws from every global random
generator, so a loss that moved would show that the training side failed to shield the run from it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.config import parse_args, validate
from megatron.model.presets import GPT2_FLAGS
from megatron.testing import run_distributed

PROMPT = [5, 17, 42, 8, 99, 3, 61, 27]
FLAGS = [
    *GPT2_FLAGS, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
    "--global-batch-size", "4", "--train-iters", "4", "--mock-data", "--vocab-size", "128",
    "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--eval-iters", "0",
    "--log-interval", "1", "--log-level", "WARNING", "--seed", "7", "--lr", "1e-3",
]  # fmt: skip
HARNESS = ["--eval-harness-tasks", "fixed_prompt", "--eval-harness-interval", "2"]


def _prompt_logp(engine) -> float:
    from megatron.text_generation.engine import TokenRequest
    from megatron.text_generation.sampling import SamplingParams

    request = TokenRequest(
        PROMPT, 1, SamplingParams(greedy=True), torch.Generator(), log_probs=True
    )
    (result,) = engine.generate([request])
    return float(sum(result.prompt_log_probs))


def _fixed_prompt_factory(calls: list[tuple[int, bool]]):
    """A harness factory: log p of :data:`PROMPT` on the training model, after scrambling every global RNG."""
    from megatron.text_generation.training_model import training_inference_engine

    def factory(model):
        engine = training_inference_engine(
            model.module,
            pp_group=model.state.get_pipeline_model_parallel_group(),
            device=model.device,
        )

        def harness(iteration: int) -> dict[str, dict[str, float]]:
            calls.append((iteration, model.module.training))
            torch.manual_seed(iteration)  # lm-evaluation-harness seeds the global generators itself
            random.seed(iteration)
            np.random.seed(iteration)
            torch.rand(3), random.random(), np.random.rand()
            return {"fixed_prompt": {"logp": _prompt_logp(engine), "iteration": float(iteration)}}

        return harness

    return factory


def _checkpoint_logp(ckpt: str, tp: int, pp: int) -> float:
    """log p of :data:`PROMPT` from the saved checkpoint, loaded at the training layout (TP x PP)."""
    from megatron.mpu import parallel_state
    from megatron.text_generation.distributed import load_stage
    from megatron.text_generation.engine import InferenceEngine

    state = parallel_state.initialize_model_parallel(tp, pp)
    try:
        pp_group = state.get_pipeline_model_parallel_group()
        stage, _, _ = load_stage(
            ckpt, tp_group=state.get_tensor_model_parallel_group(), pp_group=pp_group
        )
        return _prompt_logp(InferenceEngine(stage, pp_group=pp_group, device=torch.device("cpu")))
    finally:
        parallel_state.destroy_model_parallel()


def _scenario(tmp: str, layout: list[str], tp: int, pp: int, extra: list[str]) -> dict:
    import os

    from megatron.training import pretrain

    os.environ.pop("WANDB_MODE", None)  # offline
    calls: list[tuple[int, bool]] = []
    out = [
        "--metrics-file", f"{tmp}/harness.jsonl", "--tensorboard-dir", f"{tmp}/tb",
        "--save", f"{tmp}/ckpt", "--save-interval", "100", *extra,
    ]  # fmt: skip
    with_eval = pretrain(
        parse_args([*FLAGS, *layout, *HARNESS, *out]), eval_harness=_fixed_prompt_factory(calls)
    )
    plain = pretrain(parse_args([*FLAGS, *layout, "--metrics-file", f"{tmp}/plain.jsonl"]))
    return {
        "codes": (with_eval.exit_code, plain.exit_code),
        "losses": (with_eval.losses, plain.losses),
        "calls": calls,
        "checkpoint_logp": _checkpoint_logp(f"{tmp}/ckpt", tp, pp),
    }


def _tensorboard(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _check_run(tmp_path: Path, results: list[dict]) -> None:
    r = results[0]
    assert r["codes"] == (0, 0)
    with_eval, plain = r["losses"]
    assert len(plain) == 4 and with_eval == plain  # bit-identical: same floats
    for rank in results:
        assert rank["calls"] == [(2, False), (4, False)]  # every rank, eval mode inside the harness
    rows = [json.loads(x) for x in (tmp_path / "harness.jsonl").read_text().splitlines()]
    scores = {row["iteration"]: row["eval_harness"] for row in rows if "eval_harness" in row}
    assert sorted(scores) == [2, 4]
    assert scores[4]["fixed_prompt"]["iteration"] == 4.0
    logp = {it: s["fixed_prompt"]["logp"] for it, s in scores.items()}
    assert logp[2] != logp[4]  # the harness sees the weights as they are trained
    # the engine over the training model scores exactly like the model saved at the same iteration
    assert logp[4] == pytest.approx(r["checkpoint_logp"], rel=1e-6, abs=1e-6)
    tb = _tensorboard(tmp_path / "tb")
    assert [s for s, _ in tb["eval-harness/fixed_prompt/logp"]] == [2, 4]
    assert [v for _, v in tb["eval-harness/fixed_prompt/logp"]] == pytest.approx(
        [logp[2], logp[4]], rel=1e-6
    )
    # the training records are those of the run without the harness
    train_rows = [row["lm_loss"] for row in rows if "lm_loss" in row]
    assert train_rows == plain


def test_eval_harness_during_training_pp2(tmp_path: Path) -> None:
    """PP = 2 (``GPTStage.from_pipe``: the pipe stages shared), dropout on."""
    layout = ["--pipeline-model-parallel-size", "2"]
    results = run_distributed(
        _scenario, 2, str(tmp_path), layout, 1, 2, [], init_process_group=False, timeout=300
    )
    _check_run(tmp_path, results)


@pytest.mark.slow
def test_eval_harness_during_training_tp2_dp2(tmp_path: Path) -> None:
    """TP = 2 x DP = 2 at PP = 1 (``GPTStage.from_model``), ZeRO-1, untied head, RMSNorm: every DP replica
    evaluates (the same scores); the scores also reach W&B (offline)."""
    layout = [
        "--tensor-model-parallel-size", "2", "--zero-stage", "1",
        "--untie-embeddings-and-output-weights", "--normalization", "rmsnorm",
    ]  # fmt: skip
    wandb = ["--wandb-project", "trident-test", "--wandb-save-dir", str(tmp_path / "wb")]
    results = run_distributed(
        _scenario, 4, str(tmp_path), layout, 2, 1, wandb, init_process_group=False, timeout=600
    )
    _check_run(tmp_path, results)
    from tests.training.test_logging_flags import _wandb_history

    (run_file,) = (tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb")
    rows = _wandb_history(run_file)
    tag = "eval-harness/fixed_prompt/logp"
    assert sorted(row["_step"] for row in rows if tag in row) == [2, 4]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--eval-harness-interval", "5"],
            r"--eval-harness-interval \(5\) without --eval-harness-tasks",
        ),
        (["--eval-harness-limit", "3"], r"--eval-harness-limit \(3\) without --eval-harness-tasks"),
        ([*HARNESS[:2], "--eval-harness-interval", "0"], r"--eval-harness-interval \(0\) must be"),
        (
            [*HARNESS, "--eval-harness-num-fewshot", "-1"],
            r"--eval-harness-num-fewshot \(-1\) must be",
        ),
        (
            [*HARNESS, "--tensor-model-parallel-size", "2", "--sequence-parallel"],
            "cannot do with --sequence-parallel",
        ),
        ([*HARNESS, "--zero-stage", "3"], "cannot do with --zero-stage 3"),
    ],
)
def test_eval_harness_flag_rules(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate(parse_args([*FLAGS, *flags]), world_size=2)
