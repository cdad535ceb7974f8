"""``benchmarks/gpu_stress.py`` on CPU (small shapes, the CPU kernels): every check of every op runs and passes,
one line each plus the JSON summary; and each check fails on a kernel that is wrong in its way (a check that could
not fail would tell nothing on the GPU)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_stress as gs
from megatron import fused_kernels as fk


def test_cpu_mode_runs_every_check_of_every_op(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # without the extension the "kernel" would be the reference itself: nothing compared
    assert fk.extension("cpu") is not None, fk.status()
    rc = gs.main(["--device", "cpu", "--json", str(tmp_path / "r.json")])
    lines = capsys.readouterr().out.splitlines()
    summary = json.loads(lines[-1])
    results = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0, summary["failed_checks"]
    # lines: a header, one per check, the JSON summary
    assert len(results) == len(gs.OPS) * len(gs.CHECKS) == len(lines) - 2
    n = len(gs.OPS)  # 4 checks pass on CPU for each op, 2 (stream, graph) are CUDA only
    assert (summary["PASS"], summary["FAIL"], summary["SKIP"]) == (4 * n, 0, 2 * n)
    skipped = {r["check"] for r in results if r["verdict"] == "SKIP"}
    assert skipped == {"stream", "graph"}  # CUDA only
    assert set(gs.OPS) == {
        "layer_norm", "rms_norm", "causal_softmax", "masked_softmax",
        "bias_gelu", "bias_swiglu", "rope", "cross_entropy",
    }  # fmt: skip


def _broken(name: str, how: str) -> gs.Op:
    op = gs.OPS[name]
    calls = []

    def forward(inputs: list[torch.Tensor], fused: bool) -> torch.Tensor:
        y = op.forward(inputs, fused)
        if not fused:
            return y
        calls.append(1)
        if how == "wrong":
            return y * 1.001
        if how == "drops_nan":
            return torch.nan_to_num(y, nan=0.0)
        return y + 1e-6 * len(calls)  # "nondeterministic": another result each call

    return dataclasses.replace(op, forward=forward)


@pytest.mark.parametrize(
    ("how", "check"),
    [
        ("wrong", "reference"),
        ("wrong", "unaligned"),
        ("drops_nan", "nan"),
        ("noisy", "determinism"),
    ],
)
def test_each_check_fails_on_a_kernel_broken_its_way(how: str, check: str) -> None:
    st = gs.Setting(torch.device("cpu"), torch.float32, "small")
    assert gs.run_check(check, gs.OPS["rms_norm"], st)[0] == "PASS"
    verdict, detail = gs.run_check(check, _broken("rms_norm", how), st)
    assert verdict == "FAIL", detail


def test_a_crashing_check_is_a_fail_and_bad_flags_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def crash(inputs: list[torch.Tensor], fused: bool) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    op = dataclasses.replace(gs.OPS["rope"], forward=crash)
    st = gs.Setting(torch.device("cpu"), torch.float32, "small")
    assert gs.run_check("reference", op, st) == (
        "FAIL",
        "RuntimeError: CUDA error: an illegal memory access was encountered",
    )
    with pytest.raises(SystemExit) as exc:
        gs.main(["--device", "cpu", "--ops", "rms_norm,nope"])
    assert exc.value.code == 2 and "--ops 'rms_norm,nope': unknown nope" in capsys.readouterr().err
