#!/usr/bin/env bash
# Round 19 in the CUDA harness (no TensorFlow).
#   round.sh a   the Hopper backward at head dim 256 (the head dim split between the warpgroups): full build of
#                this tree, the full test, the d256 cases once more on the sm_80 family (TF_FLASH_CUDA_FAMILY=sm80),
#                benchmarks of d256 on both families (bf16, fp16), interleaved
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
source benchmarks/results/round_lib.sh
case "${1:?a}" in
  a)
    start=$(date +%s)
    build_bwd build/bwd_new 16 ""
    echo "built in $(( $(date +%s) - start ))s"
    grep -h "bwd_dkdv" -A2 "$OUT/bwd_new_build.log" | grep -E "spill" | sort | uniq -c
    timeout 240 build/bwd_new/bwd_harness test > "$OUT/bwd_test.log" 2>&1; echo "backward test rc $?: $(tail -n 1 "$OUT/bwd_test.log")"
    grep -E "FAIL|NOT REP" "$OUT/bwd_test.log" | head -20
    grep -E "d256|d=256" "$OUT/bwd_test.log" | awk '{print $NF}' | sort | uniq -c
    TF_FLASH_CUDA_FAMILY=sm80 BWD_TEST_FILTER=d256 timeout 120 build/bwd_new/bwd_harness test > "$OUT/bwd_test_sm80_d256.log" 2>&1
    echo "sm80 family, d256 cases: rc $?: $(tail -n 1 "$OUT/bwd_test_sm80_d256.log")"; grep -E "FAIL" "$OUT/bwd_test_sm80_d256.log" | head -5
    for r in 1 2; do
      for dt in bf16 fp16; do  # runs 1, 2: bf16; 3, 4: fp16 (the summary keys on the dtype)
        n=$([ $dt = bf16 ] && echo $r || echo $((r + 2)))
        BWD_BENCH_DTYPE=$dt timeout 90 build/bwd_new/bwd_harness bench 256 > "$OUT/bwdbench_sm90_$n.txt" 2>&1 || echo "bench $dt failed"
        TF_FLASH_CUDA_FAMILY=sm80 BWD_BENCH_DTYPE=$dt timeout 90 build/bwd_new/bwd_harness bench 256 > "$OUT/bwdbench_sm80_$n.txt" 2>&1 ||
          echo "bench80 $dt failed"
      done
    done
    bwd_summary "sm80 sm90" "d256: sm_80 family | Hopper family"
    echo "total $(( $(date +%s) - start ))s" ;;
esac
