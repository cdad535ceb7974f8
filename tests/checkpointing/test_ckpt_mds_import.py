"""Importing Megatron-DeepSpeed checkpoints (DeepSpeed format and Megatron-native).

No Megatron-DeepSpeed is installed here, so its checkpoints are rebuilt from real Trident training checkpoints in
Megatron-DeepSpeed's documented layout (megatron-compat.md §9.2): the pipeline layer files are already that layout;
PP = 1 ``module`` becomes Megatron's nested dict; ``args`` is an argparse Namespace that also holds an enum of a
``megatron.core.enums`` module (as Megatron-DeepSpeed's does), which the importer must read without running it.
"""

from __future__ import annotations

import argparse
import enum
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron.checkpointing.readers import read_checkpoint_weights
from megatron.conversion.megatron_ds import read_mds_checkpoint
from megatron.layout.qkv import split_qkv
from megatron.model.presets import GPT2_FLAGS, LLAMA_FLAGS
from megatron.testing import run_distributed
from tools.checkpoint import megatron_deepspeed_to_trident

SHAPE = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
]
COMMON = [
    *SHAPE, "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2", "--mock-data",
    "--vocab-size", "299", "--eval-iters", "0", "--log-level", "WARNING", "--lr", "1e-2",
]  # fmt: skip
GPT_ARGS = {
    "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
    "ffn_hidden_size": 128, "kv_channels": 8, "seq_length": 16, "max_position_embeddings": 16,
    "normalization": "layernorm", "layernorm_epsilon": 1e-5, "swiglu": False,
    "use_rotary_position_embeddings": False, "add_position_embedding": True, "rotary_percent": 1.0,
    "rope_theta": 10000, "add_bias_linear": True, "untie_embeddings_and_output_weights": False,
    "make_vocab_size_divisible_by": 128, "padded_vocab_size": 512, "num_experts": [1],
    "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "tokenizer_type": None,
}  # fmt: skip
LLAMA_ARGS = {
    **GPT_ARGS, "num_key_value_heads": 2, "ffn_hidden_size": 64, "normalization": "rmsnorm",
    "swiglu": True, "use_rotary_position_embeddings": True, "add_position_embedding": False,
    "add_bias_linear": False, "untie_embeddings_and_output_weights": True, "padded_vocab_size": 384,
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2,
}  # fmt: skip


def _train(root: str) -> None:
    from megatron.config import parse_args
    from megatron.training import pretrain

    gpt = [*GPT2_FLAGS, *COMMON, "--max-position-embeddings", "16"]
    pretrain(parse_args([*gpt, "--tensor-model-parallel-size", "2", "--save", f"{root}/gpt"]))
    llama = [*LLAMA_FLAGS, *COMMON, "--num-key-value-heads", "2", "--ffn-hidden-size", "64"]
    pretrain(parse_args([*llama, "--pipeline-model-parallel-size", "2", "--save", f"{root}/llama"]))


def _nest(flat: dict[str, torch.Tensor]) -> dict:
    """Megatron's state_dict_for_save_checkpoint layout of GPTModel's flat names."""
    lm: dict = {"embedding": {}, "encoder": {}}
    for key, t in flat.items():
        rest = key.removeprefix("language_model.")
        part, _, name = rest.partition(".")
        if part == "embedding":
            module, _, param = name.partition(".")
            lm["embedding"].setdefault(module, {})[param] = t
        elif part == "encoder":
            lm["encoder"][name] = t
        else:  # output_layer.weight
            lm.setdefault(part, {})[name] = t
    return {"language_model": lm}


