"""LoRA export (issue #33): merged HF weights and a PEFT adapter folder give the LoRA model's logits.

The reference is the LoRA model itself: our ``GPTModel`` built with ``--lora-rank`` (TP = 1) holding the base and
the adapters exactly as they are stored (fused QKV rows per K/V group, SwiGLU ``[gate; up]``). Against it: the
merged export (``W + (alpha / r) B A`` then the HF export) run in transformers, and the base HF export with the
PEFT folder loaded by ``peft.PeftModel.from_pretrained``. Tiny random models with awkward shapes (LLaMA: 3 query
heads per K/V head, head dim 10 != 48 / 6, tied embeddings; GPT-2: Conv1D with ``fan_in_fan_out``).

Tolerance 1e-5 (the issue's acceptance): the three computations differ only in fp32 rounding order (the merged
weight rounds ``W + s B A`` once; PEFT and our model add the low-rank product to the output).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from ckpt_models import VOCAB, make_family, make_gpt2

from megatron.checkpointing.readers import build_megatron_model
from megatron.config.lora import LORA_TARGETS, LoraConfig
from megatron.config.model import ModelConfig
from megatron.conversion.hf_gpt2 import gpt2_hf_to_megatron, megatron_to_gpt2_hf
from megatron.conversion.hf_llama import llama_hf_to_megatron, megatron_to_llama_hf
from megatron.conversion.hf_mixtral import verification_config
from megatron.conversion.lora_export import merge_lora, peft_adapter, write_peft_adapter
from megatron.layout.names import layer_prefix

TOL = 1e-5
# ckpt_models' weights (std 0.25) make a model so sensitive that rounding W + s B A once to fp32 moves its logits
# by ~8e-6, whatever the adapters' size; at std 0.1 (LINEAR_SCALE) that is 4e-6. s B A at ADAPTER_STD is then ~0.4x
# the weights: the adapters move the logits by ~4, so any wrong row order shows.
LINEAR_SCALE = 0.4
ADAPTER_STD = 0.1
TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))  # [b, s]


def with_adapters(
    full: dict[str, torch.Tensor], cfg: ModelConfig, lora: LoraConfig, seed: int = 0
) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """``full`` with random ``lora_a [r, in]`` / ``lora_b [out, r]`` on every target (B non-zero, as after
    training) and ``cfg`` with ``lora``."""
    g = torch.Generator().manual_seed(seed)
    out = dict(full)
    for i in range(cfg.num_layers):
        for t in lora.lora_target_modules:
            linear = f"{layer_prefix(i)}.{LORA_TARGETS[t]}"
            rows, cols = full[f"{linear}.weight"].shape
            out[f"{linear}.lora_a"] = torch.randn(lora.lora_rank, cols, generator=g) * ADAPTER_STD
            out[f"{linear}.lora_b"] = torch.randn(rows, lora.lora_rank, generator=g) * ADAPTER_STD
    return out, dataclasses.replace(cfg, lora=lora)


def lora_model_logits(full: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """Logits ``[b, s, v]`` of our LoRA ``GPTModel`` (TP = 1, eval: no adapter dropout)."""
    model = build_megatron_model(full, verification_config(cfg))
    pos = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    with torch.no_grad():
        return model(TOKENS, pos)[..., :VOCAB]


def write_hf(out: Path, hf_sd: dict[str, torch.Tensor], hf_cfg: dict) -> Path:
    """An HF directory as ``export_to_hf`` writes it (config.json + model.safetensors, fp32)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in hf_sd.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_cfg))
    return out


def hf_logits(hf_dir: Path, adapter: Path | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True).float()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter), local_files_only=True)
    with torch.no_grad():
        return model.eval()(input_ids=TOKENS).logits[..., :VOCAB]


def exports_vs_lora_model(tmp_path: Path, full, cfg, exporter, family: str) -> dict:
    """Max |delta logit| of the merged export and of base + PEFT adapter against the reference, and of the base
    alone (how much the adapters change the model: the check's power)."""
    ref = lora_model_logits(full, cfg)
    merged_sd, merged_cfg = exporter(merge_lora(full, cfg), cfg, VOCAB)
    merged = write_hf(tmp_path / "merged", merged_sd, merged_cfg)
    base_full = {k: v for k, v in full.items() if not k.endswith((".lora_a", ".lora_b"))}
    base = write_hf(tmp_path / "base", *exporter(base_full, cfg, VOCAB))
    tensors, config = peft_adapter(full, cfg, family=family, base_model=str(base))
    write_peft_adapter(tmp_path / "peft", tensors, config)
    logits = {
        "merged": hf_logits(merged),
        "peft": hf_logits(base, tmp_path / "peft"),
        "base": hf_logits(base),
    }
    d = {k: (v - ref).abs().max().item() for k, v in logits.items()}
    d["merged_vs_peft"] = (logits["merged"] - logits["peft"]).abs().max().item()
    return d


