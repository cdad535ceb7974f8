"""Unit tests of the checkpoint plumbing that needs no process group: pointers, preflight, shape check, RNG files."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.checkpointing.meta import META_FILE, model_mismatches
from megatron.checkpointing.pointers import find_checkpoint
from megatron.checkpointing.rng import load_rng_file, save_rng_file
from megatron.checkpointing.rules import (
    RESUME_RULES,
    ResumeCase,
    check_resume_compatibility,
    check_save_dir,
)
from megatron.config import ModelConfig
from megatron.mpu.random import get_cuda_rng_tracker


def _complete(root: Path, tag: str) -> None:
    (root / tag).mkdir(parents=True)
    (root / tag / META_FILE).write_text("{}")


def test_find_checkpoint(tmp_path: Path) -> None:
    assert find_checkpoint(str(tmp_path)) is None  # empty --load dir: start from scratch
    assert find_checkpoint(str(tmp_path / "missing")) is None
    _complete(tmp_path, "global_step3")
    (tmp_path / "global_step6").mkdir()  # a save killed before its marker
    (tmp_path / "latest").write_text("global_step3")
    assert find_checkpoint(str(tmp_path)) == "global_step3"
    assert find_checkpoint(str(tmp_path), "global_step3") == "global_step3"
    with pytest.raises(FileNotFoundError, match=r"--load-tag global_step6: .* is not a complete"):
        find_checkpoint(str(tmp_path), "global_step6")
    (tmp_path / "latest").write_text("global_step6")
    with pytest.raises(
        ValueError, match=r"'latest' points to 'global_step6', which is not a complete"
    ):
        find_checkpoint(str(tmp_path))


def test_check_save_dir(tmp_path: Path) -> None:
    check_save_dir(str(tmp_path / "new" / "dir"))  # created
    assert (tmp_path / "new" / "dir").is_dir() and not list((tmp_path / "new" / "dir").iterdir())
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"--save .*file/sub: the directory cannot be written"):
        check_save_dir(str(blocker / "sub"))


def test_model_mismatches_lists_every_field() -> None:
    cur = ModelConfig(num_layers=2, hidden_size=32, vocab_size=299, max_position_embeddings=128)
    saved = {**cur.__dict__, "num_layers": 4, "swiglu": True}
    assert model_mismatches(saved, cur) == [
        "num_layers: checkpoint 4, flags 2",
        "ffn_size: checkpoint 64, flags 128",
        "swiglu: checkpoint True, flags False",
    ]
    # Defaults resolve: an explicit 4h MLP and kv heads = heads match the implicit ones.
    explicit = {**cur.__dict__, "ffn_hidden_size": 128, "num_key_value_heads": 4}
    assert model_mismatches(explicit, cur) == []
    assert model_mismatches({**cur.__dict__, "seq_length": 999}, cur) == []  # not a shape


def test_rng_file_round_trip(tmp_path: Path) -> None:
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 77)
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.standard_normal()  # a cached gaussian in numpy's state
    path = tmp_path / "rng.safetensors"
    save_rng_file(path)

    def draw() -> tuple:
        with tracker.fork():
            t = torch.rand(3)
        return torch.rand(3).tolist(), t.tolist(), np.random.standard_normal(), random.random()

    expected = draw()
    draw()
    load_rng_file(path)
    assert draw() == expected
    assert path.read_bytes()[:8]  # a safetensors file (no pickle)
    with pytest.raises(FileNotFoundError, match="--no-load-rng"):
        load_rng_file(tmp_path / "other.safetensors")
    tracker.reset()


def _run_checkpoint(root: Path, tag: str, model: ModelConfig, **meta: object) -> None:
    """A complete checkpoint as far as preflight reads it: the marker meta and 'latest'."""
    import dataclasses
    import json

    (root / tag).mkdir(parents=True, exist_ok=True)
    full = {
        "iteration": int(tag.removeprefix("global_step").split("_")[0]),
        "model": dataclasses.asdict(model),
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "world_size": 1,
        "zero_stage": 1,
        **meta,
    }
    full = {k: v for k, v in full.items() if v is not None}  # None: a key older checkpoints lack
    (root / tag / META_FILE).write_text(json.dumps(full))
    (root / tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    (root / "latest").write_text(tag)


# check_checkpoint_dirs (all before any process group): another run's --save, --finetune over a run, layout
# changes, ZeRO stage and precision changes, --load mistakes, tokenizer changes.
_TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--max-position-embeddings", "16", "--micro-batch-size", "1", "--train-iters", "2",
    "--mock-data", "--vocab-size", "99", "--zero-stage", "1",
]  # fmt: skip
_TINY_MODEL = ModelConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
    max_position_embeddings=16, vocab_size=99,
)  # fmt: skip


def check(*flags: str, world: int = 1, tokenizer_fingerprint: str | None = None) -> None:
    """``check_checkpoint_dirs`` of the tiny run with ``flags`` on ``world`` ranks."""
    from megatron.checkpointing.rules import check_checkpoint_dirs
    from megatron.config import RunPlan, parse_args

    cfg = parse_args([*_TINY, *flags])
    plan = RunPlan.build(cfg, world_size=world, true_vocab=99)
    check_checkpoint_dirs(cfg, plan, tokenizer_fingerprint=tokenizer_fingerprint)


def test_preflight_save_and_finetune_rules(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _run_checkpoint(run, "global_step4", _TINY_MODEL)
    check("--load", str(run), "--save", str(run))  # auto-resume: fine
    with pytest.raises(
        ValueError, match=r"already holds checkpoints of a run \(newest global_step4\)"
    ):
        check("--save", str(run))
    with pytest.raises(ValueError, match=f"pass --load {run}"):
        check("--load", str(tmp_path / "other"), "--save", str(run))
    with pytest.raises(ValueError, match="relaunch without --finetune"):
        check("--load", str(run), "--save", str(run), "--finetune")
    imported = tmp_path / "imported"
    _run_checkpoint(imported, "global_step0", _TINY_MODEL, weights_only=True)
    check("--load", str(imported), "--save", str(imported), "--finetune")  # first fine-tune step
    with pytest.raises(ValueError, match="pass --load .* and drop --finetune"):
        check("--load", str(imported), "--save", str(run), "--finetune")
    (run / "global_step4" / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(FileNotFoundError, match="lacks mp_rank_00_model_states.pt"):
        check("--load", str(run), "--save", str(run))


def test_preflight_layout_and_zero3_rules(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _run_checkpoint(run, "global_step4", _TINY_MODEL)
    # Layout: a ZeRO >= 1 checkpoint loaded with its optimizer state converts on load (relayout.py); TP/PP
    # otherwise always refused, DP when ZeRO partitions what is loaded.
    check("--load", str(run), "--tensor-model-parallel-size", "2", world=2)  # converts
    check("--load", str(run), world=2)  # converts
    with pytest.raises(
        ValueError, match=r"saved with --tensor-model-parallel-size 1 .* uses 2.* drop "
    ):
        check("--load", str(run), "--tensor-model-parallel-size", "2", "--no-load-optim", world=2)
    check("--load", str(run), "--no-load-optim", world=2)
    z0 = tmp_path / "z0"
    _run_checkpoint(z0, "global_step2", _TINY_MODEL, zero_stage=0)
    with pytest.raises(
        ValueError, match=r"uses 2 and 1\. Use the checkpoint's sizes, or it was saved with ZeRO-0"
    ):
        check("--load", str(z0), "--tensor-model-parallel-size", "2", world=2)
    z3 = tmp_path / "z3"
    _run_checkpoint(z3, "global_step2", _TINY_MODEL, zero_stage=3)
    with pytest.raises(
        ValueError, match="ZeRO-3, whose weights and optimizer state .* not converted on"
    ):
        check("--load", str(z3), "--zero-stage", "3", world=2)
    check("--load", str(run), "--zero-stage", "3", world=2)  # ZeRO-1 -> ZeRO-3 converts
    with pytest.raises(ValueError, match="ZeRO-3 universal loader reads no TP slices"):
        check("--load", str(run), "--zero-stage", "3", "--tensor-model-parallel-size", "2", world=2)
    # Without the optimizer state Trident reads ZeRO-3 weights itself: any DP size.
    check("--load", str(z3), "--no-load-optim", "--zero-stage", "3", world=2)
    check("--load", str(z3), "--finetune", world=2)  # weights only: any stage, any DP size
    # A checkpoint from before the stage was recorded: ZeRO-3 recognized by its files.
    old_z3 = tmp_path / "old_z3"
    _run_checkpoint(old_z3, "global_step2", _TINY_MODEL, zero_stage=None)
    (old_z3 / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="saved with ZeRO-3; this run uses ZeRO-1"):
        check("--load", str(old_z3))
    # 3 -> 0/1/2 only for weights (1/2 -> 3 converts on load, above).
    with pytest.raises(
        ValueError,
        match=r"saved with ZeRO-3; this run uses ZeRO-1, .* other files .* --zero-stage 3 to resume, or "
        "--finetune",
    ):
        check("--load", str(z3))
    with pytest.raises(ValueError, match="saved with ZeRO-1; this run uses ZeRO-3"):
        check("--load", str(run), "--zero-stage", "3", "--no-load-optim")
    check("--load", str(run), "--zero-stage", "3", "--finetune")


def test_preflight_zero_stage_and_precision_rules(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _run_checkpoint(run, "global_step4", _TINY_MODEL)
    # ZeRO stage changes: 0 <-> 1/2 without the optimizer state; 1 <-> 2 freely.
    with pytest.raises(
        ValueError,
        match=r"saved with ZeRO-1; this run uses ZeRO-0, whose optimizer state DeepSpeed stores "
        r"differently. Pass --zero-stage 1 \(or 2\), or --no-load-optim",
    ):
        check("--load", str(run), "--zero-stage", "0")
    check("--load", str(run), "--zero-stage", "0", "--no-load-optim")
    check("--load", str(run), "--zero-stage", "2")
    # Pipelines: no ZeRO-2 to suggest; ZeRO-0 raised to 1 by --clip-grad is explained.
    pp = ["--pipeline-model-parallel-size", "2"]
    pipe1 = tmp_path / "pipe1"
    _run_checkpoint(
        pipe1, "global_step2", _TINY_MODEL, pipeline_model_parallel_size=2, world_size=2
    )
    with pytest.raises(ValueError, match=r"Pass --zero-stage 1, or --no-load-optim"):
        check("--load", str(pipe1), *pp, "--zero-stage", "0", "--clip-grad", "0", world=2)
    pipe0 = tmp_path / "pipe0"
    _run_checkpoint(
        pipe0,
        "global_step2",
        _TINY_MODEL,
        pipeline_model_parallel_size=2,
        world_size=2,
        zero_stage=0,
    )
    with pytest.raises(
        ValueError,
        match=r"uses ZeRO-1 \(--zero-stage 0 becomes 1 with pipeline parallelism and --clip-grad.*"
        r"Pass --clip-grad 0 \(as when it was saved\), or --no-load-optim",
    ):
        clipped = ["--zero-stage", "0", "--clip-grad", "1"]
        check("--load", str(pipe0), *pp, *clipped, world=2)
    # Precision: the optimizer state of bf16 and fp32 runs lives in other files.
    bf16 = tmp_path / "bf16"
    _run_checkpoint(bf16, "global_step2", _TINY_MODEL, precision="bf16")
    with pytest.raises(
        ValueError,
        match=r"was trained in bf16; this run uses fp32, .* Pass --bf16 as before, or --no-load-optim",
    ):
        check("--load", str(bf16))
    check("--load", str(bf16), "--bf16")
    check("--load", str(bf16), "--no-load-optim")
    check("--load", str(bf16), "--finetune")


def test_preflight_load_mistakes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _run_checkpoint(run, "global_step4", _TINY_MODEL)
    with pytest.raises(ValueError, match="is a file"):
        check("--load", str(run / "latest"))
    with pytest.raises(FileNotFoundError, match="--load .*typo does not exist"):
        check("--load", str(tmp_path / "typo"))
    check("--load", str(tmp_path / "fresh"), "--save", str(tmp_path / "fresh"))  # first launch
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="--finetune: --load .* holds no checkpoint"):
        check("--load", str(tmp_path / "empty"), "--finetune")
    with pytest.raises(FileNotFoundError, match="--skip-train: --load .* holds no checkpoint"):
        check("--load", str(tmp_path / "empty"), "--skip-train")
    with pytest.raises(ValueError, match="--finetune was given without --load"):
        check("--finetune")


def test_preflight_tokenizer_rules(tmp_path: Path, caplog) -> None:
    # A different tokenizer type than the checkpoint's: a warning (two types can give the same ids).
    tok = tmp_path / "tok"
    _run_checkpoint(tok, "global_step1", _TINY_MODEL, tokenizer={"tokenizer_type": "NullTokenizer"})
    check("--load", str(tok), "--tokenizer-type", "GPT2BPETokenizer")
    assert "trained with --tokenizer-type NullTokenizer" in caplog.text
    # Recorded encoding fingerprints that differ: an error (same type, other files), a warning with --finetune.
    printed = tmp_path / "printed"
    recorded = {
        "tokenizer_type": "HFTokenizer",
        "tokenizer_model": "/data/tok",
        "fingerprint": "aa11",
    }
    _run_checkpoint(printed, "global_step1", _TINY_MODEL, tokenizer=recorded)
    check("--load", str(printed), tokenizer_fingerprint="aa11")
    check("--load", str(printed))  # a NullTokenizer run cannot tell: no check
    with pytest.raises(
        ValueError,
        match=r"encodes text into other ids than this run's .*Pass the tokenizer it was trained with "
        r"\(--tokenizer-type HFTokenizer, tokenizer_model /data/tok; .*or start a new run .* --finetune",
    ):
        check("--load", str(printed), tokenizer_fingerprint="bb22")
    caplog.clear()
    check("--load", str(printed), "--finetune", tokenizer_fingerprint="bb22")
    assert "encodes text into other ids" in caplog.text and "--finetune" in caplog.text


def test_relaunched_universal_flag_resumes_newer_regular_checkpoint(tmp_path: Path) -> None:
    from megatron.checkpointing.pointers import resolve_universal_flag
    from megatron.config import parse_args

    model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=99)
    _run_checkpoint(tmp_path, "global_step2_universal", model, universal=True, iteration=2)
    (tmp_path / "latest_universal").write_text("global_step2_universal")
    _run_checkpoint(tmp_path, "global_step2", model)
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    argv += ["--mock-data", "--vocab-size", "99", "--load", str(tmp_path), "--universal-checkpoint"]
    cfg = parse_args(argv)
    ck, parallel = cfg.checkpoint, cfg.parallel
    assert resolve_universal_flag(ck, parallel).universal_checkpoint  # not newer: kept
    _run_checkpoint(tmp_path, "global_step5", model)  # saved by 1 rank at TP = PP = 1
    assert not resolve_universal_flag(ck, parallel, 1).universal_checkpoint
    # Another layout: keep the flag.
    assert resolve_universal_flag(ck, parallel, 2).universal_checkpoint


_RESUMABLE = ResumeCase(
    load_dir="ck", tag="global_step2", saved_tp=1, saved_pp=1, saved_dp=2, saved_stage=1,
    saved_precision="fp32", run_tp=1, run_pp=1, run_dp=2, run_stage=1, requested_stage=1,
    run_precision="fp32", weights_only=False, optimizer_state=True,
)  # fmt: skip
_WEIGHTS_ONLY = {"weights_only": True, "optimizer_state": False}  # --finetune
_NO_OPTIM = {"optimizer_state": False}  # --no-load-optim
RESUME_ROWS = [
    # (change that breaks the row, the fix its message names, message)
    (  # not converted on load: weights only
        {"run_tp": 2, "run_dp": 1, "optimizer_state": False},
        {"run_tp": 1, "run_dp": 2},
        r"saved with --tensor-model-parallel-size 1 and --pipeline-model-parallel-size 1; this run uses 2 "
        r"and 1\. Use the checkpoint's sizes, or drop --no-load-optim / --finetune: a load with the optimizer "
        r"state converts to the new layout on the way in",
    ),
    (
        {"run_stage": 3, "requested_stage": 3, "optimizer_state": False},
        _WEIGHTS_ONLY,
        r"saved with ZeRO-1; this run uses ZeRO-3, and DeepSpeed keeps ZeRO-3's weights in other files "
        r"than ZeRO-0/1/2's\. Pass --zero-stage 1 to resume, or --finetune",
    ),
    (
        {"run_stage": 0, "requested_stage": 0},
        _NO_OPTIM,
        r"saved with ZeRO-1; this run uses ZeRO-0, whose optimizer state DeepSpeed stores differently\. "
        r"Pass --zero-stage 1 \(or 2\), or --no-load-optim",
    ),
    (
        {"run_precision": "bf16"},
        _NO_OPTIM,
        r"trained in fp32; this run uses bf16, .* Pass neither --bf16 nor --fp16 as before, or --no-load-optim",
    ),
    (  # not converted on load: a bf16 MoE checkpoint
        {"saved_ep": 2, "saved_precision": "bf16", "run_precision": "bf16"},
        _NO_OPTIM,
        r"saved with --moe-expert-parallel-size 2; this run uses 1, .* Resume with "
        r"--moe-expert-parallel-size 2 \(on a data-parallel size divisible by it\), or pass --no-load-optim",
    ),
    (  # not converted on load: a bf16 MoE checkpoint
        {"run_dp": 4, "saved_ep": 1, "saved_precision": "bf16", "run_precision": "bf16"},
        _NO_OPTIM,
        r"saved by 2 data-parallel ranks with ZeRO-1, whose optimizer state are partitioned over them; this "
        r"run has 4\. Launch 2 processes, pass --no-load-optim",
    ),
]


@pytest.mark.parametrize(
    "row", range(len(RESUME_RULES)), ids=[rule.what.split(",")[0] for rule in RESUME_RULES]
)
def test_each_resume_rule(row: int) -> None:
    """One row of the resume-compatibility table: broken by one change (and the first row broken, so its message
    is the error), not broken after the fix the message names."""
    assert len(RESUME_ROWS) == len(RESUME_RULES)
    rule, (change, fix, message) = RESUME_RULES[row], RESUME_ROWS[row]
    assert not any(r.broken(_RESUMABLE) for r in RESUME_RULES)
    check_resume_compatibility(_RESUMABLE)
    check_resume_compatibility(None)  # a universal load: nothing to compare
    broken = dataclasses.replace(_RESUMABLE, **change)
    assert [r for r in RESUME_RULES if r.broken(broken)][0] is rule
    with pytest.raises(ValueError, match=message):
        check_resume_compatibility(broken)
    fixed = dataclasses.replace(broken, **fix)
    assert not rule.broken(fixed)
    check_resume_compatibility(fixed)


def test_hashing_save_skips_torch_crc_and_loads_back(tmp_path: Path) -> None:
    """The checksummed save writes records without torch's CRC-32 (the SHA-256 covers them), loads back equal
    through torch.load, records the file's real SHA-256, and leaves torch's CRC option as it was."""
    import hashlib
    import zipfile

    from megatron.checkpointing.checksums import ALGORITHM, ChecksumRecorder

    state = {"w": torch.randn(300_000), "step": 3}
    recorder = ChecksumRecorder(tmp_path)
    assert torch.serialization.get_crc32_options()
    recorder.torch_save(state, tmp_path / "model.pt", True)
    assert torch.serialization.get_crc32_options()  # restored
    back = torch.load(tmp_path / "model.pt", weights_only=True)
    assert torch.equal(back["w"], state["w"]) and back["step"] == 3
    digest = hashlib.sha256((tmp_path / "model.pt").read_bytes()).hexdigest()
    assert recorder.files["model.pt"][ALGORITHM] == digest
    with zipfile.ZipFile(tmp_path / "model.pt") as z:
        assert {i.CRC for i in z.infolist() if i.filename.endswith("/data/0")} == {0}
