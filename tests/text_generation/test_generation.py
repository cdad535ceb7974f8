"""Text generation: sampling filters (units) and generation from a real TP = 2 training checkpoint.

The oracle for the generator is transformers: the same checkpoint exported to HF and decoded greedily with
``model.generate`` must give the same tokens as ``TextGenerator`` on the merged Trident model.
"""

from __future__ import annotations

import json
import pydoc_data.topics
from pathlib import Path

import pytest
import torch

from megatron.model.presets import GPT2_FLAGS
from megatron.testing import run_distributed
from megatron.testing.tokenizers import swapped_vocab
from megatron.text_generation import SamplingParams, TextGenerator, filter_logits, sample_next
from tools import generate_text

TEXTS = list(pydoc_data.topics.topics.values())[:150]


def test_filters_follow_megatron_semantics() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(filter_logits(logits, p))[0].tolist()  # noqa: E731
    assert kept(SamplingParams(top_k=2)) == [True, True, False, False]
    assert kept(SamplingParams(top_p=0.7)) == [True, True, False, False]  # 0.5 < 0.7 < 0.8
    assert kept(SamplingParams(top_p=0.5)) == [True, True, False, False]  # crossing token stays
    assert kept(SamplingParams(top_p=0.4)) == [True, False, False, False]
    assert kept(SamplingParams(top_p=1.0)) == [True] * 4
    shuffled = logits[:, [2, 0, 3, 1]]  # order must not matter
    assert torch.isfinite(filter_logits(shuffled, SamplingParams(top_p=0.7)))[0].tolist() == [
        False, True, False, True,
    ]  # fmt: skip
    t = filter_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(t, logits / 0.5)


def test_sampling_draws_and_errors() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]])
    assert sample_next(logits, SamplingParams(greedy=True), g).tolist() == [1, 0]
    assert sample_next(logits, SamplingParams(top_k=1), g).tolist() == [1, 0]
    # Frequencies follow softmax(logits / T) (a fixed seed: deterministic, not flaky).
    row = torch.tensor([[1.0, 0.0, -1.0]]).expand(20000, 3)
    draws = sample_next(row, SamplingParams(temperature=2.0), torch.Generator().manual_seed(1))
    freq = torch.bincount(draws, minlength=3).float() / draws.numel()
    assert torch.allclose(freq, torch.softmax(row[0] / 2.0, dim=0), atol=0.01), freq
    a = sample_next(row[:50], SamplingParams(), torch.Generator().manual_seed(5))
    b = sample_next(row[:50], SamplingParams(), torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    for bad, msg in (
        ({"temperature": 0.0}, "--temperature"),
        ({"top_k": -1}, "--top_k"),
        ({"top_p": 1.5}, "--top_p"),
        ({"top_k": 5, "top_p": 0.9}, "are exclusive"),
    ):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**bad)


def _train(ck: str, vocab: str, merges: str) -> None:
    from megatron.config import parse_args
    from megatron.training import pretrain

    flags = [
        *GPT2_FLAGS, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "32", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-2", "--mock-data", "--seed", "3",
        "--tensor-model-parallel-size", "2", "--eval-iters", "0", "--log-level", "WARNING",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
        "--save", ck,
    ]  # fmt: skip
    pretrain(parse_args(flags))


def test_generation_from_tp2_checkpoint_matches_transformers(tmp_path: Path, capsys) -> None:
    from transformers import AutoModelForCausalLM

    from megatron.conversion.hf_export import export_to_hf
    from megatron.tokenizer.train import train_bpe

    (tmp_path / "bpe").mkdir()
    paths = train_bpe(TEXTS, vocab_size=400, output_dir=str(tmp_path / "bpe"))
    ck = str(tmp_path / "ckpt")
    run_distributed(
        _train, 2, ck, paths["vocab_file"], paths["merge_file"], init_process_group=False
    )
    gen = TextGenerator.from_checkpoint(ck, device="cpu")
    assert gen.max_positions == 32
    prompt = "The class statement"
    ours = gen.generate(
        prompt,
        max_new_tokens=12,
        params=SamplingParams(greedy=True),
        generator=torch.Generator(),
        stop_at_eod=False,
    )
    assert len(ours.tokens) == 12 and not ours.stopped_at_eod
    uncached = gen.generate(
        prompt,
        max_new_tokens=12,
        params=SamplingParams(greedy=True),
        generator=torch.Generator(),
        stop_at_eod=False,
        use_cache=False,
    )
    assert uncached.tokens == ours.tokens  # the KV cache changes nothing
    # Oracle: the same checkpoint exported to HF, greedy decoding in transformers.
    export_to_hf(ck, tmp_path / "hf", verification=None)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([gen.tokenizer.tokenize(prompt)])
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert ours.tokens == ref[0, ids.shape[1] :].tolist()
    assert prompt + ours.text == gen.tokenizer.detokenize(ref[0].tolist())

    _check_cli(ck, tmp_path, capsys)
    _check_cli_errors(ck, paths, tmp_path, capsys)


def _check_cli(ck: str, tmp_path: Path, capsys) -> None:
    """CLI: prompts from a file, JSON lines out, seeded sampling reproducible."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\nThe import system\n", encoding="utf-8")
    out_a, out_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    common = ["--load", ck, "--sample-input-file", str(prompts), "--num-samples", "2"]
    common += ["--top_p", "0.9", "--out-seq-length", "8", "--seed", "7", "--device", "cpu"]
    assert generate_text.main([*common, "--sample-output-file", str(out_a)]) == 0
    assert generate_text.main([*common, "--sample-output-file", str(out_b)]) == 0
    rows = [json.loads(x) for x in out_a.read_text(encoding="utf-8").splitlines()]
    assert [r["prompt"] for r in rows] == ["def f(x):"] * 2 + ["The import system"] * 2
    assert all(1 <= len(r["tokens"]) <= 8 for r in rows)
    assert out_a.read_text() == out_b.read_text()
    assert generate_text.main(["--load", ck, "--greedy", "--out-seq-length", "4"]) == 0
    assert "-" * 40 in capsys.readouterr().out  # unconditional sample printed


def _check_cli_errors(ck: str, paths: dict[str, str], tmp_path: Path, capsys) -> None:
    """Errors: one line, exit 2."""
    long_prompt = " ".join(["word"] * 40)
    assert generate_text.main(["--load", ck, "--prompt", long_prompt]) == 2
    assert "the model's context is 32" in capsys.readouterr().err
    assert generate_text.main(["--load", ck, "--sample-input-file", str(tmp_path / "no")]) == 2
    assert "--sample-input-file" in capsys.readouterr().err
    assert generate_text.main(["--load", str(tmp_path / "empty")]) == 2
    assert "holds no Trident checkpoint" in capsys.readouterr().err
    assert generate_text.main(["--load", ck, "--vocab-file", paths["vocab_file"]]) == 2
    assert "need --tokenizer-type" in capsys.readouterr().err
    other_ids = swapped_vocab(
        paths["vocab_file"], tmp_path / "swapped.json"
    )  # same size, other ids
    swapped = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", other_ids]
    assert generate_text.main(["--load", ck, *swapped, "--merge-file", paths["merge_file"]]) == 2
    assert "encodes text into other ids than the one the model was trained with" in (
        capsys.readouterr().err
    )
    if not torch.cuda.is_available():
        assert generate_text.main(["--load", ck, "--device", "cuda"]) == 2
        assert "sees no CUDA device" in capsys.readouterr().err
