"""Every examples/*.sh builds ARGS=(...) that our argument parser accepts and validate() passes at its world size.

Each script defines its flags in a bash array and returns before launching when TRIDENT_EXAMPLE_NO_LAUNCH=1, so
bash itself expands the array (quotes, variables, comments) exactly as a real launch would.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from megatron.config import build_parser, config_from_namespace, validate

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.sh"))


def _expand(script: Path) -> tuple[list[str], int]:
    env = {**os.environ, "TRIDENT_EXAMPLE_NO_LAUNCH": "1"}
    out = subprocess.run(
        ["bash", "-c", 'source "$0"; printf "%s\\0" "$WORLD" "${ARGS[@]}"', str(script)],
        capture_output=True,
        env=env,
        check=True,
        timeout=30,
    ).stdout.decode()
    world, *args = out.split("\0")[:-1]
    return args, int(world)


def test_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {
        "pretrain_gpt_cpu_quickstart.sh",
        "pretrain_gpt2_125m_8gpu.sh",
        "pretrain_gpt_1.3b_3d_multinode.sh",
        "pretrain_llama2_7b_multinode.sh",
        # Megatron-DeepSpeed-style: token schedule + DeepSpeed activation checkpointing; their LLaMA-2 script.
        "ds_pretrain_gpt_1.3B_token_schedule.sh",
        "ds_pretrain_llama2_distributed.sh",
        # Megatron-DeepSpeed-style DeepSpeed-Ulysses long-sequence script.
        "ds_pretrain_gpt_ulysses_long_seq.sh",
        # Megatron-DeepSpeed-style Mixtral-like MoE script (DeepSpeed-MoE, expert parallelism).
        "ds_pretrain_mixtral_moe.sh",
        # HF -> Trident -> continued pretraining (--use-checkpoint-args) -> HF (issue 31)
        "continue_pretraining_llama3.sh",
        # chat SFT with LoRA -> PEFT and merged exports -> lm-evaluation-harness (issue 33)
        "finetune_chat_lora.sh",
    } <= names


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_flags_parse_and_validate(script: Path) -> None:
    args, world = _expand(script)
    assert len(args) > 10, f"{script.name}: ARGS looks empty: {args}"
    cfg = config_from_namespace(build_parser().parse_args(args))
    device = "cpu" if "cpu" in script.name else "cuda"
    validate(cfg, world_size=world, device_type=device)
    text = script.read_text()
    if "multinode" in script.name:
        for var in ("NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_SOCKET_IFNAME"):
            line = next(ln for ln in text.splitlines() if f"export {var}=" in ln)
            assert "#" in line, f"{script.name}: {var} needs a comment saying what it does"
