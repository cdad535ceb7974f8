"""lm-evaluation-harness on Trident against lm_eval's own ``hf`` backend on the same model.

A tiny random LLaMA with a real GPT-2 BPE tokenizer is one Hugging Face directory (the oracle: ``HFLM``) and, through
our converter, a Trident model (``TridentLM``). Every request lm_eval issues for the four example tasks
(``examples/eval_tasks``: last word by loglikelihood and by greedy generation, multiple choice, rolling perplexity)
must get the same answer from both: log-likelihoods within ``TOL``, the greedy flags and generated strings equal, and
so the accuracy-type metrics identical. One process here (TP 1, the default suite); TP 2 x PP 2 from the imported
checkpoint, and the CLI, in ``test_eval_harness_parallel.py`` (slow).

Tolerance: both sides compute fp32 logits of the same weights; the sums differ by fp32 rounding of ~60 log-probs of
magnitude up to ~25 (``HFLM`` sums in fp32, we in fp64), a few 1e-5 at most, so ``1e-4 + 1e-6 * |value|``.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron.evaluation import TridentLM, evaluate_tasks, task_manager, task_specs
from megatron.text_generation.scoring import ScoreRequest, score_tokens
from tests.evaluation.models import TASKS, make_hf_dir, whole_model_engine
from tools import eval_harness

TASK_NAMES = ["trident_lastword", "trident_lastword_gen", "trident_choice", "trident_perplexity"]
TOL = 1e-4
EXACT = ("acc", "acc_norm", "exact_match,first-word", "sample_len")
"""Metrics that must be identical (counts of equal decisions); the perplexities are compared within TOL."""


class _Recording:
    """Records every request's arguments and answer, per request type (mixed into both LMs)."""

    log: dict[str, list[tuple[Any, Any]]]

    def _record(self, kind: str, requests: list[Any], out: list[Any]) -> list[Any]:
        if not hasattr(self, "log"):
            self.log = defaultdict(list)
        self.log[kind] += [(r.args, o) for r, o in zip(requests, out, strict=True)]
        return out

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        return self._record("ll", requests, super().loglikelihood(requests, disable_tqdm=True))  # type: ignore[misc]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        return self._record("rolling", requests, super().loglikelihood_rolling(requests, True))  # type: ignore[misc]

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        return self._record("gen", requests, super().generate_until(requests, True))  # type: ignore[misc]


class RecordingTridentLM(_Recording, TridentLM):
    pass


