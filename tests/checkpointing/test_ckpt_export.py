"""Trident -> HF export of ZeRO-3 checkpoints (fp32 partitions rebuilt offline) and of the training tokenizer.

End to end: the same tiny GPT trains 2 iterations at TP = 2 x DP = 2 under ZeRO-3 and under ZeRO-1 (real
DeepSpeed engines, one spawn); both checkpoints export through the CLI with verification, and the two HF weight
files must agree (ZeRO stages give the same model up to fp32 summation order). The tokenizer recorded at training
time is exported and must load offline in transformers and encode like ours.
"""

from __future__ import annotations

import json
import math
import pydoc_data.topics
import shutil
from pathlib import Path

import pytest
import torch

from megatron.checkpointing.zero3 import merge_zero3_partitions
from megatron.conversion.hf_tokenizer import (
    SAMPLE_TEXT,
    export_tokenizer,
    hf_dir_tokenizer,
    special_token_ids,
)
from megatron.model.presets import GPT2_FLAGS
from megatron.testing import run_distributed
from megatron.testing.tokenizers import swapped_vocab
from megatron.tokenizer import build_tokenizer, encoding_fingerprint
from megatron.tokenizer.info import tokenizer_info
from megatron.tokenizer.train import train_bpe, train_sentencepiece
from tools.checkpoint import trident_to_hf

TEXTS = list(pydoc_data.topics.topics.values())[:150]

# hidden 30, 6 heads: at TP 2 the QKV bias holds 45 values per rank, which ZeRO-3 splits unevenly over DP 2.
FLAGS = [
    *GPT2_FLAGS,
    "--num-layers", "2", "--hidden-size", "30", "--num-attention-heads", "6",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2",
    "--lr", "2e-3", "--min-lr", "2e-4", "--clip-grad", "1.0", "--seed", "1234", "--mock-data",
    "--tensor-model-parallel-size", "2", "--eval-iters", "0", "--log-level", "WARNING",
]  # fmt: skip


def test_merge_zero3_partitions_is_exact() -> None:
    """Partition known tensors the ZeRO-3 way (ceil pieces, zero padding), cut each rank's stream into flat groups
    at arbitrary points (DeepSpeed's sub-groups), merge them back."""
    g = torch.Generator().manual_seed(0)
    groups = [
        {"a": torch.Size([5, 3]), "b": torch.Size([7])},
        {"c": torch.Size([4]), "d": torch.Size([2, 2, 3])},
    ]
    params = {n: torch.randn(s, generator=g) for grp in groups for n, s in grp.items()}
    dp = 3
    streams: list[list[torch.Tensor]] = [[] for _ in range(dp)]
    for name, shape in ((n, sh) for grp in groups for n, sh in grp.items()):
        numel = math.prod(shape)
        piece = -(-numel // dp)
        padded = torch.zeros(piece * dp)
        padded[:numel] = params[name].flatten()
        for d in range(dp):
            streams[d].append(padded[d * piece : (d + 1) * piece])
    flat_per_rank = []
    for d in range(dp):
        stream = torch.cat(streams[d])  # 5 + 3 + 2 + 4 = 14 elements per rank
        flat_per_rank.append([stream[:6], stream[6:]])  # a group boundary inside parameter "b"
    merged = merge_zero3_partitions(groups, flat_per_rank)
    assert set(merged) == set(params)
    for name, t in params.items():
        assert torch.equal(merged[name], t), name
    with pytest.raises(ValueError, match="too few for parameter d"):
        merge_zero3_partitions(groups, [[f[0], f[1][:-1]] for f in flat_per_rank])
    with pytest.raises(ValueError, match="use 14 of the 15 elements"):
        merge_zero3_partitions(groups, [[*f, torch.zeros(1)] for f in flat_per_rank])
    with pytest.raises(ValueError, match="same number on every rank"):
        merge_zero3_partitions(groups, [flat_per_rank[0], flat_per_rank[1], flat_per_rank[2][:1]])


def _train_zero_stages(root: str, vocab_file: str, merge_file: str) -> None:
    from megatron.config import parse_args
    from megatron.training import pretrain

    tok = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file]
    tok += ["--merge-file", merge_file]
    for stage in (3, 1):
        save = ["--save", f"{root}/zero{stage}", "--zero-stage", str(stage)]
        pretrain(parse_args([*FLAGS, *tok, *save]))
    # bf16 (DeepSpeed names the optimizer files bf16_zero_pp_rank_*).
    bf16 = ["--save", f"{root}/zero3_bf16", "--zero-stage", "3", "--bf16", "--train-iters", "1"]
    pretrain(parse_args([*FLAGS, *tok, *bf16]))


