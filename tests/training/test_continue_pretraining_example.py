"""``examples/continue_pretraining_llama3.sh`` end to end on CPU, shrunk: a tiny Llama 3 model built here with
``transformers`` (GQA, llama3 RoPE scaling, head dim != hidden / heads, tied embeddings) over a Llama-3-style
tokenizer (``family_tokenizer("llama3")``: 128,256 ids, so the model's vocabulary is the tokenizer's), converted at
TP = 2 x PP = 1, a 30-line corpus tokenized, 3 iterations trained on 2 ranks with ``--use-checkpoint-args`` (no
model flag given: the RoPE factors and the head dim come only from the checkpoint), exported back to HF.

Each stage's output is checked: the converted checkpoint and its ``model_args.sh``, the int32 ``.bin/.idx``, the
iterations and their finite losses, both converters' own logit verification, and the exported directory loading
with transformers, with the original's RoPE scaling and logits that moved (it trained)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.testing.tokenizers import FAMILY_SIZES, family_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "continue_pretraining_llama3.sh"
ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
ROPE["original_max_position_embeddings"] = 32
TEXTS = [
    f"Line {i}: the pipeline stage {i % 3} sends activations forward and gradients back, {i * 7} times."
    for i in range(30)
]


def _tiny_llama3(hf_dir: Path) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=FAMILY_SIZES["llama3"][1], hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=500.0, rope_scaling=dict(ROPE), tie_word_embeddings=True,
        bos_token_id=128000, eos_token_id=128001, initializer_range=0.25,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(hf_dir)
    # the tokenizer beside the weights, as on the hub
    family_tokenizer("llama3", hf_dir, merges=300)
    return model


def _run_example(tmp_path: Path, hf_dir: Path, out: Path) -> subprocess.CompletedProcess:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    env = {
        **os.environ,
        "HF_DIR": str(hf_dir), "DATA_JSONL": str(corpus), "OUT": str(out), "TP": "2", "PP": "1",
        "SEQ_LENGTH": "32", "GLOBAL_BATCH_SIZE": "2", "TRAIN_ITERS": "3", "WARMUP_ITERS": "1",
        "LR": "1e-2", "MIN_LR": "1e-3", "ZERO_STAGE": "0", "DEVICE": "cpu", "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(ROOT),
    }  # fmt: skip
    return subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow  # ~26 s; the converters, --use-checkpoint-args and family round trips run in the default suite
def test_continue_pretraining_llama3_example(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_dir, out = tmp_path / "hf in", tmp_path / "run out"
    original = _tiny_llama3(hf_dir)
    p = _run_example(tmp_path, hf_dir, out)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    # 1. converted at TP 2 and verified; its flags beside it, the Llama 3 RoPE and head dim among them
    assert (out / "converted" / "latest").read_text().strip() == "global_step0"
    assert (
        len(list((out / "converted" / "global_step0").glob("mp_rank_0[01]_model_states.pt"))) == 2
    )
    flags = (out / "converted" / "model_args.sh").read_text().split("MODEL_ARGS=(")[1]
    for flag in ("--use-rope-scaling", "--rope-scaling-factor 4.0", "--num-key-value-heads 2"):
        assert flag in flags, flags
    assert "--kv-channels 8" in flags and "--seq-length" not in flags, flags
    # 2. the corpus tokenized with the model's tokenizer: int32 ids above 65,535, BOS first as Llama 3's config says
    data = MMapIndexedDataset(str(out / "data" / "corpus_text_document"))
    ids = data.get(0)
    assert len(data) == len(TEXTS) and ids.dtype.name == "int32"
    assert ids[0] == 128000 and ids[-1] == 128001 and ids.max() > 65535
    # 3. three iterations from the converted weights, finite losses
    train = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if "lm_loss" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3]
    assert all(math.isfinite(r["lm_loss"]) for r in train)
    loaded = "converted/global_step0 (iteration 0, --finetune: weights only, iteration 0)"
    assert loaded in log, log[-6000:]
    # 4. both converters verified their output themselves
    assert log.count("-> OK") == 2, log[-6000:]
    exported = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    rope = AutoConfig.from_pretrained(out / "hf").rope_scaling
    assert rope == AutoConfig.from_pretrained(hf_dir).rope_scaling
    assert (out / "hf" / "tokenizer.json").is_file()
    prompt = torch.from_numpy(data.get(1)[:16].astype("int64"))[None]
    with torch.no_grad():
        before, after = original(prompt).logits, exported(prompt).logits
    assert torch.isfinite(after).all() and (after - before).abs().max() > 1e-3