def hf_reference(
    hf_dir: Path, limit: int
) -> tuple[dict[str, Any], dict[str, list[tuple[Any, Any]]]]:
    """``HFLM`` on ``hf_dir``: the metrics (our naming) and every request's answer."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    class RecordingHFLM(_Recording, HFLM):
        pass

    hf = RecordingHFLM(pretrained=str(hf_dir), batch_size=3, device="cpu")
    manager = task_manager(TASK_NAMES, str(TASKS))
    out = simple_evaluate(
        model=hf,
        tasks=task_specs(TASK_NAMES, manager),
        limit=limit,
        task_manager=manager,
        bootstrap_iters=0,
        log_samples=False,
    )
    assert out is not None
    metrics = {
        t: {k.removesuffix(",none"): float(v) for k, v in m.items() if isinstance(v, int | float)}
        for t, m in out["results"].items()
    }
    return metrics, hf.log


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL + 1e-6 * abs(b)


def assert_same_answers(ours: dict[str, list], ref: dict[str, list]) -> dict[str, float]:
    """Every request of ``ref`` answered alike by ``ours``; returns the largest difference per request type."""
    assert set(ours) == set(ref) == {"ll", "rolling", "gen"}
    worst = {}
    for kind, answers in ref.items():
        mine = {repr(args): out for args, out in ours[kind]}
        assert len(mine) == len(answers) > 0
        diffs = [0.0]
        for args, want in answers:
            got = mine[repr(args)]
            if kind == "gen":
                assert got == want, (args, got, want)
                continue
            value, ref_value = (got[0], want[0]) if kind == "ll" else (got, want)
            assert close(value, ref_value), (args, value, ref_value)
            diffs.append(abs(value - ref_value))
            if kind == "ll":
                assert got[1] == want[1], (args, got, want)
        worst[kind] = max(diffs)
    return worst


def assert_same_metrics(
    ours: dict[str, dict[str, float]], ref: dict[str, dict[str, float]]
) -> None:
    assert set(ours) == set(ref) == set(TASK_NAMES)
    for task, metrics in ref.items():
        assert set(ours[task]) == set(metrics), (task, ours[task], metrics)
        for name, value in metrics.items():
            if name in EXACT:
                assert ours[task][name] == value, (task, name, ours[task][name], value)
            else:  # perplexities: exp of a mean log p, so relative
                assert math.isclose(ours[task][name], value, rel_tol=1e-4), (task, name)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_dir(tmp_path_factory.mktemp("eval") / "hf")


@pytest.mark.timeout(300)
def test_trident_lm_answers_every_request_like_the_hf_backend(hf_dir: Path) -> None:
    engine, tokenizer = whole_model_engine(hf_dir)
    lm = RecordingTridentLM(engine, tokenizer, batch_size=3)
    assert lm.max_length == 64  # the model's context, as HFLM reads it from config.json
    rng = torch.get_rng_state()
    ours = evaluate_tasks(lm, TASK_NAMES, include_path=str(TASKS), limit=4)
    assert torch.equal(torch.get_rng_state(), rng)  # lm_eval's seeding undone
    ref_metrics, ref_log = hf_reference(hf_dir, limit=4)
    worst = assert_same_answers(lm.log, ref_log)
    print(f"largest |ours - hf| per request type: {worst}")
    assert_same_metrics(ours, ref_metrics)

    assert_greedy_flags(score_tokens(engine, greedy_requests(hf_dir)), hf_dir)


GREEDY_PROMPT = "The left-hand side target is always set"
GREEDY_NEW = 6


def greedy_requests(hf_dir: Path) -> list[ScoreRequest]:
    """transformers' greedy continuation of a prompt (all its tokens greedy), and the same with its last token
    changed (that one not greedy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    prompt = AutoTokenizer.from_pretrained(str(hf_dir))(GREEDY_PROMPT)["input_ids"]
    with torch.no_grad():
        seq = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_NEW, do_sample=False)[
            0
        ].tolist()
    wrong = seq[:-1] + [(seq[-1] + 1) % 512]
    return [ScoreRequest(seq, GREEDY_NEW), ScoreRequest(wrong, 2)]


def assert_greedy_flags(scored: list[Any], hf_dir: Path) -> None:
    """:func:`score_tokens` on :func:`greedy_requests`: all greedy, then the changed token not; log p within TOL
    of ``log_softmax`` of transformers' logits."""
    from transformers import AutoModelForCausalLM

    seq = greedy_requests(hf_dir)[0].tokens
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
    greedy, other = scored
    assert greedy.greedy == [True] * GREEDY_NEW and other.greedy == [True, False]
    want = [float(logp[i - 1, seq[i]]) for i in range(len(seq) - GREEDY_NEW, len(seq))]
    assert all(close(a, b) for a, b in zip(greedy.log_probs, want, strict=True))


