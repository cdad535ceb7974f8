"""The acceptance run: lm-evaluation-harness at TP 2 x PP 2 from an imported checkpoint against lm_eval's ``hf``
backend on the Hugging Face directory it came from, and ``tools/eval_harness.py`` launched at TP 1 x PP 2.

One spawn of 4 ranks: every rank runs :func:`evaluate_tasks` on the four example tasks and must return the same
metrics and the same answer to every request (and the same greedy flags and log p of transformers' greedy
continuation, which are all true); those answers must equal ``HFLM``'s (log-likelihoods within
``TOL``, greedy flags and generated text equal) and the accuracy-type metrics must be identical. The CLI's
results file must hold the same metrics. Slow: two spawns and a checkpoint import (~1 minute on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megatron.testing import run_distributed
from tests.evaluation.models import TASKS, make_checkpoint, make_hf_dir
from tests.evaluation.test_eval_harness import (
    TASK_NAMES,
    RecordingTridentLM,
    assert_greedy_flags,
    assert_same_answers,
    assert_same_metrics,
    greedy_requests,
    hf_reference,
)

LIMIT = 6


def _evaluate_on_every_rank(ck: str, greedy: list[Any]) -> tuple[Any, ...]:
    from megatron.evaluation import evaluate_tasks
    from megatron.text_generation import TextGenerator
    from megatron.text_generation.distributed import (
        destroy_inference_distributed,
        init_inference_distributed,
    )
    from megatron.text_generation.scoring import score_tokens

    layout = init_inference_distributed(2, 2, ckpt_dir=ck, device="cpu")
    gen = TextGenerator.from_checkpoint(ck, device="cpu", layout=layout)
    lm = RecordingTridentLM(gen.engine, gen.tokenizer, batch_size=3)  # 2 micro-batches in the pipe
    results = evaluate_tasks(lm, TASK_NAMES, include_path=str(TASKS), limit=LIMIT)
    scored = score_tokens(gen.engine, greedy)
    destroy_inference_distributed()
    return results, dict(lm.log), scored


def _tool(argv: list[str]) -> int:
    from tools import eval_harness

    return eval_harness.main(argv)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_tp2_pp2_and_the_cli_match_the_hf_backend(tmp_path: Path) -> None:
    hf = make_hf_dir(tmp_path / "hf")
    ck = str(make_checkpoint(hf, tmp_path / "ckpt"))
    greedy = greedy_requests(hf)
    outs = run_distributed(
        _evaluate_on_every_rank, 4, ck, greedy, init_process_group=False, timeout=900
    )
    ref_metrics, ref_log = hf_reference(hf, LIMIT)
    for results, log, scored in outs:
        assert results == outs[0][0] and scored == outs[0][2]
        assert {k: [repr(x) for x in v] for k, v in log.items()} == {
            k: [repr(x) for x in v] for k, v in outs[0][1].items()
        }
    worst = assert_same_answers(outs[0][1], ref_log)
    print(f"TP 2 x PP 2: largest |ours - hf| per request type: {worst}")
    assert_same_metrics(outs[0][0], ref_metrics)
    assert_greedy_flags(
        outs[0][2], hf
    )  # vocabulary-parallel greedy flags, the target in either TP shard

    out = tmp_path / "results.json"
    argv = [
        "--load", ck, "--device", "cpu", "--pipeline-model-parallel-size", "2",
        "--tasks", ",".join(TASK_NAMES), "--include-path", str(TASKS), "--limit", str(LIMIT),
        "--batch-size", "4", "--output-path", str(out),
    ]  # fmt: skip
    assert run_distributed(_tool, 2, argv, init_process_group=False, timeout=900) == [0, 0]
    written = json.loads(out.read_text())
    assert written["config"]["pipeline_model_parallel_size"] == 2
    assert_same_metrics(written["results"], ref_metrics)
