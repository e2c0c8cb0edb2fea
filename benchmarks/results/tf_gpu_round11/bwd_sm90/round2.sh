#!/usr/bin/env bash
# Round 11, second harness round: the Hopper backward's dropout path, three trees in one run:
#   c7898 (the first dropout version: draws after S, bits assembled one by one), noahead (cheaper bit
#   assembly, draws during the tile's own S and dP GEMMs), ahead (this tree: draws one tile ahead).
#   round2.sh build | bench
set -uo pipefail
root="$(cd "$(dirname "$0")/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
trees="c7898 noahead ahead"
src_of() { [ $1 = ahead ] && echo "$root" || echo "$root/.r11/$1"; }
case "${1:?build or bench}" in
  build)
    start=$(date +%s)
    (ARCHS=90a tests/cuda_harness/device_round.sh bwd_build > "$OUT/full_build.txt" 2>&1) &
    for t in $trees; do
      (NVCC_ARCHS=90a EXTRA_FLAGS=-DTF_FLASH_CUDA_REDUCED BWD_BUILD=/tmp/r2_$t JOBS=6 BUILD_ONLY=1 \
         "$(src_of $t)/tests/cuda_harness/run_bwd_harness.sh" > "$OUT/build_$t.txt" 2>&1 || echo "build of $t failed") &
    done
    wait
    echo "built in $(( $(date +%s) - start ))s"; cat "$OUT/full_build.txt"
    tests/cuda_harness/device_round.sh bwd_test
    grep -E "dropout" "$OUT/bwd_test.log" | grep -E " sm90$" | head -30 ;;
  bench)
    for round in 1 2; do
      order="$trees"; [ $round = 2 ] && order="ahead noahead c7898"
      for t in $order; do
        for cfg in "128 4 4096 16 0 0.1" "128 4 4096 16 1 0.1" "64 16 1024 12 0 0.1" "64 4 4096 12 0 0.1" "64 16 1024 12 0 0"; do
          echo "r$round $t $cfg: $(/tmp/r2_$t/bwd_harness bench1 bf16 $cfg 20 2>&1 | tail -1)"
        done
      done
    done
    for cfg in "128 4 4096 16 0 0.1" "128 4 4096 16 1 0.1" "64 16 1024 12 0 0.1" "64 4 4096 12 0 0.1" "64 16 1024 12 0 0"; do
      echo "sm80 $cfg: $(TF_FLASH_CUDA_FAMILY=sm80 /tmp/r2_ahead/bwd_harness bench1 bf16 $cfg 20 2>&1 | tail -1)"
    done ;;
esac
