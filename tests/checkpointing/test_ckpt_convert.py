"""HF <-> Trident conversion tools, end to end through the CLIs (real spawned DeepSpeed ranks, real files).

Round trip: tiny random HF model -> ``hf_to_trident`` (TP x PP ranks save through the engine; verified against the
HF model) -> ``trident_to_hf`` (verified) -> the final HF directory is compared with the ORIGINAL HF model: max
|delta logit| <= 1e-5 in fp32 and identical 32-token greedy decodes. The default run covers GPT-2 at TP = PP = 1
(then trained from) and LLaMA-GQA at TP = 2 (then resharded to PP = 2); the full {GPT-2, LLaMA} x TP {1, 2} x
PP {1, 2} matrix and GPT-2 PP = 2 training are ``-m slow``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt_models import VOCAB, make_gpt2, make_llama

from megatron.conversion.verify import compare_logits, fixed_prompts, hf_logits_fn
from megatron.model.presets import GPT2_FLAGS
from megatron.testing import run_distributed
from tools.checkpoint import hf_to_trident, reshard, trident_to_hf

TOL = 1e-5
MAKERS = {"gpt2": make_gpt2, "llama": make_llama}


def _round_trip(tmp_path: Path, kind: str, tp: int, pp: int, capsys) -> Path:
    src = tmp_path / f"hf_{kind}"
    MAKERS[kind]().save_pretrained(src)
    ck = tmp_path / f"ckpt_{kind}_{tp}{pp}"
    argv = ["--hf-dir", str(src), "--save", str(ck), "--tp", str(tp), "--pp", str(pp)]
    assert hf_to_trident.main([*argv, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "-> OK" in out and "greedy agreement = 1.000" in out, out
    meta = json.loads((ck / "global_step0" / "trident_meta.json").read_text())
    assert (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]) == (tp, pp)
    assert meta["weights_only"] is True
    back = tmp_path / f"back_{kind}_{tp}{pp}"
    assert trident_to_hf.main(["--load", str(ck), "--out", str(back), "--no-progress"]) == 0
    assert "-> OK" in capsys.readouterr().out
    # The final HF directory against the ORIGINAL HF model (both directions composed).
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(str(src), local_files_only=True).eval()
    b = AutoModelForCausalLM.from_pretrained(str(back), local_files_only=True).eval()
    prompts, steps = fixed_prompts(VOCAB, 64, 32)
    assert steps == 32
    with torch.no_grad():
        cmp = compare_logits(hf_logits_fn(a), hf_logits_fn(b), prompts, steps, vocab_size=VOCAB)
    assert cmp.max_abs_dlogit <= TOL and cmp.greedy_agreement == 1.0, cmp
    print(f"{kind} TP={tp} PP={pp}: HF -> Trident -> HF max |dlogit| {cmp.max_abs_dlogit:.2e}")
    return ck


def _train_from(ckpt: str, pp: int) -> tuple[list[float], list[float]]:
    """One iteration from the imported GPT-2 checkpoint vs from scratch (same flags, lr 0)."""
    from megatron.config import parse_args
    from megatron.training import pretrain

    flags = [
        *GPT2_FLAGS, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "64", "--vocab-size", str(VOCAB - 1),
        "--pipeline-model-parallel-size", str(pp), "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-iters", "1", "--lr", "0", "--min-lr", "0", "--mock-data", "--eval-iters", "0",
        "--log-level", "WARNING",
    ]  # fmt: skip
    loaded = pretrain(parse_args([*flags, "--load", ckpt]))
    fresh = pretrain(parse_args(flags))
    assert loaded.iteration == 1  # weights only: counted from 0
    if (
        pp == 1
    ):  # the import (ZeRO-0 files) fine-tuned under ZeRO-3: Trident's own weights-only loader
        zero3 = pretrain(parse_args([*flags, "--load", ckpt, "--zero-stage", "3"]))
        assert zero3.losses == pytest.approx(loaded.losses, rel=1e-6)
    return loaded.losses, fresh.losses


@pytest.mark.slow  # ~20 s (suite time): GPT-2's round trip runs in-process in test_ckpt_hf.py, the tool's in the
# llama test below and test_lora_export.py
def test_round_trip_gpt2_and_training_loads_it(tmp_path: Path, capsys) -> None:
    ck = _round_trip(tmp_path, "gpt2", 1, 1, capsys)
    loaded, fresh = run_distributed(_train_from, 1, str(ck), 1, init_process_group=False)[0]
    assert loaded != fresh  # the imported weights were used


@pytest.mark.slow
def test_gpt2_pp2_import_and_training_loads_it(tmp_path: Path, capsys) -> None:
    ck = _round_trip(tmp_path, "gpt2", 1, 2, capsys)
    loaded, fresh = run_distributed(_train_from, 2, str(ck), 2, init_process_group=False)[0]
    assert loaded != fresh


def test_round_trip_llama_gqa_tp2_then_reshard(tmp_path: Path, capsys) -> None:
    ck = _round_trip(tmp_path, "llama", 2, 1, capsys)
    # Offline reshard (TP=2, PP=1) -> (TP=1, PP=2): same weights, so the logits agree exactly.
    dst = tmp_path / "resharded"
    argv = ["--load", str(ck), "--save", str(dst), "--tp", "1", "--pp", "2", "--no-progress"]
    assert reshard.main([*argv, "--tolerance", "0"]) == 0
    assert "max |dlogit| = 0.000e+00" in capsys.readouterr().out
    meta = json.loads((dst / "global_step0" / "trident_meta.json").read_text())
    assert (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]) == (1, 2)
    assert "(global_step0, converted from " in (dst / "model_args.sh").read_text()
    assert sorted(p.name for p in (dst / "global_step0").glob("layer_*"))[0].startswith("layer_01")
    assert reshard.main(["--load", str(ck), "--save", str(dst), "--tp", "1", "--pp", "9"]) == 2
    assert "--pp (9) exceeds the model's 2 layers" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_matrix(tmp_path: Path, capsys, kind: str, tp: int, pp: int) -> None:
    _round_trip(tmp_path, kind, tp, pp, capsys)


def test_tool_errors(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    assert (
        trident_to_hf.main(["--load", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "holds no Trident checkpoint" in err
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10}))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(bert / "model.safetensors"))
    assert hf_to_trident.main(["--hf-dir", str(bert), "--save", str(tmp_path / "c")]) == 2
    assert "model_type 'bert' is not supported" in capsys.readouterr().err
    assert hf_to_trident.main(["--hf-dir", str(tmp_path / "nope"), "--save", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_export_over_tolerance_exits_3(tmp_path: Path, capsys) -> None:
    """A training checkpoint exported with an impossible tolerance: the verification fails with exit 3."""
    run_distributed(_save_tiny, 1, str(tmp_path / "ck"), init_process_group=False)
    argv = ["--load", str(tmp_path / "ck"), "--out", str(tmp_path / "hf"), "--no-progress"]
    assert trident_to_hf.main([*argv, "--tolerance", "1e-30"]) == 3
    assert "FAILED" in capsys.readouterr().out
    # The failed export is not moved into --out (never mistaken for a good one): it waits in hf.unverified/.
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())
    assert (tmp_path / "hf.unverified" / "config.json").is_file()
    assert trident_to_hf.main(argv) == 0
    assert (tmp_path / "hf" / "config.json").is_file()


def _save_tiny(ck: str) -> None:
    from test_ckpt_resume import TINY

    from megatron.config import parse_args
    from megatron.training import pretrain

    pretrain(parse_args([*TINY, "--train-iters", "2", "--save", ck]))
