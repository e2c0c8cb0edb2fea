#!/usr/bin/env bash
# Sets up a fresh Debian machine and installs tf_flash; safe to run again (does only what is missing).
#
#   bash scripts/install.sh
#
# 1. apt: bazel-bootstrap (Bazel 4.2.3, builds offline) and g++, when missing.
# 2. pip: tensorflow==2.21.*, nvidia-cutlass==4.2.0.0 (CUTLASS/CuTe headers), pytest, when missing.
# 3. Bazel build of the op library (CUDA kernels too when nvcc is found), then
#    `pip install --no-build-isolation .` (reuses that build).
# Environment: PYTHON (default python3); TF_FLASH_CUDA=0/1/auto (unset: 1 only where a GPU is visible),
# TF_FLASH_CUDA_ARCHS="80;90a",
# TF_FLASH_CUDA_REDUCED=1, TF_FLASH_BAZEL_ARGS (see setup.py and bazel/cuda_configure.bzl).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
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

# ---- 2. Python packages (only those missing or at another version) ----
missing=$("$PYTHON" - <<'PY'
from importlib import metadata
wanted = [("tensorflow", "tensorflow==2.21.*", lambda v: v.startswith("2.21.")),
          ("nvidia-cutlass", "nvidia-cutlass==4.2.0.0", lambda v: v == "4.2.0.0"),
          ("pytest", "pytest", lambda v: True),
          ("setuptools", "setuptools>=61", lambda v: int(v.split(".")[0]) >= 61),
          ("wheel", "wheel", lambda v: True)]
for name, spec, ok in wanted:
    try:
        if ok(metadata.version(name)):
            continue
    except metadata.PackageNotFoundError:
        pass
    print(spec)
PY
)
if [[ -n "$missing" ]]; then
  log "pip install $(echo $missing)"
  # shellcheck disable=SC2086
  "$PYTHON" -m pip install --quiet $missing
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
log "pip install --no-build-isolation ."
"$PYTHON" -m pip install --quiet --no-build-isolation .
log "done in $(( $(date +%s) - start ))s"
