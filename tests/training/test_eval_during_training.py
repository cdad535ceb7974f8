"""--eval-harness-tasks during training: lm-evaluation-harness runs on the training model's own weights (an
inference engine at the training layout) every --eval-harness-interval iterations, its scores land in the metrics
file, TensorBoard (and W&B), and the training losses are bit-identical to the same run without it.

Each harness here also seeds and draws from every global random generator after scoring (as a harness that does not
restore them would), so a loss that moved would show that the training side failed to shield the run from it. The
scores at the last iteration are checked against the same evaluation of the checkpoint saved there, loaded at the
same layout: the engine over the training model sees the current weights, in eval mode.
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

ROOT = Path(__file__).resolve().parents[2]
TASKS = ["trident_lastword"]
FLAGS = [
    *GPT2_FLAGS, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "128", "--micro-batch-size", "1",
    "--global-batch-size", "4", "--mock-data",
    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(ROOT / "tests/fixtures/tiny/vocab.json"),
    "--merge-file", str(ROOT / "tests/fixtures/tiny/merges.txt"),
    "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--eval-iters", "0",
    "--log-interval", "1", "--log-level", "WARNING", "--seed", "7", "--lr", "1e-2",
]  # fmt: skip
HARNESS = [
    "--eval-harness-tasks", *TASKS, "--eval-harness-interval", "2", "--eval-harness-limit", "6",
    "--eval-harness-include-path", str(ROOT / "examples/eval_tasks"),
]  # fmt: skip
PROMPT = [5, 17, 42, 8, 99, 3, 61, 27]


def _scramble_rng(iteration: int) -> None:
    torch.manual_seed(iteration)
    random.seed(iteration)
    np.random.seed(iteration)
    torch.rand(3), random.random(), np.random.rand()


def _recording(factory, calls: list[tuple[int, bool]]):
    """``factory``'s harness, recording (iteration, module.training) and scrambling the global RNGs after it."""

    def build(model):
        harness = factory(model)

        def run(iteration: int) -> dict[str, dict[str, float]]:
            calls.append((iteration, model.module.training))
            scores = harness(iteration)
            _scramble_rng(iteration)
            return scores

        return run

    return build


def _prompt_logp(engine) -> float:
    from megatron.text_generation.engine import TokenRequest
    from megatron.text_generation.sampling import SamplingParams

    request = TokenRequest(
        PROMPT, 1, SamplingParams(greedy=True), torch.Generator(), log_probs=True
    )
    (result,) = engine.generate([request])
    return float(sum(result.prompt_log_probs))


def _fixed_prompt_factory(model):
    """A harness without lm_eval: log p of :data:`PROMPT` on the training model."""
    from megatron.text_generation.training_model import training_inference_engine

    engine = training_inference_engine(
        model.module, pp_group=model.state.get_pipeline_model_parallel_group(), device=model.device
    )
    return lambda iteration: {"fixed_prompt": {"logp": _prompt_logp(engine)}}


def _checkpoint_scores(
    ckpt: str, tag: str, grid: tuple[int, int], lm_eval: bool
) -> dict[str, dict[str, float]]:
    """The same evaluation of the checkpoint ``tag``, loaded at the training layout (TP x PP)."""
    from megatron.mpu import parallel_state
    from megatron.text_generation.distributed import load_stage
    from megatron.text_generation.engine import InferenceEngine

    state = parallel_state.initialize_model_parallel(*grid)
    try:
        pp_group = state.get_pipeline_model_parallel_group()
        stage, _, _ = load_stage(
            ckpt, tag, tp_group=state.get_tensor_model_parallel_group(), pp_group=pp_group
        )
        engine = InferenceEngine(stage, pp_group=pp_group, device=torch.device("cpu"))
        if not lm_eval:
            return {"fixed_prompt": {"logp": _prompt_logp(engine)}}
        from megatron.evaluation import TridentLM, evaluate_tasks
        from megatron.training.preflight import preflight

        tokenizer = preflight(parse_args([*FLAGS, "--train-iters", "1"])).tokenizer
        lm = TridentLM(engine, tokenizer, seed=7)
        include = str(ROOT / "examples/eval_tasks")
        return evaluate_tasks(lm, TASKS, include_path=include, limit=6)
    finally:
        parallel_state.destroy_model_parallel()


