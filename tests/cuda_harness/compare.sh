#!/usr/bin/env bash
# Same-run kernel comparison of two source trees on the GPU machine: builds the forward and backward
# harnesses of BASE (a copy of an earlier tree's cc/ and tests/cuda_harness/, e.g. made here with
# `git archive REV cc tests/cuda_harness | tar -x -C .baseline`) and of this tree, all in parallel, then
# runs their benchmarks one after the other, so that clocks and neighbours are the same for both.
#
#   tests/cuda_harness/compare.sh BASE [head_dim ...]      (default head dims: 64 128)
#
# Env: ARCHS (default 90a), REDUCED=1 (only head dims 64 and 128 compiled, default 1). Logs under $OUT.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
base="$(cd "${1:?BASE tree}" && pwd)"; shift
dims="${*:-64 128}"
out="${OUT:-/tmp/out}"; mkdir -p "$out"
archs="${ARCHS:-90a}"
reduced=""; [ "${REDUCED:-1}" = 1 ] && reduced="-DTF_FLASH_CUDA_REDUCED"
start=$(date +%s)
for tree in base new; do
  src=$root; [ $tree = base ] && src=$base
  (ARCHS="$archs" REDUCED="${REDUCED:-1}" VARIANTS=0 JOBS=8 "$src/tests/cuda_harness/build.sh" "/tmp/cmp_$tree/fwd" \
     > "$out/build_fwd_$tree.log" 2>&1 || echo "compare: forward build of $tree failed (see build_fwd_$tree.log)") &
  (NVCC_ARCHS="$archs" EXTRA_FLAGS="$reduced" BWD_BUILD="/tmp/cmp_$tree/bwd" JOBS=8 BUILD_ONLY=1 \
     "$src/tests/cuda_harness/run_bwd_harness.sh" > "$out/build_bwd_$tree.log" 2>&1 ||
     echo "compare: backward build of $tree failed (see build_bwd_$tree.log)") &
done
wait
echo "compare: built in $(( $(date +%s) - start ))s"
for tree in base new; do
  echo "=== $tree forward"; /tmp/cmp_$tree/fwd/fwd_harness bench $dims 2>&1 | tee "$out/bench_fwd_$tree.log" | grep -E "bf16" | head -40
  echo "=== $tree backward"; /tmp/cmp_$tree/bwd/bwd_harness bench $dims 2>&1 | tee "$out/bench_bwd_$tree.log" | grep -E "bf16" | head -40
done
