"""Bad inputs of issue 31 (Llama 3 / Qwen / Mistral conversion): an HF directory of a family relative Trident cannot
express, refused by name before any rank is spawned (the other refusals, RoPE types and per-layer windows, are unit
tests in ``tests/checkpointing/test_ckpt_hf_families.py``: same code path, no subprocess each). Each directory is a tiny ``config.json``
with one placeholder tensor: the converter reads the config before it maps any weight."""

from __future__ import annotations

import json
from pathlib import Path

from tests.badinput.cases import Case

TO_TRIDENT = ("-m", "tools.checkpoint.hf_to_trident", "--no-progress")
ARGV = (*TO_TRIDENT, "--hf-dir", "{tmp}/hf", "--save", "{tmp}/out")
SHAPE = {
    "vocab_size": 101, "hidden_size": 48, "intermediate_size": 40, "num_hidden_layers": 2,
    "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 64,
}  # fmt: skip


def _hf_dir(tmp: Path, **config: object) -> None:
    from safetensors.torch import save_file
    from torch import zeros

    (tmp / "hf").mkdir()
    (tmp / "hf" / "config.json").write_text(json.dumps({**SHAPE, **config}))
    save_file({"model.norm.weight": zeros(48)}, str(tmp / "hf" / "model.safetensors"))


def _qwen3_moe(tmp: Path, ws: Path) -> None:
    _hf_dir(tmp, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2)


UNCHANGED = ("{tmp}/hf",)

CASES: list[Case] = [
    Case(
        "r4-hf-to-trident-qwen3-moe", ARGV, 2,
        "model_type 'qwen3_moe' is Qwen3-MoE", unchanged=UNCHANGED, setup=_qwen3_moe,
    ),
]  # fmt: skip
