#!/usr/bin/env bash
# Sets up a fresh Debian machine and installs tf_flash; safe to run again (does only what is missing).
#
#   bash scripts/install.sh
#
# 1. apt: bazel-bootstrap (Bazel 4.2.3, builds offline) and g++, when missing.
# 2. pip: the build requirements declared in setup.py (TensorFlow 2.21, CUTLASS headers, setuptools),
#    those not installed yet; an installed TensorFlow 2.21 of another flavour (tensorflow-cpu) is kept.
# 3. Bazel build of the op library (CUDA kernels too when nvcc is found and a GPU is visible), then
#    `pip install --no-build-isolation .[test,examples]` (reuses that build; the extras are setup.py's).
# Environment: PYTHON (default: $VIRTUAL_ENV/bin/python in an active virtualenv, else python3);
# TF_FLASH_EXTRAS (default "test,examples"; "" for none); TF_FLASH_CUDA=0/1/auto (unset: 1 only where
# a GPU is visible), TF_FLASH_CUDA_ARCHS="80;90a", TF_FLASH_CUDA_REDUCED=1, TF_FLASH_BAZEL_ARGS (see
# setup.py and bazel/cuda_configure.bzl).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" && -n "${VIRTUAL_ENV:-}" ]]; then PYTHON="$VIRTUAL_ENV/bin/python"; fi
PYTHON="${PYTHON:-python3}"
EXTRAS="${TF_FLASH_EXTRAS-test,examples}"
start=$(date +%s)
log() { echo "scripts/install.sh: $*" >&2; }

SUDO=""
if [[ "$(id -u)" != 0 ]] && command -v sudo >/dev/null; then SUDO="sudo"; fi
apt_install() {
  if ! command -v apt-get >/dev/null; then
    log "apt-get not found: install $* yourself"; return 1
  fi
  if [[ "$(id -u)" != 0 && -z "$SUDO" ]]; then
    log "need root or sudo to apt-get install $*"; return 1
  fi
  log "apt-get install $*"
  # Try without refreshing the package lists first; a fresh image usually needs `apt-get update`.
  $SUDO apt-get install -y --no-install-recommends "$@" \
    || { $SUDO apt-get update && $SUDO apt-get install -y --no-install-recommends "$@"; }
}

# ---- 1. system packages ----
command -v bazel >/dev/null || apt_install bazel-bootstrap
command -v g++ >/dev/null || apt_install g++
command -v "$PYTHON" >/dev/null || apt_install python3
"$PYTHON" -m pip --version >/dev/null 2>&1 || apt_install python3-pip

# Debian's own python3 is "externally managed" (PEP 668): outside a virtualenv, pip needs consent.
if "$PYTHON" - <<'PY'
import os, sys, sysconfig
in_venv = sys.prefix != getattr(sys, "base_prefix", sys.prefix)
marker = os.path.join(sysconfig.get_paths()["stdlib"], "EXTERNALLY-MANAGED")
sys.exit(0 if (not in_venv and os.path.exists(marker)) else 1)
PY
then
  log "$PYTHON is externally managed (Debian): pip installs with PIP_BREAK_SYSTEM_PACKAGES=1"
  export PIP_BREAK_SYSTEM_PACKAGES=1
fi

# ---- 2. Python build requirements (declared in setup.py; pip skips those already satisfied) ----
# setup.py needs setuptools to be imported at all (a bare Python 3.12+ venv has none): bootstrap it.
"$PYTHON" -c "import setuptools" 2>/dev/null || "$PYTHON" -m pip install --quiet "setuptools>=61"
wanted=$("$PYTHON" -c "import setup; print(' '.join(setup.build_requirements_to_install()))")
if [[ -n "$wanted" ]]; then
  log "pip install $wanted"
  # shellcheck disable=SC2086
  "$PYTHON" -m pip install --quiet $wanted
fi

# ---- 3. build (visible progress, says CPU-only or CUDA), then install the package ----
# The CUDA kernels take about 25 minutes to compile on 2 cores: by default they are built only where a
# GPU is visible. TF_FLASH_CUDA=1 builds them anyway (a build host without a GPU, CI's compile check).
if [[ -z "${TF_FLASH_CUDA:-}" ]] && ! { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
  log "no GPU visible: building the CPU kernels only (TF_FLASH_CUDA=1 builds the CUDA kernels too)"
  export TF_FLASH_CUDA=0
fi
log "building the op library with Bazel"
"$PYTHON" -c "import setup; setup.report_build(*setup.build_library())"
target="."
[[ -n "$EXTRAS" ]] && target=".[$EXTRAS]"
log "pip install --no-build-isolation $target"
"$PYTHON" -m pip install --quiet --no-build-isolation "$target"
log "done in $(( $(date +%s) - start ))s"
