"""Bad inputs of the device check's stress script (``benchmarks/gpu_stress.py``): refused before any check runs."""

from __future__ import annotations

from tests.badinput.cases import Case

STRESS = ("-m", "benchmarks.gpu_stress", "--device", "cpu")

CASES: list[Case] = [
    Case(
        "gpu-stress-unknown-op",
        (*STRESS, "--ops", "rms_norm,nope"),
        2,
        "--ops 'rms_norm,nope': unknown nope; choose from layer_norm, rms_norm",
    ),
    Case(
        "gpu-stress-json-folder-missing",
        (*STRESS, "--json", "{tmp}/no/such/r.json"),
        2,
        "--json {tmp}/no/such/r.json: no folder {tmp}/no/such; create it",
    ),
]
