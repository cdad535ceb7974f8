"""The Python parts of ``scripts/gpu_check.sh``: the carried wheels, the environment, the JIT build, and the one
``KEY:`` line each step ends with (the number its verdict line shows).

    python scripts/gpu_check_steps.py wheels .whl TARGET      # install the carried wheels the image lacks
    python scripts/gpu_check_steps.py env ENV_FILE            # versions, device, imports; KEY=VALUE into ENV_FILE
    python scripts/gpu_check_steps.py build                   # JIT-build the CUDA extension, full errors
    python scripts/gpu_check_steps.py train METRICS.jsonl     # tokens/s, TFLOP/s, MFU (median after warm-up)
    python scripts/gpu_check_steps.py compare ON.jsonl OFF.jsonl [--bound B]   # kernels on vs off losses
    python scripts/gpu_check_steps.py fp16 METRICS.jsonl      # the dynamic loss scale and a finite loss
    python scripts/gpu_check_steps.py bench KERNELS.json      # kernel vs reference speed per op

Each command prints ``KEY: ...`` last and exits 1 when what it summarizes is a failure. The summaries read files
only (standard library: no torch import), so the dry run and the tests run them on CPU.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path

WARMUP_ITERS = 5
"""Iterations left out of the throughput medians (allocator warm-up, first-use kernel loading)."""
LOSS_BOUND = 0.05
"""Largest |loss(kernels on) - loss(kernels off)| over the LLaMA-style run's iterations that passes: bf16 rounds
each op's output to 8 mantissa bits (relative 4e-3) and the two paths round in different places; 20 steps of Adam
carry such differences into the weights, ~1e-2 on a loss of ~10 in practice."""


def key(text: str) -> None:
    print(f"KEY: {text}", flush=True)


def _records(path: Path) -> list[dict]:
    """The training records of a metrics JSONL (one per logged iteration)."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            if "lm_loss" in row:
                rows.append(row)
    return rows


def train_summary(path: Path) -> tuple[bool, str]:
    rows = _records(path)
    if not rows:
        return False, f"no training records in {path.name}"
    tail = [r for r in rows if r["iteration"] > WARMUP_ITERS] or rows
    tps = statistics.median(r["tokens_per_sec"] for r in tail)
    tflops = statistics.median(r["tflops_per_device"] for r in tail)
    mfus = [r["mfu"] for r in tail if r.get("mfu") is not None]
    mfu = f"{statistics.median(mfus):.3f}" if mfus else "n/a (no peak known: --peak-tflops)"
    last = rows[-1]["lm_loss"]
    ok = math.isfinite(last)
    return ok, f"tokens/s {tps:.0f}, TFLOP/s {tflops:.1f}, MFU {mfu}, last loss {last:.4f}"


def compare_losses(on: Path, off: Path, bound: float) -> tuple[bool, str]:
    a = {r["iteration"]: r["lm_loss"] for r in _records(on)}
    b = {r["iteration"]: r["lm_loss"] for r in _records(off)}
    common = sorted(set(a) & set(b))
    if not common:
        return False, f"no common iterations ({on.name}: {len(a)}, {off.name}: {len(b)})"
    if not all(math.isfinite(a[i]) and math.isfinite(b[i]) for i in common):
        return False, "a loss is not finite"
    diffs = [abs(a[i] - b[i]) for i in common]
    worst = max(range(len(common)), key=lambda k: diffs[k])
    text = (
        f"max |loss on - off| {diffs[worst]:.2e} at iteration {common[worst]} (bound {bound:.0e}) over "
        f"{len(common)} iterations; last on {a[common[-1]]:.4f}, off {b[common[-1]]:.4f}"
    )
    return diffs[worst] <= bound, text


def fp16_summary(path: Path) -> tuple[bool, str]:
    rows = _records(path)
    if not rows:
        return False, f"no training records in {path.name}"
    skipped = sum(r.get("skipped_iter", 0) for r in rows)
    stepped = [r for r in rows if not r.get("skipped_iter", 0)]
    first, last = rows[0].get("loss_scale"), rows[-1].get("loss_scale")
    final = stepped[-1]["lm_loss"] if stepped else math.nan
    ok = bool(stepped) and math.isfinite(final)
    return ok, (
        f"loss scale {first:g} -> {last:g}, {skipped} of {len(rows)} iterations skipped, "
        f"last stepped loss {final:.4f}" + ("" if ok else " (NOT finite or no step taken)")
    )


def bench_summary(path: Path) -> tuple[bool, str]:
    rows = json.loads(path.read_text(encoding="utf-8"))
    if not rows:
        return False, "no benchmark rows"
    parts = [f"{r['op']} {r['speedup']:.2f}x" for r in rows]
    slowest = min(rows, key=lambda r: r["speedup"])
    return True, f"kernel/reference speed-up: {', '.join(parts)} (slowest {slowest['op']})"


