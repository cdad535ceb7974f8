"""Issue 35 (2): an import whose verification fails never becomes loadable. The converters write into a staging
directory beside --save and move the checkpoint in (pointers last) only after verification passes; a failure keeps
it in ``<save>.unverified`` and leaves --save as it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron.conversion.rewrite import _keep_unverified, _publish, unverified_dir


def _tree(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): (p.read_text() if p.is_file() else "dir")
        for p in sorted(path.rglob("*"))
    }


def test_publish_moves_the_tag_then_the_pointers_and_keeps_other_files(tmp_path: Path) -> None:
    staging, save = tmp_path / ".save.staging-x", tmp_path / "save"
    (staging / "global_step0").mkdir(parents=True)
    (staging / "global_step0" / "trident_meta.json").write_text("{}")
    (staging / "latest").write_text("global_step0")
    (staging / "latest_checkpointed_iteration.txt").write_text("0\n")
    save.mkdir()
    (save / "notes.txt").write_text("mine")
    moved: list[str] = []
    real_replace = __import__("os").replace

    def spy(src: str | Path, dst: str | Path) -> None:
        moved.append(Path(src).name)
        real_replace(src, dst)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("megatron.conversion.rewrite.os.replace", spy)
        _publish(staging, save)
    assert moved == ["global_step0", "latest_checkpointed_iteration.txt", "latest"]
    assert _tree(save) == {
        "global_step0": "dir",
        "global_step0/trident_meta.json": "{}",
        "latest": "global_step0",
        "latest_checkpointed_iteration.txt": "0\n",
        "notes.txt": "mine",
    }


def test_a_failed_conversion_goes_beside_save_replacing_an_earlier_one(tmp_path: Path) -> None:
    save = tmp_path / "save"
    assert unverified_dir(save) == tmp_path / "save.unverified"
    unverified_dir(save).mkdir()
    (unverified_dir(save) / "stale").write_text("old")
    staging = tmp_path / ".save.staging-y"
    (staging / "global_step0").mkdir(parents=True)
    (staging / "latest").write_text("global_step0")
    assert _keep_unverified(staging, save) == tmp_path / "save.unverified"
    assert _tree(tmp_path / "save.unverified") == {"global_step0": "dir", "latest": "global_step0"}
    assert not staging.exists() and not save.exists()


@pytest.mark.slow
def test_failed_import_verification_leaves_save_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real import whose logits differ from HF's (exact-erf GeLU against our tanh GeLU, over --tolerance 0):
    exit 3, --save untouched (no tag, no 'latest'), the checkpoint kept in --save.unverified and named; the same
    import within tolerance lands in --save."""
    from ckpt_models import make_gpt2

    from tools.checkpoint import hf_to_trident

    hf = tmp_path / "hf"
    make_gpt2(activation="gelu").save_pretrained(hf)
    save = tmp_path / "save"
    save.mkdir()
    (save / "notes.txt").write_text("mine")
    argv = ["--hf-dir", str(hf), "--save", str(save), "--no-progress", "--verify-steps", "2"]
    assert hf_to_trident.main([*argv, "--tolerance", "0"]) == 3
    out = capsys.readouterr().out
    assert f"NOT written to {save}" in out and f"{save}.unverified" in out and "wrote" not in out
    assert _tree(save) == {"notes.txt": "mine"}
    kept = tmp_path / "save.unverified"
    assert (kept / "latest").read_text().strip() == "global_step0"
    assert (kept / "global_step0" / "trident_meta.json").is_file()
    assert not [
        p.name for p in tmp_path.iterdir() if p.name.startswith(".save.")
    ]  # staging removed
    assert hf_to_trident.main([*argv, "--tolerance", "1"]) == 0
    assert (save / "latest").read_text().strip() == "global_step0"
    assert (save / "global_step0" / "trident_meta.json").is_file()
    assert (save / "notes.txt").read_text() == "mine"
