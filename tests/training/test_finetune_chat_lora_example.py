"""``examples/finetune_chat_lora.sh`` end to end on CPU, shrunk: the whole fine-tuning workflow of issue #33 as a
user runs it. A tiny Llama 3 model built here with ``transformers`` (GQA, SwiGLU, untied output) over a
Llama-3-style tokenizer (``family_tokenizer("llama3")``: 128,256 ids) with a Llama 3-style chat template, imported
at TP = 2 as the base; the script then, at TP = 1 x PP = 2 (the base is re-split on load):

1. renders 48 chats with the template into an SFT dataset (int32 tokens + the uint8 loss mask);
2. trains rank-8 LoRA adapters with ``--sft`` and ``--eval-harness-tasks`` (two local tasks, 8 documents each);
3. / 4. exports the PEFT folder and the merged model (each tool verifies its logits itself);
5. evaluates the adapter checkpoint with ``tools/eval_harness.py``.

Checked: the dataset, the falling loss, both exports verified (and the merged model is not the base: the adapters
trained), the metrics file's eval-harness rows, and the tool's scores equal the in-training evaluation of the same
model at the last iteration (the live model vs the saved adapters over their base)."""

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
SCRIPT = ROOT / "examples" / "finetune_chat_lora.sh"
TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
WORDS = ["river", "stone", "cloud", "apple", "green", "window"]
TASKS = ["trident_choice", "trident_lastword"]
TRAIN_ITERS = 10


def _chats(path: Path) -> None:
    """48 short chats whose answers repeat a word of the question: a pattern the adapters learn in 10 steps."""
    with path.open("w") as f:
        for i in range(48):
            w = WORDS[i % len(WORDS)]
            chat = [
                {"role": "system", "content": "Answer with the word."},
                {"role": "user", "content": f"Question {i}: which word is {w}?"},
                {"role": "assistant", "content": f"The word is {w}. The word is {w}."},
            ]
            f.write(json.dumps({"messages": chat}) + "\n")


def _base(tmp_path: Path, env: dict[str, str]) -> tuple[Path, Path]:
    """The tiny HF Llama 3 with its chat tokenizer, and its Trident import at TP 2 (verified by the importer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf, base = tmp_path / "hf", tmp_path / "base"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=FAMILY_SIZES["llama3"][1], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
        rope_theta=500.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128009,
        initializer_range=0.05,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(hf)
    family_tokenizer("llama3", hf, merges=300)
    tok_config = json.loads((hf / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = TEMPLATE
    (hf / "tokenizer_config.json").write_text(json.dumps(tok_config))
    argv = ["--hf-dir", str(hf), "--save", str(base), "--tp", "2", "--pp", "1", "--no-progress"]
    p = subprocess.run(
        [sys.executable, "-m", "tools.checkpoint.hf_to_trident", *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0 and "-> OK" in p.stdout + p.stderr, (p.stdout + p.stderr)[-4000:]
    return hf, base


def _logits(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.slow  # ~80-130 s; LoRA, --sft, the exports and the harness each have default-suite tests of their own
def test_finetune_chat_lora_example(tmp_path: Path) -> None:
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT),
        "DS_ACCELERATOR": "cpu",
    }  # fmt: skip
    hf, base = _base(tmp_path, env)
    chats, out = tmp_path / "chats.jsonl", tmp_path / "run out"
    _chats(chats)
    env.update({
        "BASE": str(base), "TOKENIZER_DIR": str(hf), "CHAT_JSONL": str(chats), "OUT": str(out),
        "TP": "1", "PP": "2", "SEQ_LENGTH": "64", "MICRO_BATCH_SIZE": "2", "GLOBAL_BATCH_SIZE": "4",
        "TRAIN_ITERS": str(TRAIN_ITERS), "WARMUP_ITERS": "1", "LR": "2e-2", "MIN_LR": "2e-3",
        "EVAL_TASKS": " ".join(TASKS), "EVAL_LIMIT": "8", "EVAL_INTERVAL": "5", "ZERO_STAGE": "0",
        "DEVICE": "cpu", "PYTHON": sys.executable,
    })  # fmt: skip
    p = subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-8000:]

    # 1. the SFT dataset: int32 tokens of the Llama 3-size vocabulary, the mask on the assistant turns only
    data = MMapIndexedDataset(str(out / "data" / "chat_text_document"))
    mask = MMapIndexedDataset(str(out / "data" / "chat_text_document_loss_mask"))
    assert len(data) == len(mask) == 48
    ids, m = data.get(0), mask.get(0)
    assert ids.dtype.name == "int32" and ids.max() > 65535 and m.dtype.name == "uint8"
    assert ids[0] == 128000 and ids[-1] == 128009 and m[-1] == 1 and m[:10].sum() == 0
    assert 0 < m.sum() < len(m) / 2

    # 2. the loss falls; the harness ran at iterations 5 and 10 and wrote its rows
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["lm_loss"] for r in rows if "lm_loss" in r]
    assert len(losses) == TRAIN_ITERS and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    harness = {r["iteration"]: r["eval_harness"] for r in rows if "eval_harness" in r}
    assert sorted(harness) == [5, TRAIN_ITERS], rows
    assert set(harness[TRAIN_ITERS]) == set(TASKS)
    assert (out / "checkpoints" / "latest").read_text().strip() == f"global_step{TRAIN_ITERS}"

    # 3. / 4. both exports verified by their tool; the merged model carries the trained adapters
    assert log.count("-> OK") == 2, log[-8000:]
    peft_files = {"adapter_config.json", "adapter_model.safetensors"}
    assert peft_files <= {p.name for p in (out / "peft").iterdir()}
    prompt = torch.from_numpy(ids[:24].astype("int64"))[None]
    merged, plain = _logits(out / "hf_merged", prompt), _logits(out / "hf_base", prompt)
    assert torch.isfinite(merged).all() and (merged - plain).abs().max() > 1e-3
    assert json.loads((out / "hf_merged" / "tokenizer_config.json").read_text())["chat_template"]

    # 5. the tool on the saved adapters scores what the training run scored on the live model
    scores = json.loads((out / "eval.json").read_text())["results"]
    assert set(scores) == set(TASKS)
    for task in TASKS:
        assert scores[task].keys() == harness[TRAIN_ITERS][task].keys(), (scores, harness)
        trained = harness[TRAIN_ITERS][task]
        for metric, value in scores[task].items():
            assert value == pytest.approx(trained[metric], rel=1e-4), (task, metric)
