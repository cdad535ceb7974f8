"""Checkpoint reliability (issue #15): checksums recorded while saving and checked before a load, tags that stay
inside --load, to_universal's restricted pre-read, conversion outputs never inside their inputs, one line instead
of a traceback (truncated file, disk full, universal + ZeRO-0, failed export, interrupted reshard).

Training runs are real ``pretrain_gpt.py`` subprocesses (the tiny model of the bad-input catalogue); one trained
ZeRO-1 checkpoint is shared by the module and copied by each test that changes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.checkpointing.pointers import find_checkpoint, find_tag
from tests.badinput.cases import TINY_FLAGS
from tools.checkpoint import reshard, to_universal, trident_to_hf

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
MODEL_FILE = "mp_rank_00_model_states.pt"


def _train(*extra: str, preexec=None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "pretrain_gpt.py", *TINY_FLAGS, "--zero-stage", "1", *extra]
    return subprocess.run(
        argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec
    )


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _one_error(r: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ck = tmp_path_factory.mktemp("trained") / "ck"
    r = _train("--train-iters", "2", "--save", str(ck))
    assert r.returncode == 0, r.stderr[-3000:]
    return ck


def _copy(trained: Path, tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck, symlinks=True)
    return ck


def test_checksums_recorded_and_damage_refused(trained: Path, tmp_path: Path) -> None:
    tag_dir = trained / "global_step2"
    meta = json.loads((tag_dir / "trident_meta.json").read_text())
    files = meta["checksums"]["files"]
    on_disk = sorted(p.name for p in tag_dir.iterdir() if p.name != "trident_meta.json")
    assert (
        meta["checksums"]["algorithm"] == "sha256" and sorted(files) == on_disk
    )  # no sidecar left
    for name, rec in files.items():
        data = (tag_dir / name).read_bytes()
        assert rec == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    # 2,000 flipped bytes in the model-state file: one line naming it, nothing written (auto-resume launch).
    ck = _copy(trained, tmp_path)
    model = ck / "global_step2" / MODEL_FILE
    good = model.read_bytes()
    data = bytearray(good)
    for i in range(len(data) // 2, len(data) // 2 + 2000):
        data[i] ^= 0xA5
    model.write_bytes(bytes(data))
    before = _snapshot(ck)
    r = _train("--train-iters", "4", "--save", str(ck), "--load", str(ck))
    line = _one_error(r)
    assert r.returncode == 2 and str(model) in line and "sha256 checksum" in line, line
    assert _snapshot(ck) == before

    # Truncated: the recorded size names it, even with the hashing turned off.
    model.write_bytes(good[: len(good) // 2])
    r = _train(
        "--train-iters", "4", "--load", str(ck), "--no-verify-checkpoint-checksums"
    )  # fmt: skip
    line = _one_error(r)
    assert r.returncode == 2 and str(model) in line and "truncated" in line, line

    # A checkpoint saved before checksums were recorded: one warning line, then it loads and trains.
    model.write_bytes(good)
    meta_path = ck / "global_step2" / "trident_meta.json"
    old = {k: v for k, v in meta.items() if k != "checksums"}
    meta_path.write_text(json.dumps(old))
    r = _train("--train-iters", "3", "--load", str(ck), "--log-level", "WARNING")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("records no checksums") == 1, r.stderr[-3000:]
    # ... and truncated without checksums: the archive check names the file.
    from megatron.checkpointing.checksums import check_readable_archives

    model.write_bytes(good[:-100])
    with pytest.raises(ValueError, match=f"{MODEL_FILE} is not a readable torch.save archive"):
        check_readable_archives(ck / "global_step2", [MODEL_FILE])


def test_disk_full_during_save_keeps_latest(trained: Path, tmp_path: Path) -> None:
    ck = _copy(trained, tmp_path)

    def file_size_limit() -> (
        None
    ):  # in the child: writes past 200 kB fail with EFBIG (a full disk's ENOSPC kin)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    before = {p: (ck / p).read_bytes() for p in ("latest", "latest_checkpointed_iteration.txt")}
    r = _train(
        "--train-iters", "4", "--save", str(ck), "--load", str(ck), preexec=file_size_limit
    )  # fmt: skip
    line = _one_error(r)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "saving checkpoint global_step4" in line and "File too large" in line, line
    assert str(ck / "global_step4") in line and "'latest' still points to global_step2" in line, (
        line
    )
    assert {p: (ck / p).read_bytes() for p in before} == before
    assert not (ck / "global_step4" / "trident_meta.json").exists()  # incomplete: never loaded


def _fake_checkpoint(root: Path, tag: str = "global_step4", meta: dict | None = None) -> Path:
    (root / tag).mkdir(parents=True)
    (root / tag / "trident_meta.json").write_text(json.dumps(meta or {"iteration": 4}))
    (root / "latest").write_text(tag)
    return root / tag


def test_tags_stay_inside_the_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other"
    _fake_checkpoint(other)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "latest").write_text("../other/global_step4")
    with pytest.raises(ValueError, match="is not a plain directory name"):
        find_checkpoint(str(mine))
    for tag in ("../other/global_step4", str(other / "global_step4"), "..", "a/b"):
        with pytest.raises(ValueError, match="--load-tag: tag .* is not a plain directory name"):
            find_checkpoint(str(mine), tag)
        with pytest.raises(ValueError, match="--tag: tag"):
            find_tag(mine, tag)
    save = tmp_path / "out"
    argv = ["--load", str(mine), "--tag", "../other/global_step4", "--save", str(save)]
    assert reshard.main([*argv, "--tp", "1", "--pp", "1"]) == 2
    assert to_universal.main(["--load", str(mine), "--tag", str(other / "global_step4")]) == 2
    err = capsys.readouterr().err
    assert err.count("is not a plain directory name") == 2 and "Traceback" not in err
    assert not save.exists() and not (other / "global_step4_universal").exists()


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = Path("/nonexistent")


def test_to_universal_checks_every_file_before_deepspeed_unpickles(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    global MARKER
    MARKER = tmp_path / "payload_ran"
    ck = tmp_path / "ck"
    tag_dir = _fake_checkpoint(
        ck, meta={"iteration": 4, "zero_stage": 1, "model": {"num_layers": 2}}
    )
    evil = tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    evil.write_bytes(pickle.dumps({"optimizer_state_dict": _Payload()}))
    assert to_universal.main(["--load", str(ck)]) == 2
    err = capsys.readouterr().err
    assert str(evil) in err and "to_universal refuses it" in err and "Traceback" not in err
    assert not MARKER.exists() and not (ck / "global_step4_universal").exists()


def test_universal_resume_with_zero_stage_0_is_one_line(trained: Path, tmp_path: Path) -> None:
    ck = _copy(trained, tmp_path)
    meta = json.loads((ck / "global_step2" / "trident_meta.json").read_text())
    u = _fake_checkpoint(ck, "global_step2_universal", {**meta, "universal": True, "checksums": {}})
    (ck / "latest").write_text("global_step2")
    (ck / "latest_universal").write_text(u.name)
    r = _train(
        "--train-iters", "4", "--load", str(ck), "--universal-checkpoint", "--zero-stage", "0"
    )
    line = _one_error(r)
    assert r.returncode == 2 and "--zero-stage 1" in line, line


def test_conversion_outputs_never_inside_inputs_through_symlinks(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    link = tmp_path / "link"
    link.symlink_to(trained, target_is_directory=True)
    before = _snapshot(trained)
    for argv in (
        ["--load", str(trained), "--out", str(link), "--overwrite", "--no-progress"],
        ["--load", str(trained), "--out", str(link / "hf"), "--no-progress"],
    ):
        assert trident_to_hf.main(argv) == 2
        assert "the --load directory" in capsys.readouterr().err
    assert (
        reshard.main(
            ["--load", str(link), "--save", str(trained / "sub"), "--tp", "1", "--pp", "1"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "is inside the --load directory" in err and "Traceback" not in err
    assert _snapshot(trained) == before


def test_failed_export_is_not_moved_into_out(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    argv = ["--load", str(trained), "--out", str(out), "--no-progress", "--verify-steps", "2"]
    assert (
        trident_to_hf.main([*argv, "--tolerance", "-1"]) == 3
    )  # nothing can pass a negative tolerance
    printed = capsys.readouterr().out
    assert "NOT written" in printed and "FAILED" in printed
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    assert (tmp_path / "hf.unverified" / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".hf.export-*"))  # the staging directory is gone
    assert trident_to_hf.main(argv) == 0 and (out / "model.safetensors").is_file()


def test_reshard_temp_file_beside_save_removed_on_sigterm(trained: Path, tmp_path: Path) -> None:
    save = tmp_path / "resharded"
    argv = ["-m", "tools.checkpoint.reshard", "--load", str(trained), "--save", str(save)]
    p = subprocess.Popen(
        [sys.executable, *argv, "--tp", "1", "--pp", "1", "--no-progress"],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".resharded.full-weights-*/full.safetensors")):
        assert p.poll() is None and time.monotonic() < deadline, "no temporary file beside --save"
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err[-3000:]
    assert "interrupted (SIGTERM)" in err and "Traceback" not in err, err[-3000:]
    assert not list(tmp_path.glob(".resharded.full-weights-*"))
