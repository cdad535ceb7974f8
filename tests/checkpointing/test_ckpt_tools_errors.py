"""Bad input to the checkpoint CLIs: one ``error:`` line and exit 2, before any rank is spawned or file written.

A real training checkpoint (ZeRO-0, 2 iterations) and a real HF GPT-2 directory (our own GPT2BPETokenizer export:
vocab.json + merges.txt, no tokenizer.json) are the inputs. Covered: --save that is the --load directory, a file,
or a directory holding another run (its 'latest' must not move); --tp that does not divide the heads; --out of
trident_to_hf that is a file or not empty (and --overwrite removing stale tokenizer files); --tag naming the
tool's flag; to_universal on a ZeRO-0 checkpoint; the vocab.json/merges.txt tokenizer surviving HF -> Trident -> HF.
"""

from __future__ import annotations

import json
import os
import pydoc_data.topics
import shutil
import stat
from pathlib import Path

import pytest

from megatron.conversion.hf_tokenizer import export_tokenizer, hf_dir_tokenizer
from megatron.testing import run_distributed
from megatron.tokenizer import build_tokenizer
from megatron.tokenizer.info import tokenizer_info
from megatron.tokenizer.train import train_bpe
from tools.checkpoint import hf_to_trident, reshard, to_universal, trident_to_hf

TEXTS = list(pydoc_data.topics.topics.values())[:60]
BPE_VOCAB = 300


