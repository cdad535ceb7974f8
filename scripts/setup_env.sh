#!/usr/bin/env bash
# Sourced by scripts/main.sh and scripts/test.sh: creates .venv on first use and installs everything, pinned.
#
#   TORCH_SPEC   what to install as torch, first (default "torch==2.13.0", the CPU build). GPU users who bring their
#                own torch set TORCH_SPEC="" : the venv then sees the system site-packages and torch is not installed.
#   TRIDENT_VENV where the venv lives (default <repo>/.venv)
#
# Re-installs only when requirements.txt, setup.py, csrc/ or TORCH_SPEC changed (a stamp file records them).
set -euo pipefail
TRIDENT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TRIDENT_VENV="${TRIDENT_VENV:-$TRIDENT_ROOT/.venv}"
TORCH_SPEC="${TORCH_SPEC-torch==2.13.0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

_trident_fingerprint() {
  {
    echo "torch=$TORCH_SPEC"
    cat "$TRIDENT_ROOT/requirements.txt" "$TRIDENT_ROOT/requirements-cuda12.txt" "$TRIDENT_ROOT/setup.py"
    find "$TRIDENT_ROOT/csrc" -type f -print0 2>/dev/null | sort -z | xargs -0 -r cat
  } | sha256sum | cut -d' ' -f1
}

# CUDA 12's NVRTC and runtime headers (requirements-cuda12.txt) in $TRIDENT_VENV/cuda12, for the sm_70 (V100)
# compile check. Optional: where they cannot be installed, a warning, and that test skips saying so.
_trident_install_cuda12() {
  local target="$TRIDENT_VENV/cuda12"
  rm -rf "$target"
  if ! "$TRIDENT_VENV/bin/python" -m pip install -q --no-deps --target "$target" \
    -r "$TRIDENT_ROOT/requirements-cuda12.txt" >"$TRIDENT_VENV/cuda12-install.log" 2>&1; then
    rm -rf "$target"
    echo "[setup] WARNING: CUDA 12 NVRTC not installed (see $TRIDENT_VENV/cuda12-install.log): the sm_70 compile test skips" >&2
  fi
}

_trident_install() {
  local t0=$SECONDS venv_flags=()
  [ -z "$TORCH_SPEC" ] && venv_flags+=(--system-site-packages)
  echo "[setup] creating $TRIDENT_VENV and installing dependencies (torch: ${TORCH_SPEC:-system})"
  [ -x "$TRIDENT_VENV/bin/python" ] || python3 -m venv "${venv_flags[@]}" "$TRIDENT_VENV"
  local pip=("$TRIDENT_VENV/bin/python" -m pip install -q)
  # pip's configured mirrors print one harmless "is ignored" line per package; keep the log readable.
  if [ -n "$TORCH_SPEC" ]; then "${pip[@]}" "$TORCH_SPEC" 2>&1 | { grep -v 'is ignored' || true; }; fi
  "${pip[@]}" -r "$TRIDENT_ROOT/requirements.txt" 2>&1 | { grep -v 'is ignored' || true; }
  "${pip[@]}" --no-build-isolation --no-deps -e "$TRIDENT_ROOT" 2>&1 | { grep -v 'is ignored' || true; }
  _trident_install_cuda12
  DS_ACCELERATOR=cpu "$TRIDENT_VENV/bin/python" -c "import torch, deepspeed, megatron" \
    || { echo "[setup] ERROR: the venv at $TRIDENT_VENV cannot import torch/deepspeed/megatron" >&2; return 1; }
  _trident_fingerprint >"$TRIDENT_VENV/.trident-stamp"
  echo "[setup] done in $((SECONDS - t0)) s"
}

if [ ! -f "$TRIDENT_VENV/.trident-stamp" ] || [ "$(cat "$TRIDENT_VENV/.trident-stamp")" != "$(_trident_fingerprint)" ]; then
  _trident_install
fi

export PATH="$TRIDENT_VENV/bin:$PATH"
# CPU defaults (harmless on GPU machines: DS_ACCELERATOR is only set when no CUDA device is visible).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if ! "$TRIDENT_VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