@pytest.mark.slow
def test_llama_gqa_swiglu_merged_and_peft_equal_the_lora_model(tmp_path: Path) -> None:
    """Random adapters ~0.4x the weights on every target (the default suite's trained LLaMA
    adapters are smaller), 3 query heads per K/V group, head dim 10 != 48 / 6, tied embeddings."""
    hf = make_family("llama")  # 6 query heads, 2 K/V groups, head dim 10, tied embeddings
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(LINEAR_SCALE)
    full, cfg = llama_hf_to_megatron(hf.state_dict(), hf.config.to_dict())
    lora = LoraConfig(lora_rank=4, lora_alpha=8.0, lora_dropout=0.05)
    d = exports_vs_lora_model(
        tmp_path, *with_adapters(full, cfg, lora), megatron_to_llama_hf, "llama"
    )
    assert d["merged"] <= TOL and d["peft"] <= TOL and d["merged_vs_peft"] <= TOL, d
    assert d["base"] > 0.1, d
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_modules"] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    ]  # fmt: skip
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8, 0.05)
    assert config["base_model_name_or_path"] == str(tmp_path / "base")


def test_gpt2_conv1d_with_some_targets(tmp_path: Path) -> None:
    """GPT-2 (Conv1D, fan_in_fan_out; per-head QKV rows -> c_attn's [q; k; v]) with qkv and fc2 only: the
    attention's and the MLP's ``c_proj`` are told apart."""
    hf = make_gpt2()
    full, cfg = gpt2_hf_to_megatron(hf.state_dict(), hf.config.to_dict())
    lora = LoraConfig(lora_rank=2, lora_alpha=4.0, lora_target_modules=("qkv", "fc2"))
    d = exports_vs_lora_model(
        tmp_path, *with_adapters(full, cfg, lora), megatron_to_gpt2_hf, "gpt2"
    )
    assert d["merged"] <= TOL and d["peft"] <= TOL and d["merged_vs_peft"] <= TOL, d
    assert d["base"] > 0.1, d
    # PEFT put adapters on exactly these modules (a bare "c_proj" would adapt the attention's too)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf_base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), local_files_only=True)
    peft = PeftModel.from_pretrained(hf_base, str(tmp_path / "peft"), local_files_only=True)
    adapted = {n.split(".lora_A.")[0] for n, _ in peft.named_parameters() if ".lora_A." in n}
    assert adapted == {
        f"base_model.model.transformer.h.{i}.{m}"
        for i in (0, 1)
        for m in ("attn.c_attn", "mlp.c_proj")
    }


BAD_ADAPTERS = [
    ("target not named", {"lora_target_modules": ("qkv",)}, None, "which --lora-target-modules"),
    ("target missing", {}, ("fc2",),
     "that have no adapter"),
    ("rank", {"lora_rank": 3}, None, r"do not fit its weight .* at --lora-rank 3"),
]  # fmt: skip


@pytest.mark.parametrize(
    "what,spec_change,drop,match", BAD_ADAPTERS, ids=[b[0] for b in BAD_ADAPTERS]
)
def test_adapters_that_disagree_with_the_config_are_refused(what, spec_change, drop, match) -> None:
    hf = make_gpt2()
    full, cfg = gpt2_hf_to_megatron(hf.state_dict(), hf.config.to_dict())
    trained = LoraConfig(lora_rank=2, lora_alpha=4.0, lora_target_modules=("qkv", "fc2"))
    full, cfg = with_adapters(full, cfg, trained)
    if drop:
        full = {k: v for k, v in full.items() if LORA_TARGETS[drop[0]] + ".lora" not in k}
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(trained, **spec_change))
    with pytest.raises(ValueError, match=match) as err:
        merge_lora(full, cfg)
    assert "\n" not in str(err.value)


SIZES = [
    "--num-layers", "2", "--hidden-size", "48", "--num-attention-heads", "6", "--num-key-value-heads", "2",
    "--ffn-hidden-size", "40", "--seq-length", "16", "--max-position-embeddings", "32",
]  # fmt: skip
TRAIN = [
    "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "5e-2", "--min-lr", "5e-3",
    "--seed", "1234", "--mock-data", "--vocab-size", str(VOCAB),
    "--zero-stage", "1", "--eval-iters", "0", "--log-level", "WARNING",
]  # fmt: skip


