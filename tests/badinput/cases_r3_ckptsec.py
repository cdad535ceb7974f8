"""Bad inputs of issue 35 (reliability round 3) around checkpoints and the converters: tags that are symlinks out of
--load (7), HF shard indexes naming files outside --hf-dir (8), HF directories whose config or weights transformers
or our converter cannot use (2, 20), and a save lock that is not JSON (21).

Item 2's verification failure (exit 3, the import kept in ``<save>.unverified``) needs a full import and is a slow
test (``tests/checkpointing/test_ckpt_staged_import.py``); the flag of item 22 is tested in
``tests/checkpointing/test_ckpt_tools_errors.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.badinput.cases import TINY_FLAGS, Case

TRAIN = ("pretrain_gpt.py", *TINY_FLAGS, "--train-iters", "4")
TO_HF = ("-m", "tools.checkpoint.trident_to_hf", "--no-progress")
TO_TRIDENT = ("-m", "tools.checkpoint.hf_to_trident", "--no-progress")
TO_UNIVERSAL = ("-m", "tools.checkpoint.to_universal")
OUTSIDE = "is a symlink to"


def _tag_links_outside(tmp: Path, ws: Path) -> None:
    """``{tmp}/ck``: a ``latest`` naming ``global_step2``, a symlink to a complete checkpoint in ``{tmp}/other``."""
    shutil.copytree(ws / "ckpt" / "global_step2", tmp / "other" / "global_step2")
    (tmp / "ck").mkdir()
    (tmp / "ck" / "global_step2").symlink_to(
        tmp / "other" / "global_step2", target_is_directory=True
    )
    (tmp / "ck" / "latest").write_text("global_step2")


def _hf_copy(tmp: Path, ws: Path, **config: object) -> Path:
    hf = tmp / "hf"
    shutil.copytree(ws / "hf", hf)
    if config:
        data = json.loads((hf / "config.json").read_text())
        (hf / "config.json").write_text(json.dumps({**data, **config}))
    (tmp / "out").mkdir()
    (tmp / "out" / "notes.txt").write_text("mine")
    return hf


def _shard_outside(tmp: Path, ws: Path) -> None:
    """A sharded HF directory whose index names its one shard as ``../outside/...``."""
    hf = _hf_copy(tmp, ws)
    (tmp / "outside").mkdir()
    (hf / "model.safetensors").rename(tmp / "outside" / "model-00001-of-00001.safetensors")
    weight_map = {"transformer.wte.weight": "../outside/model-00001-of-00001.safetensors"}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _epsilon_int(tmp: Path, ws: Path) -> None:
    _hf_copy(tmp, ws, layer_norm_epsilon=-1)  # transformers 5 refuses an int where it wants a float


def _no_positions(tmp: Path, ws: Path) -> None:
    _hf_copy(tmp, ws, n_positions=0)


def _text_bin(tmp: Path, ws: Path) -> None:
    hf = _hf_copy(tmp, ws)
    (hf / "model.safetensors").unlink()
    (hf / "pytorch_model.bin").write_text("these are not weights\n")


def _lock_not_json(tmp: Path, ws: Path) -> None:
    (tmp / "ck").mkdir()
    (tmp / "ck" / ".trident_save.lock").write_bytes(b"\xff\xfe\x00garbage")


UNCHANGED_OUT = ("{tmp}/out", "{tmp}/out.unverified", "{tmp}/hf")

CASES: list[Case] = [
    # ------------------------------------------------------------------ (7) a tag that is a symlink out of --load
    Case(
        "r3-train-tag-symlink-outside-load", (*TRAIN, "--load", "{tmp}/ck"), 2,
        "{tmp}/ck/global_step2 is a symlink to {tmp}/other/global_step2, outside the checkpoint directory",
        unchanged=("{tmp}/ck", "{tmp}/other"), needs=("ckpt",), setup=_tag_links_outside,
    ),
    Case(
        "r3-trident-to-hf-tag-symlink-outside-load",
        (*TO_HF, "--load", "{tmp}/ck", "--tag", "global_step2", "--out", "{tmp}/hf"), 2,
        f"--tag: tag 'global_step2': {{tmp}}/ck/global_step2 {OUTSIDE}",
        unchanged=("{tmp}/ck", "{tmp}/other", "{tmp}/hf"), needs=("ckpt",), setup=_tag_links_outside,
    ),
    Case(
        "r3-to-universal-tag-symlink-outside-load", (*TO_UNIVERSAL, "--load", "{tmp}/ck"), 2,
        f"{{tmp}}/ck/latest: tag 'global_step2': {{tmp}}/ck/global_step2 {OUTSIDE}",
        unchanged=("{tmp}/ck", "{tmp}/other"), needs=("ckpt",), setup=_tag_links_outside,
    ),
    # ------------------------------------------------------------------ (8) a shard index pointing outside --hf-dir
    Case(
        "r3-hf-to-trident-shard-outside-hf-dir", (*TO_TRIDENT, "--hf-dir", "{tmp}/hf", "--save", "{tmp}/out"), 2,
        "{tmp}/hf/model.safetensors.index.json: weight_map entry 'transformer.wte.weight': "
        "'../outside/model-00001-of-00001.safetensors' is not a file name inside {tmp}/hf",
        unchanged=UNCHANGED_OUT, needs=("hf",), setup=_shard_outside,
    ),
    # ------------------------------------------------------------------ (2) transformers cannot load the source
    Case(
        "r3-hf-to-trident-transformers-refuses-config",
        (*TO_TRIDENT, "--hf-dir", "{tmp}/hf", "--save", "{tmp}/out"), 2,
        "transformers cannot load config.json of {tmp}/hf", unchanged=UNCHANGED_OUT, needs=("hf",),
        setup=_epsilon_int,
    ),
    # ------------------------------------------------------------------ (20) config and weights our side refuses
    Case(
        "r3-hf-to-trident-n-positions-zero", (*TO_TRIDENT, "--hf-dir", "{tmp}/hf", "--save", "{tmp}/out"), 2,
        "{tmp}/hf: the GPT-2 config.json has n_positions: 0; it must be a whole number >= 1",
        unchanged=UNCHANGED_OUT, needs=("hf",), setup=_no_positions,
    ),
    Case(
        "r3-hf-to-trident-text-as-pytorch-model-bin",
        (*TO_TRIDENT, "--hf-dir", "{tmp}/hf", "--save", "{tmp}/out"), 2,
        "{tmp}/hf/pytorch_model.bin is not a readable PyTorch weights file",
        unchanged=UNCHANGED_OUT, needs=("hf",), setup=_text_bin,
    ),
    # ------------------------------------------------------------------ (21) a save lock that is not JSON
    Case(
        "r3-save-lock-not-json", (*TRAIN, "--save", "{tmp}/ck"), 2,
        "{tmp}/ck/.trident_save.lock is not a Trident save lock (byte 0 is not UTF-8 text)",
        unchanged=("{tmp}/ck",), setup=_lock_not_json,
    ),
]  # fmt: skip
