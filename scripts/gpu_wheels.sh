#!/usr/bin/env bash
# Before a session's device check: put into .whl/ (git-ignored) exactly what scripts/gpu_check.sh carries to the GPU
# image (Python 3.12, torch with CUDA, no DeepSpeed): DeepSpeed (built here from its pure-Python sdist, no ops) and,
# at the versions this venv runs, every distribution that DeepSpeed, pytest and pytest-timeout need, torch and its
# own needs excepted (the closure of their requirements, read from this venv's metadata). On the GPU machine the
# check's first step installs only the ones the image lacks, into a target folder on PYTHONPATH (never into the
# image's environment). Then the device tool's `run`, carrying .whl:
#
#   OUT="$OUT" bash scripts/gpu_check.sh       # $OUT comes back: summary.txt, logs.tar (+ the running step's log)
#
#   bash scripts/gpu_wheels.sh          # needs PyPI (run it here, not there); prints the wheels and their size
#   bash scripts/gpu_wheels.sh --list   # only print the distributions it would fetch (no network)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
ROOTS="deepspeed pytest pytest-timeout"
# name==version per line: the requirement closure of ROOTS for Python 3.12 on Linux, without torch (the image's)
pins="$("$PY" - $ROOTS <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, distribution
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

env = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
seen, todo = {}, [canonicalize_name(n) for n in sys.argv[1:]]
while todo:
    name = todo.pop()
    if name in seen or name == "torch" or name.startswith("nvidia-"):
        continue
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        sys.exit(f"gpu_wheels: {name} is not installed in this venv (scripts/setup_env.sh installs it)")
    seen[name] = dist.version
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(env):
            todo.append(canonicalize_name(req.name))
for name in sorted(seen):
    print(f"{name}=={seen[name]}")
EOF
)"
if [[ "${1:-}" == --list ]]; then
  echo "$pins"
  exit 0
fi
rm -rf .whl && mkdir -p .whl
quiet() { grep -v 'is ignored' || true; }  # pip's configured mirrors print one such line per package
ds_pin="$(grep '^deepspeed==' <<<"$pins")"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$ds_pin" 2>&1 | quiet
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64; do
  platforms+=(--platform "$p")
done
mapfile -t others < <(grep -v '^deepspeed==' <<<"$pins")
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${others[@]}" 2>&1 | quiet
ls -l .whl
size_mb=$(($(du -sk .whl | cut -f1) / 1024))
echo "gpu_wheels: $(ls .whl | wc -l) wheels, ${size_mb} MiB in .whl (the device tool carries 64 MiB in all)"
if ((size_mb > 60)); then
  echo "gpu_wheels: .whl is over 60 MiB: the device tool may refuse to carry it" >&2
  exit 1
fi