def _train(argvs: list[list[str]]) -> None:
    from megatron.config import parse_args
    from megatron.training import pretrain

    for argv in argvs:
        assert pretrain(parse_args(argv)).exit_code == 0, argv


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_trained_adapters_export_merged_and_peft(tmp_path: Path, capsys, tp: int) -> None:
    """The issue's acceptance through the tool: a LLaMA (GQA 6/2, SwiGLU) base and adapters trained on it at
    TP = ``tp`` (real DeepSpeed engines, one spawn), exported with --merge-lora and with --peft-output (each
    verified by the tool at 1e-5); then the LoRA model's logits against both exports, computed here
    independently."""
    from megatron.checkpointing.lora import read_lora_checkpoint
    from megatron.checkpointing.readers import CheckpointRead, no_progress
    from megatron.conversion.lora_export import LoraOutput, read_export_weights
    from megatron.model.presets import LLAMA_FLAGS
    from megatron.testing import run_distributed
    from tools.checkpoint import trident_to_hf

    base, lora = str(tmp_path / "base"), str(tmp_path / "lora")
    flags = [*LLAMA_FLAGS, *SIZES, *TRAIN, "--tensor-model-parallel-size", str(tp)]
    lora_flags = ["--lora-rank", "4", "--lora-alpha", "8", "--pretrained-checkpoint", base]
    runs = [
        [*flags, "--train-iters", "1", "--save", base, "--tokenizer-type", "NullTokenizer"],
        [*flags, "--train-iters", "2", "--save", lora, *lora_flags],
    ]
    run_distributed(_train, tp, runs, init_process_group=False, timeout=600)
    common = ["--load", lora, "--no-tokenizer", "--no-progress", "--verify-steps", "4"]
    merged, hf_base, peft = tmp_path / "merged", tmp_path / "hf_base", tmp_path / "peft"
    assert trident_to_hf.main([*common, "--out", str(merged), "--merge-lora"]) == 0
    assert trident_to_hf.main([*common, "--out", str(hf_base), "--peft-output", str(peft)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("-> OK") == 2, printed

    adapters, base_sd, cfg, _ = read_lora_checkpoint(lora)
    ref = lora_model_logits({**base_sd, **adapters}, cfg)
    from peft import AutoPeftModelForCausalLM

    # the folder alone: peft finds the base through base_model_name_or_path
    auto = AutoPeftModelForCausalLM.from_pretrained(str(peft), local_files_only=True).eval()
    with torch.no_grad():
        auto_logits = auto(input_ids=TOKENS).logits[..., :VOCAB]
    logits = {
        "merged": hf_logits(merged),
        "peft": hf_logits(hf_base, peft),
        "auto_peft": auto_logits,
        "base": hf_logits(hf_base),
    }
    d = {k: (v - ref).abs().max().item() for k, v in logits.items()}
    assert d["merged"] <= TOL and d["peft"] <= TOL and d["auto_peft"] <= TOL, d
    assert d["base"] > 1e-3, d  # the trained adapters matter
    # generation and evaluation (tools/eval_harness.py) load the adapters over their recorded base, unmerged
    from megatron.text_generation.distributed import load_stage

    stage = load_stage(lora)[0]
    with torch.no_grad():
        staged = stage(TOKENS, torch.arange(TOKENS.shape[1]).expand_as(TOKENS))  # [s, b, vp]
    staged = staged.transpose(0, 1)[..., :VOCAB]
    assert (staged - ref).abs().max().item() <= TOL
    config = json.loads((peft / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_base.absolute())
    # the LoRA run (no --tokenizer-type) exports the tokenizer its base recorded
    meta = read_export_weights(lora, CheckpointRead(), no_progress, LoraOutput(merge=True))[2]
    assert meta["tokenizer"]["tokenizer_type"] == "NullTokenizer" and meta["lora_base"]

    with capsys.disabled():
        print(f"\nTP {tp}: max |dlogit| vs the LoRA model: {d}")

    # bad input: one line, exit 2, nothing written
    capsys.readouterr()
    for argv, match in (
        ([*common, "--out", str(tmp_path / "x")], "pass --merge-lora"),
        (["--load", base, "--out", str(tmp_path / "x"), "--merge-lora"], "holds no LoRA adapters"),
        ([*common, "--out", str(tmp_path / "x"), "--peft-output", str(tmp_path / "x")], "is --out"),
        ([*common, "--out", str(tmp_path / "x"), "--merge-lora", "--peft-output", str(peft)],
         "exclude each other"),
        ([*common, "--out", str(tmp_path / "x"), "--peft-output", str(peft)], "is not empty"),
    ):  # fmt: skip
        assert trident_to_hf.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and match in err, (argv, err)
    assert not (tmp_path / "x").exists()
