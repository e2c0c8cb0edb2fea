#!/usr/bin/env bash
# Round 12, second harness round: the sm_80 forward's element masks staged ahead (attn_mask by cp.async with K,
# block-mask entries of finer blocks one tile ahead), against .baseline (git archive of the commit before):
#   round2.sh build  forward harnesses of both trees (reduced: d64/d128 for the baseline), the reduced backward
#                    harness of this tree, in parallel; the forward test of this tree
#   round2.sh bench  `feat` of both trees, order alternating; the backward with and without an attn_mask;
#                    memcheck and racecheck of the quick forward test
set -uo pipefail
root="$(cd "$(dirname "$0")/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
new=build/cuda_harness_dev base=/tmp/base_fwd
case "${1:?build or bench}" in
  build)
    start=$(date +%s)
    (ARCHS=90a VARIANTS=0 JOBS=8 tests/cuda_harness/build.sh $new > "$OUT/fwd_build.log" 2>&1 || echo "new build failed") &
    (ARCHS=90a VARIANTS=0 REDUCED=1 JOBS=4 .baseline/tests/cuda_harness/build.sh $base > "$OUT/base_build.log" 2>&1 ||
       echo "base build failed") &
    (NVCC_ARCHS=90a EXTRA_FLAGS=-DTF_FLASH_CUDA_REDUCED BWD_BUILD=/tmp/new_bwd JOBS=4 BUILD_ONLY=1 \
       tests/cuda_harness/run_bwd_harness.sh > "$OUT/bwd_build.log" 2>&1 || echo "bwd build failed") &
    wait
    echo "built in $(( $(date +%s) - start ))s"
    grep -h "spill" "$OUT/fwd_build.log" | grep "flash_fwd_kernelINS0_9FwdTraits" | grep -oE "Lb1ELb[01].*|[0-9]+ bytes spill stores" | paste - - | head -12
    timeout 240 $new/fwd_harness test > "$OUT/fwd_test.log" 2>&1; echo "fwd test rc $?"
    grep -E "FAIL|passed" "$OUT/fwd_test.log" | tail -8
    grep -E "^(mask-words|attn-mask|block-small|dropout-all|block-q64)" "$OUT/fwd_test.log" | awk '{print $1, $3, $NF, $(NF-1)}' | sort | uniq -c ;;
  bench)
    for tree in new base base new; do
      echo "== feat $tree"; timeout 150 $(eval echo \$$tree)/fwd_harness feat 2>&1 | grep -vE "^device|^feature"
    done
    for cfg in "128 2 8192 16 0" "128 2 8192 16 1" "64 16 1024 12 0"; do
      for mask in 0 1; do
        echo "bwd $cfg mask=$mask: $(env $([ $mask = 1 ] && echo BWD_BENCH_ATTN_MASK=1) /tmp/new_bwd/bwd_harness bench1 bf16 $cfg 0 20 2>&1 | tail -1)"
      done
    done
    for tool in memcheck racecheck; do
      timeout 150 compute-sanitizer --tool $tool $new/fwd_harness test quick > "$OUT/fwd_$tool.log" 2>&1
      echo "$tool: $(tail -1 "$OUT/fwd_$tool.log")"
    done ;;
esac
