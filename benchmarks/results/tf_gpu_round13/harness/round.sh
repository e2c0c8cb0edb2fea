#!/usr/bin/env bash
# Round 13 in the CUDA harness (no TensorFlow): attn_mask in the Hopper forward (packed_mask.h).
#   round.sh test   build the forward harness (sm_90a), run its full test (the attn_mask cases: family and
#                   result), the feature costs of both families (attn_mask rows), memcheck and racecheck of
#                   the quick test
set -uo pipefail
root="$(cd "$(dirname "$0")/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
mkdir -p /tmp/cutlass && tar -xzf .gpu_build/cutlass_include.tgz -C /tmp/cutlass && export CUTLASS_INCLUDE=/tmp/cutlass/include
case "${1:?test}" in
  test)
    start=$(date +%s)
    ARCHS=90a VARIANTS=0 JOBS=16 PTXAS_VERBOSE=1 tests/cuda_harness/build.sh build/cuda_harness_dev > "$OUT/fwd_build.log" 2>&1 ||
      { echo "forward build failed"; grep -B2 -A10 "error" "$OUT/fwd_build.log" | head -40; exit 1; }
    echo "built in $(( $(date +%s) - start ))s"
    timeout 240 build/cuda_harness_dev/fwd_harness test > "$OUT/fwd_test.log" 2>&1; echo "fwd test rc $?"
    grep -E "FAIL|passed" "$OUT/fwd_test.log" | tail -12
    grep -E "^(attn-mask|doc-|mask-|key-nan|key-mask)" "$OUT/fwd_test.log" | awk '{print $1, $(NF-1), $NF}' | sort | uniq -c
    for fam in default sm80; do
      echo "== feat $fam"; env $([ $fam = sm80 ] && echo TF_FLASH_CUDA_FAMILY=sm80) timeout 150 \
        build/cuda_harness_dev/fwd_harness feat 2>&1 | grep -E "plain|mask|dropout" | tee "$OUT/feat_$fam.txt"
    done
    for tool in memcheck racecheck; do
      timeout 100 compute-sanitizer --tool $tool build/cuda_harness_dev/fwd_harness test quick > "$OUT/fwd_$tool.log" 2>&1
      echo "$tool: $(tail -1 "$OUT/fwd_$tool.log")"
    done ;;
esac
