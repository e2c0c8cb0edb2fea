#!/usr/bin/env bash
# Round 26's refresh of the README's end-to-end table on the shipped kernels: benchmarks/bench_model.py (4 blocks,
# its defaults: width 768, 12 heads of 64, mixed_bfloat16, 16k tokens a batch) for one mode per device command
# (each (mode, length) compiles with XLA for about a minute), after the six stash calls:
#   bash model.sh MODE LENGTHS SECONDS   (carry .gpu/env, .gpu_build): SECONDS = bench_model's --time-limit
# The json files of the commands merge here: bench_model.py --merge A.json B.json --out STEM.
set -uo pipefail
cd "$(dirname "$0")/../../.."
root=$PWD
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
source benchmarks/results/round_lib.sh
start=$(date +%s)
with_tf
echo "library ready in $(( $(date +%s) - start ))s"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/device.txt"
timeout $(( 590 - ($(date +%s) - start) )) python3 benchmarks/bench_model.py --modes "$1" --lengths "$2" \
  --time-limit "$3" --xla-autotune-cache /tmp/xla_cache --out-dir "$OUT" 2>&1 | tail -25
echo "total $(( $(date +%s) - start ))s"
