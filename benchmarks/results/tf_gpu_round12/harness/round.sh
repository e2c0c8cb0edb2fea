#!/usr/bin/env bash
# Round 12 in the CUDA harness (no TensorFlow), two device calls:
#   round.sh build  the forward harness of this tree (block masks in the Hopper forward) and, in parallel, the
#                   reduced backward harnesses of .baseline (git archive HEAD) and .r11v (HEAD + round 11's
#                   d64_query_tile_128.patch); then the forward test and the patched backward's test
#   round.sh bench  the backward A/B (compare.sh, two rounds) and the model's shape, the forward's feature
#                   costs in both families, memcheck and racecheck of the quick forward test
set -uo pipefail
root="$(cd "$(dirname "$0")/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
case "${1:?build or bench}" in
  build)
    start=$(date +%s)
    (ARCHS=90a VARIANTS=0 JOBS=8 tests/cuda_harness/build.sh build/cuda_harness_dev > "$OUT/fwd_build.log" 2>&1 ||
       echo "forward build failed") &
    (cd .r11v && BWD_ONLY=1 ROUNDS=0 tests/cuda_harness/compare.sh ../.baseline 64 > "$OUT/compare_build.txt" 2>&1) &
    wait
    echo "built in $(( $(date +%s) - start ))s"; tail -3 "$OUT/fwd_build.log"; grep -i "fail" "$OUT/compare_build.txt"
    grep -h "spill" "$OUT/fwd_build.log" | grep -c sm90
    timeout 240 build/cuda_harness_dev/fwd_harness test > "$OUT/fwd_test.log" 2>&1; echo "fwd test rc $?"
    grep -E "FAIL|passed" "$OUT/fwd_test.log" | tail -8; grep -E "^block" "$OUT/fwd_test.log" | awk '{print $1, $3, $NF, $(NF-1)}' | sort | uniq -c
    timeout 200 /tmp/cmp_new/bwd/bwd_harness test > "$OUT/bwd_test_r11v.log" 2>&1; echo "bwd test (128-row d64) rc $?"
    grep -E "FAIL|failed|passed" "$OUT/bwd_test_r11v.log" | tail -8; echo "sm90 cases: $(grep -c ' sm90$' "$OUT/bwd_test_r11v.log")" ;;
  bench)
    (cd .r11v && SKIP_BUILD=1 BWD_ONLY=1 ROUNDS=2 tests/cuda_harness/compare.sh ../.baseline 64 2>&1 | tail -12)
    for r in 1 2; do
      for tree in base new; do
        for cfg in "64 16 1024 12 0 0 20" "64 16 1024 12 0 0.1 20" "64 4 4096 12 0 0 20"; do
          echo "$tree $cfg: $(/tmp/cmp_$tree/bwd/bwd_harness bench1 bf16 $cfg 2>&1 | tail -1)"
        done
      done
    done
    for fam in default sm80; do
      echo "== feat $fam"; env $([ $fam = sm80 ] && echo TF_FLASH_CUDA_FAMILY=sm80) timeout 150 \
        build/cuda_harness_dev/fwd_harness feat 2>&1 | grep -E "plain|block"
    done
    for tool in memcheck racecheck; do
      timeout 150 compute-sanitizer --tool $tool build/cuda_harness_dev/fwd_harness test quick > "$OUT/fwd_$tool.log" 2>&1
      echo "$tool: $(tail -1 "$OUT/fwd_$tool.log")"
    done ;;
esac