def _to_mds(src: Path, dst: Path, args: dict, *, thirds: bool = False) -> None:
    """Rewrite a Trident checkpoint as Megatron-DeepSpeed would have saved it."""
    tag = (src / "latest").read_text()
    shutil.copytree(src / tag, dst / tag)
    for extra in [*(dst / tag).glob("rng_state_*"), dst / tag / "trident_meta.json"]:
        extra.unlink()
    enums = types.ModuleType("megatron.core.enums")
    model_type = enum.Enum("ModelType", ["encoder_or_decoder"], module="megatron.core.enums")
    enums.ModelType = model_type  # type: ignore[attr-defined]
    sys.modules.update(
        {"megatron.core": types.ModuleType("megatron.core"), "megatron.core.enums": enums}
    )
    try:
        for path in (dst / tag).glob("mp_rank_*_model_states.pt"):
            client = torch.load(path, weights_only=True)
            client.pop("trident_model_config")
            client["args"] = argparse.Namespace(**args, model_type=model_type.encoder_or_decoder)
            module = client.get("module")
            if module:
                if thirds:  # the FPDT-era [q | k | v] split of each TP shard
                    tp = args["tensor_model_parallel_size"]
                    heads, hn = args["num_attention_heads"] // tp, args["kv_channels"]
                    for key in [k for k in module if "query_key_value" in k]:
                        q, k, v = split_qkv(
                            module[key], num_heads=heads, num_groups=heads, head_dim=hn
                        )
                        module[key] = torch.cat([q, k, v])
                client["module"] = _nest(module)
            torch.save(client, path)
    finally:
        for name in ("megatron.core", "megatron.core.enums"):
            sys.modules.pop(name, None)
    (dst / "latest").write_text(tag)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mds")
    run_distributed(_train, 2, str(root), init_process_group=False, timeout=300)
    return root


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_import_nested_tp2_and_pipeline_checkpoints(trained: Path, tmp_path: Path, capsys) -> None:
    ref_gpt, _, _ = read_checkpoint_weights(trained / "gpt")
    _to_mds(trained / "gpt", tmp_path / "mds_gpt", GPT_ARGS)
    full, cfg, tok = read_mds_checkpoint(tmp_path / "mds_gpt")
    _same(full, ref_gpt)
    assert (cfg.vocab_size, cfg.hidden_size, tok) == (300, 32, None)  # --vocab-size 299 + EOD
    _to_mds(trained / "gpt", tmp_path / "mds_thirds", GPT_ARGS, thirds=True)
    _same(read_mds_checkpoint(tmp_path / "mds_thirds", qkv_layout="thirds")[0], ref_gpt)
    ref_llama, ref_cfg, _ = read_checkpoint_weights(trained / "llama")
    _to_mds(trained / "llama", tmp_path / "mds_llama", LLAMA_ARGS)
    full, cfg, _ = read_mds_checkpoint(tmp_path / "mds_llama")
    _same(full, ref_llama)
    assert cfg.num_query_groups == 2 and cfg.swiglu and cfg.untie_embeddings_and_output_weights
    # The CLI writes a Trident checkpoint at another layout and verifies it.
    argv = ["--load", str(tmp_path / "mds_gpt"), "--save", str(tmp_path / "out"), "--no-progress"]
    assert megatron_deepspeed_to_trident.main(argv) == 0
    assert "greedy agreement = 1.000 -> OK" in capsys.readouterr().out
    assert "MODEL_ARGS=(" in (tmp_path / "out" / "model_args.sh").read_text()
    back, back_cfg, _ = read_checkpoint_weights(tmp_path / "out")
    assert back_cfg.vocab_size == 300
    for key in ref_gpt:  # padding rows differ (TP 2 -> TP 1 padding): compare the true vocabulary
        assert torch.equal(
            back[key][:300] if "word_embeddings" in key else back[key],
            (ref_gpt[key][:300] if "word_embeddings" in key else ref_gpt[key]),
        ), key


def test_import_errors(trained: Path, tmp_path: Path, capsys) -> None:
    _to_mds(trained / "gpt", tmp_path / "moe", {**GPT_ARGS, "num_experts": [4]})
    argv = ["--load", str(tmp_path / "moe"), "--save", str(tmp_path / "o1")]
    assert megatron_deepspeed_to_trident.main(argv) == 2
    assert "mixture of experts (num_experts [4])" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (
        megatron_deepspeed_to_trident.main(["--load", str(empty), "--save", str(tmp_path / "o2")])
        == 2
    )
    assert "has no 'latest' (DeepSpeed format) nor latest_checkpointed_iteration.txt" in (
        capsys.readouterr().err
    )
    # A pickled class from outside the allowlist is refused, not unpickled.
    _to_mds(
        trained / "gpt",
        tmp_path / "evil",
        {**GPT_ARGS, "extra": __import__("decimal").Decimal("1")},
    )
    argv = ["--load", str(tmp_path / "evil"), "--save", str(tmp_path / "o3")]
    assert megatron_deepspeed_to_trident.main(argv) == 2
    assert (
        "holds a pickled decimal.Decimal, which Trident does not unpickle"
        in capsys.readouterr().err
    )
    # A Trident checkpoint is not a Megatron-DeepSpeed one.
    argv = ["--load", str(trained / "gpt"), "--save", str(tmp_path / "o4")]
    assert megatron_deepspeed_to_trident.main(argv) == 2
    assert "holds no Megatron 'args'" in capsys.readouterr().err