def test_local_data_files_resolve_against_the_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # datasets would resolve data/lastword.jsonl here
    specs = task_specs(["trident_choice"], task_manager(["trident_choice"], str(TASKS)))
    assert specs[0]["dataset_kwargs"]["data_files"] == {
        "test": str(TASKS / "data" / "choice.jsonl")
    }
    assert specs[0]["task"] == "trident_choice" and specs[0]["output_type"] == "multiple_choice"
    # A task folder elsewhere with its data file missing: named with the YAML.
    moved = tmp_path / "tasks"
    moved.mkdir()
    shutil.copy(TASKS / "trident_choice.yaml", moved)
    with pytest.raises(
        FileNotFoundError, match=r"trident_choice .*data/choice.jsonl does not exist"
    ):
        task_specs(["trident_choice"], task_manager(["trident_choice"], str(moved)))
    with pytest.raises(
        ValueError, match=r"unknown task\(s\) nope; .* has: trident_choice, trident_lastword"
    ):
        task_manager(["nope"], str(TASKS))
    with pytest.raises(FileNotFoundError, match="is not a directory of task YAML files"):
        task_manager(["trident_choice"], str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--batch-size", "0"], "--batch-size (0) must be >= 1."),
        (["--limit", "0"], "--limit (0) must be >= 1."),
        (["--output-path", "."], "--output-path . is a directory"),
        (["--output-path", "no/such/dir/r.json"], "the directory no/such/dir does not exist"),
        (["--tasks", "nope"], "unknown task(s) nope"),
    ],
)
def test_tool_refuses_bad_input_before_loading(
    extra: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--load",
        str(tmp_path / "no_ckpt"),
        "--tasks",
        "trident_choice",
        "--include-path",
        str(TASKS),
    ]
    assert eval_harness.main([*argv, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    assert not (tmp_path / "no_ckpt").exists()


def test_results_file_and_table(tmp_path: Path) -> None:
    from megatron.evaluation.report import results_table, write_results

    results = {"trident_choice": {"acc": 0.25, "acc_norm": 0.5}}
    write_results(str(tmp_path / "r.json"), results, {"limit": 4})
    assert json.loads((tmp_path / "r.json").read_text()) == {
        "results": results,
        "config": {"limit": 4},
    }
    assert results_table(results).splitlines()[2].split() == ["trident_choice", "acc", "0.25"]


def test_llama3_tokenization_is_the_hf_backends(tmp_path: Path) -> None:
    """With a tokenizer that adds ``<|begin_of_text|>`` (Llama 3's layout, built offline), ``TridentLM`` encodes
    every kind of request as ``HFLM`` does: context/continuation splits (trailing spaces, an empty context, a
    context typed with the BOS), rolling documents and generation contexts; the same prefix token."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from megatron.testing.tokenizers import FAMILY_SIZES, family_tokenizer

    hf_dir = family_tokenizer("llama3", tmp_path / "hf")
    config = LlamaConfig(
        vocab_size=FAMILY_SIZES["llama3"][1], hidden_size=16, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(hf_dir)
    engine, tokenizer = whole_model_engine(hf_dir)
    ours = TridentLM(engine, tokenizer)
    hf_tok = AutoTokenizer.from_pretrained(str(hf_dir))
    theirs = HFLM(pretrained=LlamaForCausalLM(config), tokenizer=hf_tok, backend="causal")
    assert ours.prefix_token_id == theirs.prefix_token_id == 128_000
    pairs = [
        ("Question: what is it?  ", "An answer."),
        ("", "Starts the document"),
        ("<|begin_of_text|>Typed BOS", " then text"),
        ("Numbers 12345", " and  spaces\n"),
    ]
    encoded: list[Any] = []

    def capture(reqs: list[Any], **kwargs: Any) -> list[tuple[float, bool]]:
        encoded.append([r[1:] for r in reqs])
        return [(0.0, False)] * len(reqs)

    for lm in (ours, theirs):
        lm._loglikelihood_tokens = capture  # type: ignore[method-assign]
        lm.loglikelihood([Instance("loglikelihood", {}, p, 0) for p in pairs], disable_tqdm=True)
    assert encoded[0] == encoded[1] and encoded[0][0][0][0] == 128_000
    for text in ("Plain text, no BOS.", "<|begin_of_text|>with one", ""):
        assert ours.tok_encode(text) == theirs.tok_encode(text), text
        assert ours.tok_encode(text, add_special_tokens=False) == theirs.tok_encode(
            text, add_special_tokens=False
        )
        if text:
            ids, _ = theirs.tok_batch_encode([text])
            assert ours.tok_encode(text) == ids[0].tolist(), text
