"""The DeepSpeed seam: one pinned version everywhere, and an untested one refused with one line."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import deepspeed
import pytest

from megatron import deepspeed_internals as internals

ROOT = Path(__file__).resolve().parents[1]


def test_one_deepspeed_version_everywhere() -> None:
    pins = {
        "requirements.txt": re.findall(
            r"^deepspeed==([\w.]+)", (ROOT / "requirements.txt").read_text(), re.M
        ),
        "setup.py": re.findall(r'"deepspeed==([\w.]+)"', (ROOT / "setup.py").read_text()),
    }
    assert pins == {
        "requirements.txt": [internals.TESTED_DEEPSPEED],
        "setup.py": [internals.TESTED_DEEPSPEED],
    }
    assert deepspeed.__version__.split("+")[0] == internals.TESTED_DEEPSPEED
    internals.check_deepspeed_version()  # the installed one passes


def test_untested_deepspeed_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.delenv(internals.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(internals.DeepSpeedVersionError) as err:
        internals.check_deepspeed_version("0.20.0")
    message = str(err.value)
    assert "\n" not in message and isinstance(err.value, ValueError)
    assert "DeepSpeed 0.20.0 is installed" in message and "pip install deepspeed==0.19.8" in message
    assert internals.ALLOW_UNTESTED_ENV in message
    internals.check_deepspeed_version("0.19.8+cu121")  # a local build of the tested release
    monkeypatch.setenv(internals.ALLOW_UNTESTED_ENV, "1")
    internals.check_deepspeed_version("0.20.0")
    assert "continuing" in caplog.text


PRIVATE_ATTRIBUTES = {
    "_hp_mapping", "set_full_hp_param", "fp32_groups", "fp16_groups", "refresh_fp32_params",
    "_global_grad_norm", "clip_fp32_gradients", "build_shm_op", "ds_id", "ds_shape", "cur_scale",
    "_CUDA_RNG_STATE_TRACKER", "_INSTRUCTION_MAP",
}  # fmt: skip
PRIVATE_MODULES = (
    "deepspeed.runtime.utils",
    "deepspeed.runtime.zero.config",
    "deepspeed.runtime.fp16",
    "deepspeed.comm.torch",
    "deepspeed.checkpoint.ds_to_universal",
)


def _internal_uses(path: Path) -> list[str]:
    """Attribute accesses, getattr/hasattr strings and imports of DeepSpeed internals in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
            "getattr",
            "hasattr",
        ):
            names = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out += [
            f"{node.lineno}: {n}"
            for n in names
            if n in PRIVATE_ATTRIBUTES or str(n).startswith(PRIVATE_MODULES)
        ]
    return out


def test_private_attributes_are_used_only_in_the_seam(tmp_path: Path) -> None:
    """DeepSpeed's internals are touched in megatron/deepspeed_internals.py alone (and the check can fail)."""
    found = [
        f"{path.relative_to(ROOT)}:{use}"
        for path in sorted((ROOT / "megatron").rglob("*.py"))
        if path.name != "deepspeed_internals.py"
        for use in _internal_uses(path)
    ]
    assert not found, "DeepSpeed internals outside megatron/deepspeed_internals.py:\n" + "\n".join(
        found
    )
    assert _internal_uses(ROOT / "megatron" / "deepspeed_internals.py")  # the seam itself is seen
    planted = tmp_path / "x.py"
    planted.write_text(
        "from deepspeed.runtime.utils import clip_grad_norm_\nn = engine._global_grad_norm\n"
    )
    assert [u.split(": ")[1] for u in _internal_uses(planted)] == [
        "deepspeed.runtime.utils",
        "deepspeed.runtime.utils.clip_grad_norm_",
        "_global_grad_norm",
    ]