def _native(
    dst: Path, args: dict, stages: list[list[dict[str, torch.Tensor]]], tracker: str
) -> None:
    """A Megatron-native checkpoint: ``stages[pp][tp]`` flat Megatron-named weights with stage-local layer
    numbers, saved as ``<iter dir>/mp_rank_TT[_PPP]/model_optim_rng.pt``."""
    import random

    import numpy as np

    name = "release" if tracker == "release" else f"iter_{int(tracker):07d}"
    pp = len(stages)
    for stage, per_tp in enumerate(stages):
        for r, flat in enumerate(per_tp):
            d = dst / name / (f"mp_rank_{r:02d}" if pp == 1 else f"mp_rank_{r:02d}_{stage:03d}")
            d.mkdir(parents=True)
            rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state()}
            state = {
                "args": argparse.Namespace(**args), "checkpoint_version": 3.0, "iteration": 2,
                "model": _nest(flat), "rng_state": [rng],
            }  # fmt: skip
            torch.save(state, d / "model_optim_rng.pt")
    (dst / "latest_checkpointed_iteration.txt").write_text(tracker)


def test_import_megatron_native_checkpoints(trained: Path, tmp_path: Path) -> None:
    tag = (trained / "gpt" / "latest").read_text()
    shards = [
        torch.load(trained / "gpt" / tag / f"mp_rank_{r:02d}_model_states.pt")["module"]
        for r in range(2)
    ]
    _native(tmp_path / "gpt", GPT_ARGS, [shards], "2")
    ref_gpt, _, _ = read_checkpoint_weights(trained / "gpt")
    _same(read_mds_checkpoint(tmp_path / "gpt")[0], ref_gpt)
    _native(tmp_path / "rel", GPT_ARGS, [shards], "release")
    _same(read_mds_checkpoint(tmp_path / "rel")[0], ref_gpt)
    # PP = 2: each stage numbers its layers from 0; the last stage also holds the final norm and the head.
    ref, _, _ = read_checkpoint_weights(trained / "llama")
    first = {k: v for k, v in ref.items() if "embedding" in k or ".layers.0." in k}
    last = {k.replace(".layers.1.", ".layers.0."): v for k, v in ref.items() if k not in first}
    _native(tmp_path / "llama", LLAMA_ARGS, [[first], [last]], "2")
    _same(read_mds_checkpoint(tmp_path / "llama")[0], ref)


def test_older_pipeline_layout_and_refusals(trained: Path, tmp_path: Path) -> None:
    from megatron.conversion.megatron_ds import _true_vocab, mds_model_config

    # Older specs put a transpose at index 2: blocks at 3..L+2, the final norm at L+4, the head after it.
    _to_mds(trained / "llama", tmp_path / "old", LLAMA_ARGS)
    tag_dir = next((tmp_path / "old").glob("global_step*"))
    moves = {2: 3, 3: 4, 4: 6, 5: 7}
    for old in sorted(moves, reverse=True):
        for f in tag_dir.glob(f"layer_{old:02d}-model_*"):
            f.rename(f.with_name(f.name.replace(f"layer_{old:02d}", f"layer_{moves[old]:02d}")))
    ref, _, _ = read_checkpoint_weights(trained / "llama")
    _same(read_mds_checkpoint(tmp_path / "old")[0], ref)
    # Silent mismatches become refusals: the exact GeLU (no bias-GeLU fusion), pre-2.0 QKV order.
    with pytest.raises(ValueError, match=r"the exact \(erf\) GeLU"):
        mds_model_config({**GPT_ARGS, "bias_gelu_fusion": False}, 300, tmp_path)
    with pytest.raises(ValueError, match="checkpoint_version 1.0"):
        mds_model_config(GPT_ARGS, 300, tmp_path, version=1.0)
    # HFTokenizer records its size without added tokens: when it cannot be built here, keep every row.
    hf_tok = {"tokenizer_type": "HFTokenizer", "tokenizer_model": str(tmp_path / "gone")}
    info = {"universal_checkpoint_info": {"original_vocab_size": 300}}
    assert _true_vocab(GPT_ARGS, info, hf_tok) == 512
    assert _true_vocab(GPT_ARGS, info, None) == 300
