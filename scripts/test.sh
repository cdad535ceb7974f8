#!/usr/bin/env bash
# README command 2: install (first time) and run the whole default test suite: style checks, then pytest.
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
echo "[test] pytest"
python -m pytest "$@"
echo "[test] finished in $((SECONDS - t0)) s"
