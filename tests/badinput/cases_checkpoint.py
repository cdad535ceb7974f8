"""Bad inputs of checkpoints and the conversion tools: --load/--load-tag, ``latest``, damaged files, to_universal,
trident_to_hf, hf_to_trident, reshard and megatron_deepspeed_to_trident.

Every case fails before any rank is spawned (training cases in preflight, tools before their first read or write).
Damaged checkpoints are copies of the shared ``{ws}/ckpt`` made in the case's scratch directory by ``setup``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

from tests.badinput.cases import TINY_FLAGS, Case

TRAIN = ("pretrain_gpt.py", *TINY_FLAGS, "--train-iters", "4")
MODEL = "global_step2/mp_rank_00_model_states.pt"


def _copy_ckpt(tmp: Path, ws: Path) -> Path:
    shutil.copytree(ws / "ckpt", tmp / "ck", symlinks=True)
    return tmp / "ck"


def _flip_bytes(tmp: Path, ws: Path) -> None:
    path = _copy_ckpt(tmp, ws) / MODEL
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 2000):
        data[i] ^= 0xA5
    path.write_bytes(bytes(data))


def _truncate(tmp: Path, ws: Path) -> None:
    path = _copy_ckpt(tmp, ws) / MODEL
    path.write_bytes(path.read_bytes()[:1000])


def _garbage_meta(tmp: Path, ws: Path) -> None:
    (_copy_ckpt(tmp, ws) / "global_step2" / "trident_meta.json").write_text("{not json")


def _latest_escapes(tmp: Path, ws: Path) -> None:
    """``latest`` of a copy names a complete checkpoint in a sibling directory."""
    _copy_ckpt(tmp, ws)
    shutil.copytree(ws / "ckpt" / "global_step2", tmp / "other" / "global_step4")
    (tmp / "ck" / "latest").write_text("../other/global_step4")


def _latest_missing_tag(tmp: Path, ws: Path) -> None:
    (_copy_ckpt(tmp, ws) / "latest").write_text("global_step9")


def _fake_universal(tmp: Path, ws: Path) -> None:
    """A copy with a (meta-only) universal tag: enough for the start-up rules, which refuse before any read."""
    ck = _copy_ckpt(tmp, ws)
    meta = json.loads((ck / "global_step2" / "trident_meta.json").read_text())
    (ck / "global_step2_universal").mkdir()
    (ck / "global_step2_universal" / "trident_meta.json").write_text(
        json.dumps({**meta, "universal": True, "checksums": {}})
    )
    (ck / "latest_universal").write_text("global_step2_universal")


class _Payload:
    """Unpickling it runs ``touch {guard}/payload_ran`` (what ds_to_universal's weights_only=False would do)."""

    def __init__(self, guard: Path) -> None:
        self.guard = guard

    def __reduce__(self):
        return (os.system, (f"touch {self.guard}/payload_ran",))


def _pickled_payload(tmp: Path, ws: Path) -> None:
    tag = tmp / "evil" / "global_step2"
    tag.mkdir(parents=True)
    meta = {"iteration": 2, "zero_stage": 1, "model": {"num_layers": 2}}
    (tag / "trident_meta.json").write_text(json.dumps(meta))
    (tmp / "evil" / "latest").write_text("global_step2")
    (tmp / "guard").mkdir()
    (tmp / "guard" / "keep").write_text("x")
    payload = {"optimizer_state_dict": _Payload(tmp / "guard")}
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(pickle.dumps(payload))


def _link_to_ckpt(tmp: Path, ws: Path) -> None:
    (tmp / "link").symlink_to(ws / "ckpt", target_is_directory=True)


def _link_to_hf(tmp: Path, ws: Path) -> None:
    (tmp / "link").symlink_to(ws / "hf", target_is_directory=True)


def _a_file(tmp: Path, ws: Path) -> None:
    (tmp / "file").write_text("x")


def _non_empty(tmp: Path, ws: Path) -> None:
    (tmp / "out").mkdir()
    (tmp / "out" / "notes.txt").write_text("mine")


def _empty_dir(tmp: Path, ws: Path) -> None:
    (tmp / "mds").mkdir()


TO_HF = ("-m", "tools.checkpoint.trident_to_hf", "--no-progress")
TO_TRIDENT = ("-m", "tools.checkpoint.hf_to_trident", "--no-progress")
RESHARD = ("-m", "tools.checkpoint.reshard", "--no-progress")
TO_UNIVERSAL = ("-m", "tools.checkpoint.to_universal")
FROM_MDS = ("-m", "tools.checkpoint.megatron_deepspeed_to_trident", "--no-progress")
NOT_PLAIN = "is not a plain directory name"

CASES: list[Case] = [
    # ------------------------------------------------------------------ training: --load and its tags
    Case("ckpt-load-missing", (*TRAIN, "--load", "{tmp}/nope"), 2, "does not exist"),
    Case("ckpt-load-is-file", (*TRAIN, "--load", "{tmp}/file"), 2, "is a file", setup=_a_file),
    Case(
        "ckpt-latest-escapes-load", (*TRAIN, "--load", "{tmp}/ck", "--save", "{tmp}/ck"), 2,
        "'../other/global_step4' is not a plain directory name",
        unchanged=("{tmp}/ck", "{tmp}/other"), needs=("ckpt",), setup=_latest_escapes,
    ),
    Case(
        "ckpt-load-tag-absolute", (*TRAIN, "--load", "{ws}/ckpt", "--load-tag", "{ws}/ckpt/global_step2"),
        2, f"--load-tag: tag '{{ws}}/ckpt/global_step2' {NOT_PLAIN}", unchanged=("{ws}/ckpt",), needs=("ckpt",),
    ),
    Case(
        "ckpt-load-tag-dotdot", (*TRAIN, "--load", "{ws}/ckpt", "--load-tag", "../ckpt/global_step2"), 2,
        NOT_PLAIN, unchanged=("{ws}/ckpt",), needs=("ckpt",),
    ),
    Case(
        "ckpt-latest-names-missing-tag", (*TRAIN, "--load", "{tmp}/ck"), 2, "not a complete checkpoint",
        unchanged=("{tmp}/ck",), needs=("ckpt",), setup=_latest_missing_tag,
    ),
    # ------------------------------------------------------------------ training: damaged files
    Case(
        "ckpt-flipped-bytes-refused", (*TRAIN, "--load", "{tmp}/ck", "--save", "{tmp}/ck"), 2,
        f"{{tmp}}/ck/{MODEL} does not match its sha256 checksum",
        unchanged=("{tmp}/ck",), needs=("ckpt",), setup=_flip_bytes,
    ),
    Case(
        "ckpt-truncated-model-state", (*TRAIN, "--load", "{tmp}/ck", "--no-verify-checkpoint-checksums"), 2,
        f"{{tmp}}/ck/{MODEL} has 1000 bytes", unchanged=("{tmp}/ck",), needs=("ckpt",), setup=_truncate,
    ),
    Case(
        "ckpt-meta-not-json", (*TRAIN, "--load", "{tmp}/ck", "--save", "{tmp}/ck"), 2,
        "trident_meta.json is not valid JSON", unchanged=("{tmp}/ck",), needs=("ckpt",), setup=_garbage_meta,
    ),
    # ------------------------------------------------------------------ universal checkpoints
    Case(
        "ckpt-universal-with-zero-stage-0",
        (*TRAIN, "--load", "{tmp}/ck", "--universal-checkpoint", "--zero-stage", "0"), 2, "pass --zero-stage 1",
        unchanged=("{tmp}/ck",), needs=("ckpt",), setup=_fake_universal,
    ),
    Case(
        "ckpt-universal-not-converted", (*TRAIN, "--load", "{ws}/ckpt", "--universal-checkpoint"), 2,
        "python -m tools.checkpoint.to_universal", unchanged=("{ws}/ckpt",), needs=("ckpt",),
    ),
    Case(
        "to-universal-zero-stage-0", (*TO_UNIVERSAL, "--load", "{ws}/ckpt"), 2, "need a run saved with --zero-stage >= 1",
        unchanged=("{ws}/ckpt",), needs=("ckpt",),
    ),
    Case(
        "to-universal-pickled-payload", (*TO_UNIVERSAL, "--load", "{tmp}/evil"), 2, "to_universal refuses it",
        unchanged=("{tmp}/guard", "{tmp}/evil"), setup=_pickled_payload,
    ),
    Case(
        "to-universal-tag-escapes", (*TO_UNIVERSAL, "--load", "{ws}/ckpt", "--tag", "../ckpt/global_step2"), 2,
        f"--tag: tag '../ckpt/global_step2' {NOT_PLAIN}", unchanged=("{ws}/ckpt",), needs=("ckpt",),
    ),
    # ------------------------------------------------------------------ trident_to_hf
    Case(
        "trident-to-hf-no-checkpoint", (*TO_HF, "--load", "{tmp}/mds", "--out", "{tmp}/hf"), 2,
        "holds no Trident checkpoint", setup=_empty_dir,
    ),
    Case(
        "trident-to-hf-out-inside-load-via-symlink", (*TO_HF, "--load", "{ws}/ckpt", "--out", "{tmp}/link/hf"), 2,
        "is inside the --load directory", unchanged=("{ws}/ckpt",), needs=("ckpt",), setup=_link_to_ckpt,
    ),
    Case(
        "trident-to-hf-out-is-file", (*TO_HF, "--load", "{ws}/ckpt", "--out", "{tmp}/file"), 2, "is a file",
        unchanged=("{tmp}/file",), needs=("ckpt",), setup=_a_file,
    ),
    Case(
        "trident-to-hf-out-not-empty", (*TO_HF, "--load", "{ws}/ckpt", "--out", "{tmp}/out"), 2, "--overwrite",
        unchanged=("{tmp}/out",), needs=("ckpt",), setup=_non_empty,
    ),
    Case(
        "trident-to-hf-tag-escapes", (*TO_HF, "--load", "{ws}/ckpt", "--tag", "/etc", "--out", "{tmp}/hf"), 2,
        NOT_PLAIN, needs=("ckpt",),
    ),
    Case(
        "trident-to-hf-merge-lora-without-adapters",
        (*TO_HF, "--load", "{ws}/ckpt", "--out", "{tmp}/hf", "--merge-lora"), 2, "holds no LoRA adapters",
        unchanged=("{ws}/ckpt",), needs=("ckpt",),
    ),
    # ------------------------------------------------------------------ hf_to_trident
    Case(
        "hf-to-trident-missing-dir", (*TO_TRIDENT, "--hf-dir", "{tmp}/nope", "--save", "{tmp}/ck"), 2,
        "does not exist",
    ),
    Case(
        "hf-to-trident-save-inside-hf-dir-via-symlink",
        (*TO_TRIDENT, "--hf-dir", "{ws}/hf", "--save", "{tmp}/link/ck"), 2, "is inside the --hf-dir directory",
        unchanged=("{ws}/hf",), needs=("hf",), setup=_link_to_hf,
    ),
    Case(
        "hf-to-trident-save-holds-checkpoints", (*TO_TRIDENT, "--hf-dir", "{ws}/hf", "--save", "{ws}/ckpt"), 2,
        "already holds checkpoints", unchanged=("{ws}/ckpt",), needs=("hf",),
    ),
    # ------------------------------------------------------------------ reshard
    Case(
        "reshard-tag-escapes",
        (*RESHARD, "--load", "{ws}/ckpt", "--tag", "../ckpt/global_step2", "--save", "{tmp}/out", "--tp", "1",
         "--pp", "1"),
        2, f"--tag: tag '../ckpt/global_step2' {NOT_PLAIN}", needs=("ckpt",),
    ),
    Case(
        "reshard-save-is-load-via-symlink",
        (*RESHARD, "--load", "{ws}/ckpt", "--save", "{tmp}/link", "--tp", "1", "--pp", "1"), 2,
        "is the --load directory", unchanged=("{ws}/ckpt",), needs=("ckpt",), setup=_link_to_ckpt,
    ),
    Case(
        "reshard-tp-does-not-divide-heads",
        (*RESHARD, "--load", "{ws}/ckpt", "--save", "{tmp}/out", "--tp", "3", "--pp", "1"), 2, "--tp",
        needs=("ckpt",),
    ),
    Case("reshard-missing-tp", (*RESHARD, "--load", "{ws}/ckpt", "--save", "{tmp}/out", "--pp", "1"), 2, "--tp"),
    # ------------------------------------------------------------------ megatron_deepspeed_to_trident
    Case(
        "mds-to-trident-no-latest", (*FROM_MDS, "--load", "{tmp}/mds", "--save", "{tmp}/out"), 2,
        "has no 'latest'", setup=_empty_dir,
    ),
    Case(
        "mds-to-trident-tag-escapes", (*FROM_MDS, "--load", "{tmp}/mds", "--tag", "../x", "--save", "{tmp}/out"),
        2, NOT_PLAIN, setup=_empty_dir,
    ),
]  # fmt: skip
