"""End-of-training evaluations (Megatron's): validation, then the test split; --skip-train; relaunching a finished
run. Real pretrain() calls on one gloo rank."""

from __future__ import annotations

import json
from pathlib import Path

from megatron.model.presets import GPT2_FLAGS
from megatron.testing import run_distributed
from megatron.training.metrics import read_metrics

FLAGS = [
    *GPT2_FLAGS, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--train-iters", "4", "--mock-data", "--vocab-size", "99",
    "--eval-iters", "2", "--eval-interval", "2", "--log-interval", "1", "--log-level", "WARNING",
    "--seed", "5",
]  # fmt: skip


def _scenario(tmp: str) -> dict:
    from megatron.config import parse_args
    from megatron.training import pretrain

    ck = f"{tmp}/ckpt"
    trained = pretrain(parse_args([*FLAGS, "--save", ck, "--metrics-file", f"{tmp}/a.jsonl"]))
    skip = pretrain(
        parse_args([*FLAGS, "--load", ck, "--skip-train", "--metrics-file", f"{tmp}/b.jsonl"])
    )
    again = pretrain(parse_args([*FLAGS, "--load", ck, "--save", ck]))  # relaunch, nothing left
    fresh_eval = pretrain(parse_args([*FLAGS, "--skip-train"]))  # the untrained model
    return {
        "trained": (trained.exit_code, trained.iteration, trained.test_loss, len(trained.losses)),
        "skip": (skip.exit_code, skip.iteration, skip.test_loss, skip.losses),
        "again": (again.exit_code, again.iteration, again.test_loss, again.losses),
        "fresh": (fresh_eval.iteration, fresh_eval.test_loss),
    }


def test_test_split_skip_train_and_finished_relaunch(tmp_path: Path) -> None:
    r = run_distributed(_scenario, 1, str(tmp_path), init_process_group=False, timeout=300)[0]
    code, it, test_loss, n = r["trained"]
    assert (code, it, n) == (0, 4, 4) and test_loss is not None
    # --skip-train on the checkpoint: no iterations, the same test loss (same weights, same test samples).
    assert r["skip"] == (0, 4, test_loss, [])
    assert r["again"] == (0, 4, test_loss, [])
    fresh_iter, fresh_test = r["fresh"]
    assert fresh_iter == 0 and fresh_test > test_loss  # training helped on held-out data
    rows = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert rows[-1] == {
        "iteration": 4,
        "test_loss": test_loss,
        "test_ppl": rows[-1]["test_ppl"],
    }
    train, evals = read_metrics(tmp_path / "a.jsonl")  # test records are not training records
    assert [t["iteration"] for t in train] == [1, 2, 3, 4]
    assert [e["iteration"] for e in evals] == [2, 4]
    assert [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()][-1][
        "test_loss"
    ] == test_loss
