"""The checkpoint side of ``--use-checkpoint-args``: ``read_checkpoint_model`` finds the tag a load would use and
returns its meta's model record, or one line saying why there is none; ``write_model_args`` writes
``model_args.sh``, whose ``MODEL_ARGS`` (expanded by bash) parse back to the checkpoint's model. The converters write
it (checked on real conversions in ``tests/training/test_continue_pretraining_example.py``)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from megatron.checkpointing.meta import META_FILE
from megatron.checkpointing.model_args import (
    MODEL_ARGS_FILE,
    read_checkpoint_model,
    write_model_args,
)
from megatron.config import ModelConfig, parse_args
from tools import plan_memory

MODEL = ModelConfig(
    num_layers=3, hidden_size=40, num_attention_heads=6, num_key_value_heads=2, kv_channels=12,
    normalization="rmsnorm", swiglu=True, use_rotary_position_embeddings=True, add_position_embedding=False,
    add_bias_linear=False, add_qkv_bias=True, qk_layernorm=True, window_size=(4, 0), use_rope_scaling=True,
    rope_scaling_factor=32.0, rope_scaling_original_max_position_embeddings=1024,
    max_position_embeddings=4096, vocab_size=101,
)  # fmt: skip


def _checkpoint(
    root: Path, tag: str = "global_step0", model: object = MODEL, pointer: str = "latest"
) -> Path:
    (root / tag).mkdir(parents=True)
    meta: dict[str, object] = {"version": 1, "iteration": 0, "converted_from": "hf dir 'x y'"}
    if model is not None:
        meta["model"] = dataclasses.asdict(model) if isinstance(model, ModelConfig) else model
    (root / tag / META_FILE).write_text(json.dumps(meta))
    (root / pointer).write_text(tag)
    return root


def test_reads_the_model_record_of_the_tag_a_load_uses(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ck")
    _checkpoint(root, "global_step7", ModelConfig(num_layers=5), pointer="latest_universal")
    got = read_checkpoint_model(str(root), None, False)
    assert got.model == json.loads(json.dumps(dataclasses.asdict(MODEL)))
    assert got.source == str(root / "global_step0" / META_FILE)
    assert read_checkpoint_model(str(root), None, True).model["num_layers"] == 5
    assert read_checkpoint_model(str(root), "global_step7", False).model["num_layers"] == 5


def _model_args(path: Path) -> list[str]:
    """``MODEL_ARGS`` of a ``model_args.sh``, expanded by bash as a launch script would."""
    out = subprocess.run(
        ["bash", "-c", 'source "$0" && printf "%s\\0" "${MODEL_ARGS[@]}"', str(path)],
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout.decode()
    return out.split("\0")[:-1]


def test_model_args_sh_parses_back_to_the_checkpoints_model(tmp_path: Path) -> None:
    root = _checkpoint(tmp_path / "ck dir")
    path = write_model_args(root)
    assert path == root / MODEL_ARGS_FILE
    text = path.read_text()
    assert "global_step0, converted from hf dir 'x y'" in text and "--window-size 4,0" in text
    got = parse_args([*_model_args(path), "--seq-length", str(MODEL.seq_length)]).model
    assert dataclasses.replace(got, vocab_size=MODEL.vocab_size) == MODEL
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        write_model_args(tmp_path)


def test_plan_memory_plans_the_checkpoints_model(tmp_path: Path, capsys) -> None:
    """tools/plan_memory.py --use-checkpoint-args plans the model model_args.sh spells out, not the defaults."""
    root = _checkpoint(tmp_path / "ck")
    run = ["--world-size", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "101"]
    run += ["--micro-batch-size", "1", "--train-iters", "10", "--seq-length", "128"]
    assert plan_memory.main(["--use-checkpoint-args", "--load", str(root), *run]) == 0
    taken = capsys.readouterr().out
    assert plan_memory.main([*_model_args(write_model_args(root)), *run]) == 0
    assert capsys.readouterr().out == taken
    assert plan_memory.main(run) == 0
    assert capsys.readouterr().out != taken
    assert plan_memory.main(["--use-checkpoint-args", "--load", str(root), *run, "--swiglu"]) == 0
    assert (
        plan_memory.main(["--use-checkpoint-args", "--load", str(root), *run, "--num-layers", "2"])
        == 2
    )
    assert "--num-layers 2 (checkpoint: 3) disagrees" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        (None, ("missing", None, False), r"--load .*missing is not a directory"),
        ("empty", ("", None, False), r"holds no checkpoint \(no 'latest'\), so there is no model to take"),
        ("no-model", ("", None, False), r'trident_meta.json has no "model" record'),
        ("damaged", ("", None, False), r"trident_meta.json is not valid JSON"),
        ("ok", ("", "global_step9", False), r"--use-checkpoint-args: --load-tag global_step9: .* not a complete"),
        ("ok", ("", None, True), r"--use-checkpoint-args: --universal-checkpoint: .* has no latest_universal"),
    ],
)  # fmt: skip
def test_no_model_to_take_is_one_line(
    tmp_path: Path, setup: str | None, args: tuple, message: str
) -> None:
    root = tmp_path / "ck"
    if setup == "empty":
        root.mkdir()
    elif setup == "no-model":
        _checkpoint(root, model=None)
    elif setup == "damaged":
        _checkpoint(root)
        (root / "global_step0" / META_FILE).write_text("{not json")
    elif setup == "ok":
        _checkpoint(root)
    load = str(tmp_path / args[0]) if args[0] else str(root)
    with pytest.raises(ValueError, match=message) as err:
        read_checkpoint_model(load, *args[1:])
    assert "\n" not in str(err.value)