def _scenario(
    tmp: str, layout: list[str], grid: tuple[int, int], extra: list[str], lm_eval: bool
) -> dict:
    """Train ``iters`` (the last of ``extra``'s flags) with and without the harness every 2 iterations."""
    import os

    import pretrain_gpt
    from megatron.training import pretrain

    os.environ.pop("WANDB_MODE", None)  # offline
    calls: list[tuple[int, bool]] = []
    out = [
        "--metrics-file", f"{tmp}/harness.jsonl", "--tensorboard-dir", f"{tmp}/tb",
        "--save", f"{tmp}/ckpt", "--save-interval", "2",
    ]  # fmt: skip
    fixed = ["--eval-harness-tasks", "fixed_prompt", "--eval-harness-interval", "2"]
    harness_flags = HARNESS if lm_eval else fixed
    cfg = parse_args([*FLAGS, *layout, *harness_flags, *out, *extra])
    factory = pretrain_gpt.eval_harness_factory(cfg) if lm_eval else _fixed_prompt_factory
    with_eval = pretrain(cfg, eval_harness=_recording(factory, calls))
    iters = extra[-1]
    plain = pretrain(parse_args([*FLAGS, *layout, "--train-iters", iters]))
    last = int(iters) // 2 * 2  # the last harness iteration; a checkpoint was saved there
    return {
        "codes": (with_eval.exit_code, plain.exit_code),
        "losses": (with_eval.losses, plain.losses),
        "calls": calls,
        "checkpoint": (
            last,
            _checkpoint_scores(f"{tmp}/ckpt", f"global_step{last}", grid, lm_eval),
        ),
    }


def _tensorboard(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _check_run(tmp_path: Path, results: list[dict], tag: str, iters: int) -> dict[int, dict]:
    """The checks every layout shares; returns the recorded scores by iteration."""
    r = results[0]
    evals = list(range(2, iters + 1, 2))
    assert r["codes"] == (0, 0)
    with_eval, plain = r["losses"]
    # bit-identical (the same floats), also after the evaluations (dropout draws from the restored streams)
    assert len(plain) == iters and with_eval == plain
    for rank in results:
        assert rank["calls"] == [(i, False) for i in evals]  # every rank, eval mode inside
    rows = [json.loads(x) for x in (tmp_path / "harness.jsonl").read_text().splitlines()]
    assert [row["lm_loss"] for row in rows if "lm_loss" in row] == plain
    scores = {row["iteration"]: row["eval_harness"] for row in rows if "eval_harness" in row}
    assert sorted(scores) == evals
    # the engine over the training model scores like the model saved at the same iteration
    last, saved = r["checkpoint"]
    for task, metrics in saved.items():
        assert scores[last][task] == pytest.approx(metrics, rel=1e-6, abs=1e-6), task
    task, metric = tag.split("/")
    tb = _tensorboard(tmp_path / "tb")
    assert [s for s, _ in tb[f"eval-harness/{tag}"]] == evals
    assert [v for _, v in tb[f"eval-harness/{tag}"]] == pytest.approx(
        [scores[i][task][metric] for i in evals], rel=1e-6
    )
    return scores


def test_eval_harness_during_training_pp2(tmp_path: Path) -> None:
    """PP = 2 (``GPTStage.from_pipe``: the pipe stages shared), dropout on, a local lm_eval task through
    ``pretrain_gpt.py``'s factory at iteration 2 of 3 (one evaluation, for the suite's time; the slow test has
    two)."""
    results = run_distributed(
        _scenario,
        2,
        str(tmp_path),
        ["--pipeline-model-parallel-size", "2"],
        (1, 2),
        ["--train-iters", "3"],
        True,
        init_process_group=False,
        timeout=300,
    )
    scores = _check_run(tmp_path, results, "trident_lastword/perplexity", 3)
    assert set(scores[2]) == set(TASKS)
    assert {"acc", "perplexity"} <= set(scores[2]["trident_lastword"])


@pytest.mark.slow
def test_eval_harness_during_training_tp2_dp2(tmp_path: Path) -> None:
    """TP = 2 x DP = 2 at PP = 1 (``GPTStage.from_model``), ZeRO-1, untied head, RMSNorm, activation
    checkpointing, a harness without lm_eval: every DP replica evaluates (the same scores); the scores also reach
    W&B (offline)."""
    layout = [
        "--tensor-model-parallel-size", "2", "--zero-stage", "1",
        "--untie-embeddings-and-output-weights", "--normalization", "rmsnorm", "--checkpoint-activations",
    ]  # fmt: skip
    wandb = ["--wandb-project", "trident-test", "--wandb-save-dir", str(tmp_path / "wb")]
    results = run_distributed(
        _scenario,
        4,
        str(tmp_path),
        layout,
        (2, 1),
        [*wandb, "--train-iters", "4"],
        False,
        init_process_group=False,
        timeout=600,
    )
    scores = _check_run(tmp_path, results, "fixed_prompt/logp", 4)
    # the harness sees the weights as they are trained
    assert scores[2]["fixed_prompt"]["logp"] != scores[4]["fixed_prompt"]["logp"]
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


def test_eval_harness_include_path_must_be_a_directory(tmp_path: Path) -> None:
    from megatron.training.preflight import check_eval_harness_include_path

    check_eval_harness_include_path(None)
    check_eval_harness_include_path(str(ROOT / "examples/eval_tasks"))
    with pytest.raises(
        FileNotFoundError, match=r"--eval-harness-include-path .*: no such directory"
    ):
        check_eval_harness_include_path(str(tmp_path / "missing"))