def _wheel_dist(path: Path) -> str:
    """``pydantic_core-2.41.5-cp312-...whl`` -> ``pydantic_core``."""
    return path.name.split("-")[0]


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_wheels(
    wheels: Path, target: Path, always: tuple[str, ...] = ("deepspeed",)
) -> tuple[bool, str]:
    """Install into ``target`` (never the image's environment) every wheel whose distribution the image lacks;
    ``always``: installed even where the image has one (the pinned DeepSpeed)."""
    target.mkdir(parents=True, exist_ok=True)
    chosen, kept = [], []
    for whl in sorted(wheels.glob("*.whl")):
        have = _installed(_wheel_dist(whl))
        if have is None or _wheel_dist(whl) in always:
            chosen.append(whl)
        else:
            kept.append(f"{_wheel_dist(whl)} {have}")
    print(f"the image's own: {', '.join(kept) or 'none'}")
    print(f"installing into {target}: {', '.join(w.name for w in chosen) or 'none'}", flush=True)
    if not chosen:
        return True, f"nothing to install ({len(kept)} on the image)"
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--no-deps",
        "--target",
        str(target),
    ]
    if subprocess.run([sys.executable, "-m", "pip", "--version"], check=False).returncode == 0:
        rc = subprocess.run([*pip, *map(str, chosen)], check=False).returncode
        if rc != 0:
            return False, f"pip install --target failed (rc {rc})"
    else:  # no pip on the image: a wheel is a zip of the files site-packages would get
        for whl in chosen:
            zipfile.ZipFile(whl).extractall(target)
    return True, f"{len(chosen)} wheels into {target.name}/, {len(kept)} kept from the image"


def environment(env_file: Path) -> tuple[bool, str]:
    """Print versions, the device and what imports; write ``CUDA_OK``, ``ARCH`` for the next steps."""
    import torch

    cuda = torch.cuda.is_available()
    arch = ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else ""
    name = torch.cuda.get_device_name(0) if cuda else "no CUDA device"
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    if cuda:
        print(f"device {name}, capability {arch}, bf16 {torch.cuda.is_bf16_supported()}")
    imports = {}
    for module in (
        "deepspeed",
        "pytest",
        "pytest_timeout",
        "megatron.fused_kernels",
        "megatron.model",
    ):
        t0 = time.perf_counter()
        try:
            mod = importlib.import_module(module)
            imports[module] = getattr(mod, "__version__", "ok")
        except Exception as exc:  # noqa: BLE001 - every import failure is reported, none stops the step
            imports[module] = f"FAILED ({type(exc).__name__}: {str(exc).strip()[:200]})"
        print(f"import {module}: {imports[module]} ({time.perf_counter() - t0:.1f} s)", flush=True)
    env_file.write_text(f"CUDA_OK={int(cuda)}\nARCH={arch}\n", encoding="utf-8")
    failed = [m for m, v in imports.items() if v.startswith("FAILED")]
    text = (
        f"{name}"
        + (f" sm_{arch.replace('.', '')}" if cuda else "")
        + f", torch {torch.__version__} CUDA {torch.version.cuda}"
    )
    text += f", deepspeed {imports['deepspeed']}"[:120]
    return cuda and not failed, text + (f"; import failed: {', '.join(failed)}" if failed else "")


def build() -> tuple[bool, str]:
    """JIT-build the CUDA extension the way the loader does, printing the whole compiler output on failure (the
    loader's warning keeps one line), then check that the loader's own lookup finds the build."""
    from megatron import fused_kernels as fk
    from megatron.fused_kernels import loader

    t0 = time.perf_counter()
    jit = getattr(loader, "_jit", None)  # the loader's build path, called for its full error text
    if jit is not None:
        try:
            jit("cuda")
        except Exception as exc:  # noqa: BLE001 - the build error is the step's result
            print(f"JIT build failed after {time.perf_counter() - t0:.0f} s:\n{exc}", flush=True)
            return False, f"build failed: {str(exc).strip().splitlines()[0][:150]}"
    module = fk.extension("cuda")
    status = fk.status().get("cuda", "?")
    print(f"fused kernels (cuda): {status}")
    return module is not None, f"{time.perf_counter() - t0:.0f} s: {status[:150]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("wheels").add_argument("paths", nargs=2, type=Path)
    sub.add_parser("env").add_argument("env_file", type=Path)
    sub.add_parser("build")
    for name in ("train", "fp16", "bench"):
        sub.add_parser(name).add_argument("file", type=Path)
    cmp = sub.add_parser("compare")
    cmp.add_argument("on", type=Path)
    cmp.add_argument("off", type=Path)
    cmp.add_argument("--bound", type=float, default=LOSS_BOUND)
    a = parser.parse_args(argv)
    try:
        ok, text = {
            "wheels": lambda: install_wheels(*a.paths),
            "env": lambda: environment(a.env_file),
            "build": build,
            "train": lambda: train_summary(a.file),
            "fp16": lambda: fp16_summary(a.file),
            "bench": lambda: bench_summary(a.file),
            "compare": lambda: compare_losses(a.on, a.off, a.bound),
        }[a.cmd]()
    # a missing or malformed file: the run the step summarizes failed before writing it
    except (OSError, ValueError, KeyError) as exc:
        ok, text = False, f"{type(exc).__name__}: {exc}"[:200]
    key(text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
