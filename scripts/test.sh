#!/usr/bin/env bash
# README command 2: install (first time) and run the whole default test suite: style checks (ruff, ruff format,
# mypy, codespell, clang-format), the documentation build (mkdocs --strict: broken links fail it), then pytest.
#   bash scripts/test.sh                 # default suite (excludes -m slow)
#   bash scripts/test.sh -m slow         # extra pytest arguments are passed through
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
cd "$TRIDENT_ROOT"
t0=$SECONDS
echo "[test] ruff check"
ruff check .
echo "[test] ruff format --check"
ruff format --check .
echo "[test] mypy (megatron/config, mpu, model, layout)"
mypy
echo "[test] codespell"
codespell
echo "[test] mkdocs build --strict"
site_dir="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$site_dir"
rm -rf "$site_dir"
echo "[test] clang-format --dry-run (csrc)"
find csrc \( -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' \) -print0 | xargs -0 -r clang-format --dry-run --Werror
echo "[test] pytest"
python -m pytest "$@"
echo "[test] finished in $((SECONDS - t0)) s"