def _train(ck: str) -> None:
    from test_ckpt_resume import TINY

    from megatron.config import parse_args
    from megatron.training import pretrain

    pretrain(parse_args([*TINY, "--train-iters", "2", "--eval-iters", "0", "--save", ck]))


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ZeRO-0 training checkpoint (global_step2, 'latest')."""
    path = tmp_path_factory.mktemp("train") / "ck"
    run_distributed(_train, 1, str(path), init_process_group=False, timeout=300)
    assert (path / "latest").read_text().strip() == "global_step2"
    return path


@pytest.fixture(scope="module")
def hf_bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GPT-2 HF directory whose tokenizer is vocab.json + merges.txt only (what our GPT2BPE export writes)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("hf")
    (root / "bpe").mkdir()
    paths = train_bpe(TEXTS, vocab_size=BPE_VOCAB, output_dir=str(root / "bpe"))
    info = tokenizer_info(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=paths["vocab_file"],
        merge_file=paths["merge_file"],
    )
    hf = root / "gpt2"
    hf.mkdir()
    assert "vocab.json, merges.txt" in export_tokenizer(info, hf, BPE_VOCAB)
    config = GPT2Config(vocab_size=BPE_VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    GPT2LMHeadModel(config).save_pretrained(hf)
    assert not (hf / "tokenizer.json").exists()
    return hf


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def _snapshot(path: Path) -> dict[str, float]:
    return {str(p.relative_to(path)): p.stat().st_mtime for p in sorted(path.rglob("*"))}


def test_save_must_be_a_new_directory(
    ck: Path, hf_bpe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other_run = tmp_path / "other_run"
    shutil.copytree(ck, other_run)
    before = _snapshot(ck), _snapshot(other_run)
    (tmp_path / "plain_file").write_text("x")
    fast = ["--no-verify", "--no-progress"]

    assert reshard.main(["--load", str(ck), "--save", str(ck), "--tp", "1", "--pp", "1"]) == 2
    assert "is the --load directory" in _error(capsys)
    for argv in (
        ["reshard", "--load", str(ck), "--save", str(other_run), "--tp", "1", "--pp", "1"],
        ["hf", "--hf-dir", str(hf_bpe), "--save", str(other_run)],
    ):
        tool = reshard if argv[0] == "reshard" else hf_to_trident
        assert tool.main([*argv[1:], *fast]) == 2
        err = _error(capsys)
        assert f"--save {other_run} already holds checkpoints (global_step2, latest" in err
        assert "restart from iteration 0" in err and "new or empty directory" in err
    assert (_snapshot(ck), _snapshot(other_run)) == before  # nothing written, 'latest' unmoved

    for save, says in (("plain_file", "is a file"), ("plain_file/sub", "which is a file")):
        target = str(tmp_path / save)
        assert reshard.main(["--load", str(ck), "--save", target, "--tp", "1", "--pp", "1"]) == 2
        assert says in _error(capsys)
        assert hf_to_trident.main(["--hf-dir", str(hf_bpe), "--save", target, *fast]) == 2
        assert says in _error(capsys)


def test_tp_must_divide_the_heads_before_spawning(
    ck: Path, hf_bpe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before the fix the 3 spawned ranks failed inside the model and main() raised DistributedTestError.
    out = tmp_path / "tp3"
    argv = ["--load", str(ck), "--save", str(out), "--tp", "3", "--pp", "1", "--no-progress"]
    assert reshard.main(argv) == 2
    err = _error(capsys)
    assert "--num-attention-heads (4) must be divisible by --tp (3); use 1, 2 or 4" in err
    argv = ["--hf-dir", str(hf_bpe), "--save", str(out), "--tp", "3", "--no-progress"]
    assert hf_to_trident.main(argv) == 2
    assert "must be divisible by --tp (3); use 1, 2 or 4" in _error(capsys)
    assert not out.exists()


def test_gpt2_bpe_tokenizer_survives_hf_round_trip(
    hf_bpe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    info = hf_dir_tokenizer(hf_bpe)
    assert info == {
        "tokenizer_type": "GPT2BPETokenizer",
        "vocab_file": str(hf_bpe / "vocab.json"),
        "merge_file": str(hf_bpe / "merges.txt"),
    }
    assert build_tokenizer(**info).vocab_size == BPE_VOCAB
    ck = tmp_path / "imported"
    fast = ["--no-verify", "--no-progress"]
    assert hf_to_trident.main(["--hf-dir", str(hf_bpe), "--save", str(ck), *fast]) == 0
    meta = json.loads((ck / "global_step0" / "trident_meta.json").read_text())
    assert meta["tokenizer"] == info
    back = tmp_path / "back"
    assert trident_to_hf.main(["--load", str(ck), "--out", str(back), *fast]) == 0
    assert "tokenizer: GPT2BPETokenizer -> vocab.json, merges.txt" in capsys.readouterr().out
    assert (back / "vocab.json").read_bytes() == (hf_bpe / "vocab.json").read_bytes()


def test_export_out_dir_rules_and_overwrite(
    ck: Path, hf_bpe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fast = ["--no-verify", "--no-progress"]
    (tmp_path / "plain_file").write_text("x")
    assert (
        trident_to_hf.main(["--load", str(ck), "--out", str(tmp_path / "plain_file"), *fast]) == 2
    )
    assert "--out" in (err := _error(capsys)) and "is a file" in err

    # A tokenizer directory from another model: refused untouched; --overwrite removes its stale tokenizer.json
    # (which AutoTokenizer would otherwise prefer), keeps unrelated files.
    old = tmp_path / "old_tok"
    shutil.copytree(hf_bpe, old)
    (old / "tokenizer.json").write_text("{}")
    (old / "notes.txt").write_text("mine")
    before = _snapshot(old)
    assert trident_to_hf.main(["--load", str(ck), "--out", str(old), *fast]) == 2
    err = _error(capsys)
    assert f"--out {old} is not empty (config.json, " in err and "pass --overwrite" in err
    assert _snapshot(old) == before

    old_umask = os.umask(0o027)
    try:
        assert trident_to_hf.main(["--load", str(ck), "--out", str(old), "--overwrite", *fast]) == 0
    finally:
        os.umask(old_umask)
    printed = capsys.readouterr().out
    assert "--overwrite: removed " in printed and "tokenizer.json" in printed
    names = {p.name for p in old.iterdir()}
    assert names == {
        "config.json",
        "model.safetensors",
        "notes.txt",
    }  # NullTokenizer run: no tokenizer
    assert (
        json.loads((old / "config.json").read_text())["vocab_size"] == 300
    )  # --vocab-size 299 + EOD
    # safetensors writes 0600; the export follows the umask like config.json does.
    assert stat.S_IMODE((old / "model.safetensors").stat().st_mode) == 0o640
    assert stat.S_IMODE((old / "config.json").stat().st_mode) == 0o640

    empty = tmp_path / "empty"
    empty.mkdir()
    assert trident_to_hf.main(["--load", str(ck), "--out", str(empty), *fast]) == 0


def test_tag_errors_name_the_tools_flag(
    ck: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "o")
    assert trident_to_hf.main(["--load", str(ck), "--tag", "X", "--out", out]) == 2
    err = _error(capsys)
    assert "--tag X:" in err and "--load-tag" not in err
    assert "complete tags there: global_step2" in err and "drop --tag to use 'latest'" in err
    assert (
        reshard.main(["--load", str(ck), "--tag", "X", "--save", out, "--tp", "1", "--pp", "1"])
        == 2
    )
    assert "--tag X:" in _error(capsys)
    assert to_universal.main(["--load", str(ck), "--tag", "X"]) == 2
    assert "--load-tag" not in _error(capsys)


def test_to_universal_refuses_zero0(
    ck: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    z0 = tmp_path / "z0"
    shutil.copytree(ck, z0)
    assert to_universal.main(["--load", str(z0)]) == 2
    err = _error(capsys)
    assert "was saved with ZeRO stage 0" in err and "--zero-stage >= 1" in err
    # A checkpoint from before trident_meta.json recorded zero_stage: told by its missing optimizer files.
    meta_file = z0 / "global_step2" / "trident_meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["zero_stage"]
    meta_file.write_text(json.dumps(meta))
    assert to_universal.main(["--load", str(z0)]) == 2
    err = _error(capsys)
    assert (
        "has no ZeRO optimizer partitions (*_optim_states.pt)" in err and "--zero-stage >= 1" in err
    )
    assert not list(z0.glob("*universal*"))


def _damaged_copy(ck: Path, dst: Path, *, truncate: bool) -> Path:
    """A copy of ``ck`` whose model-state file is cut to 1000 bytes (``truncate``) or has 2000 flipped bytes."""
    shutil.copytree(ck, dst)
    model = dst / "global_step2" / "mp_rank_00_model_states.pt"
    data = bytearray(model.read_bytes())
    if truncate:
        model.write_bytes(bytes(data[:1000]))
    else:
        for i in range(len(data) // 2, len(data) // 2 + 2000):
            data[i] ^= 0xA5
        model.write_bytes(bytes(data))
    return dst


def test_checkpoint_tools_accept_no_verify_checkpoint_checksums(
    ck: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 35 (22): the refusal of a damaged checkpoint recommends --no-verify-checkpoint-checksums; every tool
    that reads a checkpoint accepts it, with training's meaning (sizes still compared, SHA-256 skipped)."""
    from megatron.conversion.universal import check_converter_inputs
    from tools import generate_text

    flipped = _damaged_copy(ck, tmp_path / "flipped", truncate=False)
    cut = _damaged_copy(ck, tmp_path / "cut", truncate=True)
    flag = "--no-verify-checkpoint-checksums"

    def run(tool: str, load: Path, *extra: str) -> int:
        argv = {
            "trident_to_hf": (trident_to_hf.main, ["--out", str(tmp_path / f"hf-{load.name}")]),
            "reshard": (reshard.main, ["--save", str(tmp_path / "rs"), "--tp", "1", "--pp", "1"]),
            "generate_text": (generate_text.main, ["--device", "cpu", "--greedy"]),
        }[tool]
        quiet = ["--no-verify", "--no-progress"] if tool != "generate_text" else []
        return argv[0](["--load", str(load), *argv[1], *quiet, *extra])

    for tool in ("trident_to_hf", "reshard", "generate_text"):
        assert run(tool, flipped) == 2, tool
        err = _error(capsys)
        assert "does not match its sha256 checksum" in err and flag in err, (tool, err)
        assert run(tool, cut, flag) == 2, tool  # accepted; the size is still compared
        assert "has 1000 bytes but had" in _error(capsys), tool
    assert run("trident_to_hf", flipped, flag) == 0  # the hashing skipped: the export goes ahead
    capsys.readouterr()
    # to_universal: the flag parses (this ZeRO-0 checkpoint is refused for its stage), and reaches the pre-read
    assert to_universal.main(["--load", str(cut), flag]) == 2
    assert "ZeRO stage 0" in _error(capsys)
    meta = json.loads((flipped / "global_step2" / "trident_meta.json").read_text())
    with pytest.raises(ValueError, match="does not match its sha256 checksum"):
        check_converter_inputs(flipped / "global_step2", meta)
    check_converter_inputs(flipped / "global_step2", meta, hashes=False)