@pytest.mark.slow
def test_zero3_checkpoint_exports_like_zero1_with_tokenizer(tmp_path: Path, capsys) -> None:
    from transformers import AutoTokenizer

    (tmp_path / "bpe").mkdir()
    paths = train_bpe(TEXTS, vocab_size=512, output_dir=str(tmp_path / "bpe"))
    vocab, merges = paths["vocab_file"], paths["merge_file"]
    run_distributed(
        _train_zero_stages, 4, str(tmp_path), vocab, merges, init_process_group=False, timeout=300
    )
    z3 = tmp_path / "zero3"
    assert any((z3 / "global_step2").glob("zero_pp_rank_1_mp_rank_01_optim_states.pt"))
    meta = json.loads((z3 / "global_step2" / "trident_meta.json").read_text())
    assert meta["tokenizer"]["tokenizer_type"] == "GPT2BPETokenizer" and meta["zero_stage"] == 3
    ours = build_tokenizer(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert meta["tokenizer"]["fingerprint"] == encoding_fingerprint(ours)

    out3 = _check_zero_stages_export_alike(tmp_path, capsys)

    # The exported tokenizer loads offline, encodes like ours, and config.json carries its ids.
    hf_tok = AutoTokenizer.from_pretrained(str(out3), local_files_only=True)
    assert hf_tok.encode(TEXTS[3], add_special_tokens=False) == ours.tokenize(TEXTS[3])
    config = json.loads((out3 / "config.json").read_text())
    assert config["eos_token_id"] == ours.eod == 0

    _check_refused_tokenizers(tmp_path, z3, vocab, merges, capsys)
    _check_refused_zero3_files(tmp_path, z3, capsys)


def _check_zero_stages_export_alike(tmp_path: Path, capsys) -> Path:
    """The ZeRO-3, ZeRO-1 and bf16 ZeRO-3 checkpoints export with verification, and the weights rebuilt from
    ZeRO-3's partitions are the ZeRO-1 run's weights (same training); returns the ZeRO-3 export."""
    from safetensors.torch import load_file

    z3, z1 = tmp_path / "zero3", tmp_path / "zero1"
    out3, out1 = tmp_path / "hf3", tmp_path / "hf1"
    assert trident_to_hf.main(["--load", str(z3), "--out", str(out3), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "tokenizer: GPT2BPETokenizer -> vocab.json, merges.txt (encodes like" in printed
    assert "greedy agreement = 1.000 -> OK" in printed
    argv = ["--load", str(z1), "--out", str(out1), "--no-progress", "--no-tokenizer"]
    assert trident_to_hf.main(argv) == 0
    assert "-> OK" in capsys.readouterr().out and not (out1 / "vocab.json").exists()
    z3_bf16 = tmp_path / "zero3_bf16"
    assert any((z3_bf16 / "global_step1").glob("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    argv = ["--load", str(z3_bf16), "--out", str(tmp_path / "hf_bf16"), "--no-progress"]
    assert trident_to_hf.main(argv) == 0
    assert "greedy agreement = 1.000 -> OK" in capsys.readouterr().out

    w3, w1 = load_file(str(out3 / "model.safetensors")), load_file(str(out1 / "model.safetensors"))
    assert set(w3) == set(w1)
    worst = max((w3[k] - w1[k]).abs().max().item() for k in w1)
    with capsys.disabled():
        print(f"\nZeRO-3 vs ZeRO-1 export (TP 2 x DP 2, 2 iterations): max |dw| = {worst:.2e}")
    assert worst <= 1e-5
    return out3


def _check_refused_tokenizers(tmp_path: Path, z3: Path, vocab: str, merges: str, capsys) -> None:
    """A tokenizer that does not fit leaves no output; so does one moved since training (until named)."""
    other = tmp_path / "bpe400"
    other.mkdir()
    small = train_bpe(TEXTS, vocab_size=400, output_dir=str(other))
    wrong = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", small["vocab_file"]]
    wrong += ["--merge-file", small["merge_file"]]
    assert trident_to_hf.main(["--load", str(z3), "--out", str(tmp_path / "w"), *wrong]) == 2
    assert "has 400 tokens but the model was trained with 512" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()
    # Same type and size, other ids (two tokens swapped): not the training tokenizer.
    other_ids = swapped_vocab(vocab, tmp_path / "swapped.json")
    swapped = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", other_ids]
    swapped += ["--merge-file", merges]
    assert trident_to_hf.main(["--load", str(z3), "--out", str(tmp_path / "v"), *swapped]) == 2
    assert "encodes text into other ids than the tokenizer the model was" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()
    moved = tmp_path / "moved_vocab.json"
    shutil.move(vocab, moved)
    assert trident_to_hf.main(["--load", str(z3), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--vocab-file" in err and "no longer exists; pass --vocab-file" in err
    override = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(moved)]
    override += ["--merge-file", merges, "--no-verify", "--no-progress"]
    assert trident_to_hf.main(["--load", str(z3), "--out", str(tmp_path / "y"), *override]) == 0


def _check_refused_zero3_files(tmp_path: Path, z3: Path, capsys) -> None:
    """ZeRO-3 files of another save mixed in; a missing partition file."""
    tag = z3 / "global_step2"
    for kind in ("model", "optim"):
        stale = tag / f"zero_pp_rank_2_mp_rank_01_{kind}_states.pt"
        shutil.copyfile(tag / f"zero_pp_rank_1_mp_rank_01_{kind}_states.pt", stale)
    assert trident_to_hf.main(["--load", str(z3), "--out", str(tmp_path / "s")]) == 2
    assert "saved by 2 data-parallel ranks but" in capsys.readouterr().err
    for kind in ("model", "optim"):
        (tag / f"zero_pp_rank_2_mp_rank_01_{kind}_states.pt").unlink()
    (z3 / "global_step2" / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    assert trident_to_hf.main(["--load", str(z3), "--out", str(tmp_path / "z")]) == 2
    err = capsys.readouterr().err
    # The checksum record names the missing file first (older checkpoints: the ZeRO-3 reader's own message).
    assert "zero_pp_rank_1_mp_rank_01_optim_states.pt is missing" in err


def test_export_tokenizer_flavours(tmp_path: Path) -> None:
    """SentencePiece and HF tokenizer files export and re-encode identically; mismatches are refused."""
    from transformers import AutoTokenizer

    (tmp_path / "sp").mkdir()
    sp = train_sentencepiece(TEXTS, vocab_size=512, output_dir=str(tmp_path / "sp"))
    info = tokenizer_info(
        tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=sp["tokenizer_model"]
    )
    ours = build_tokenizer(**info)
    out = tmp_path / "out_sp"
    out.mkdir()
    assert "GPTSentencePieceTokenizer -> tokenizer.json, tokenizer.model" in export_tokenizer(
        info, out, 512
    )
    hf = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert hf.encode(SAMPLE_TEXT, add_special_tokens=False) == ours.tokenize(SAMPLE_TEXT)
    assert hf.encode("x y") == ours.tokenize("x y")  # no BOS added, as in training
    for text in (
        " leading space",
        "  two",
        "a  b ",
    ):  # where SentencePiece conversions usually differ
        assert hf.encode(text, add_special_tokens=False) == ours.tokenize(text), text
    assert hf.decode(ours.tokenize(SAMPLE_TEXT)) == SAMPLE_TEXT
    assert special_token_ids(info) == (ours.bos, ours.eod)

    bpe_dir = tmp_path / "bpe"
    bpe_dir.mkdir()
    train_bpe(TEXTS, vocab_size=400, output_dir=str(bpe_dir))
    hf_info = hf_dir_tokenizer(bpe_dir)
    assert hf_info == {"tokenizer_type": "HFTokenizer", "tokenizer_model": str(bpe_dir)}
    out = tmp_path / "out_hf"
    out.mkdir()
    assert "HFTokenizer -> tokenizer.json" in export_tokenizer(hf_info, out, 400)
    hf = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    ours = build_tokenizer(**hf_info)
    assert hf.encode(SAMPLE_TEXT, add_special_tokens=False) == ours.tokenize(SAMPLE_TEXT)
    assert hf_dir_tokenizer(tmp_path) is None

    with pytest.raises(ValueError, match="has 400 tokens but the model was trained with 512"):
        export_tokenizer(hf_info, out, 512)
    megatron_sp = {**info, "tokenizer_type": "SentencePieceTokenizer"}
    assert "no Hugging Face equivalent" in export_tokenizer(megatron_sp, out)
    assert "none recorded" in export_tokenizer(None, out)
