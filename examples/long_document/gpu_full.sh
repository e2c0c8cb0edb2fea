#!/usr/bin/env bash
# The --full configuration on the lent GPU machine (no network, no matplotlib there).
#
# Here, once: python3 examples/long_document/prepare_data.py     (data/linux-doc, 24 MB, git-ignored)
#   and the KerasHub wheels for the device's Python 3.12: pip download --no-deps --only-binary=:all:
#   --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 -d .whl keras-hub==0.32.0
#   kagglehub kagglesdk   (.whl/ kept out of git through .git/info/exclude)
# There, after the stash calls, through tools/gpu.sh run (the op library built, TensorFlow's environment,
# KerasHub from .whl/; docs/development.md), e.g.
#   run(carry=[".gpu/env", ".gpu_build", "data/linux-doc", ".whl"],
#       command="bash tools/gpu.sh run bash examples/long_document/gpu_full.sh")
# A call is limited to 10 minutes: the script stops training at LD_TIME_LIMIT seconds (default 540; 420 in
# the call that also builds the library) and a second call on the still-warm machine goes on where it
# stopped (--resume).
# Packed rows against bucketed padding (issue 43), one XLA compilation per shape: append
#   --pack --jit-compile true --hub-contexts none --keras-contexts none
# to the command (arguments after the script's name reach train.py), with LD_TIME_LIMIT and --resume as above.
# Back here: python3 examples/long_document/train.py --replot --publish --out <fetched folder> draws
# the plot and replaces examples/long_document/results/gpu/ (the log stays out of git).
set -uo pipefail
cd "$(dirname "$0")/../.."
[[ -n "${TF_FLASH_LIBRARY:-}" ]] || { echo "gpu_full: run it through tools/gpu.sh run" >&2; exit 1; }
out="${OUT:-/tmp/out}"; mkdir -p "$out"
work=/tmp/long_document_full
[[ -d data/linux-doc ]] || { echo "gpu_full: carry data/linux-doc (prepare_data.py here)" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "${LD_TIME_LIMIT:-540}" python3 examples/long_document/train.py --full --in-process --resume \
  --no-save --verbose 2 --data-dir data/linux-doc --out "$work" "$@" 2>&1 \
  | grep -v -e "^WARNING: All log" -e "^I0000" -e "cuda_dnn\|cuda_blas\|cuda_fft" > "$out/long_document_full.log"
echo "gpu_full: exit ${PIPESTATUS[0]}"
tail -25 "$out/long_document_full.log"
cp "$work"/results.md "$work"/results.json "$out"/ 2>/dev/null || echo "gpu_full: no results yet"
