#!/usr/bin/env bash
# Before a session's GPU check: put into .whl/ (git-ignored) the wheels the GPU image lacks, for its Python 3.12:
# DeepSpeed (built here from its pure-Python sdist, no ops) and its needs that are not on the image (hjson,
# pydantic and its parts). Then, on the GPU machine (the device tool's `run`, carrying .whl; its $OUT takes at most
# 8 files back, so the logs travel as one archive):
#
#   OUT=/tmp/g WHEELS=.whl bash scripts/gpu_check.sh; tar czf "$OUT/gpu.tgz" -C /tmp/g .
#
# Needs network access to PyPI (run it here, not there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
DS_VERSION="$(sed -n 's/^deepspeed==\([0-9.]*\).*/\1/p' requirements.txt)"
rm -rf .whl && mkdir -p .whl
quiet() { grep -v 'is ignored' || true; }  # pip's configured mirrors print one such line per package
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==${DS_VERSION:?}" 2>&1 | quiet
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64; do
  platforms+=(--platform "$p")
done
# the versions this venv runs (pydantic pins its pydantic-core exactly)
pins=()
for name in hjson pydantic pydantic-core annotated-types typing-inspection; do
  version="$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')"
  pins+=("$name${version:+==$version}")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${pins[@]}" 2>&1 | quiet
ls -l .whl
