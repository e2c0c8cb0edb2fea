#!/usr/bin/env bash
# Round 19 in the CUDA harness (no TensorFlow).
#   round.sh a   the Hopper backward at head dim 256 (the head dim split between the warpgroups): full build of
#                this tree, the full test, the d256 cases once more on the sm_80 family (TF_FLASH_CUDA_FAMILY=sm80),
#                benchmarks of d256 on both families (bf16, fp16), interleaved
#   round.sh b   d256: dQ's atomics as 16-byte reductions (TF_FLASH_SM90_BWD_DQ_V4=1, the d256 files rebuilt) against
#                8-byte ones (42085e4): the d256 cases on both, benchmarks interleaved, ncu of both
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
source benchmarks/results/round_lib.sh
case "${1:?a or b}" in
  b)
    start=$(date +%s)
    build_bwd build/bwd_new 16 ""
    variant_bwd build/bwd_new build/bwd_v4 "-DTF_FLASH_SM90_BWD_DQ_V4=1" "flash_bwd_bf16_hdim256.cu flash_bwd_fp16_hdim256.cu"
    echo "built in $(( $(date +%s) - start ))s"
    for kind in new v4; do
      BWD_TEST_FILTER=d256 timeout 100 build/bwd_$kind/bwd_harness test > "$OUT/test_$kind.log" 2>&1
      echo "$kind d256 cases rc $?: $(tail -n 1 "$OUT/test_$kind.log")"; grep -E "FAIL|NOT REP" "$OUT/test_$kind.log" | head -5
    done
    for r in 1 2 3; do
      for kind in new v4; do
        BWD_BENCH_DTYPE=bf16 timeout 60 build/bwd_$kind/bwd_harness bench 256 > "$OUT/bwdbench_${kind}_$r.txt" 2>&1 || echo "bench $kind failed"
      done
    done
    bwd_summary "new v4" "8-byte dQ reductions | 16-byte"
    ncu_bwd build/bwd_new/bwd_harness d256 bf16 256 4 4096 8 0
    ncu_bwd build/bwd_v4/bwd_harness d256v4 bf16 256 4 4096 8 0
    grep -E "Duration|pipe_tensor_cycles|inst_executed.sum|Issue Slots|Throughput" "$OUT"/ncu_d256*.txt
    echo "total $(( $(date +%s) - start ))s" ;;
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
