#!/usr/bin/env bash
# Round 20 in the CUDA harness (no TensorFlow), device commands back to back:
#   round.sh a   full build of this tree (bwd_dq_splits counts the kernels' own key tiles: 64 at d256); d256: dQ's
#                atomics as 16-byte reductions (TF_FLASH_SM90_BWD_DQ_V4=1, the d256 files rebuilt) against 8-byte
#                ones; the d256 cases on both (and on the sm_80 family), benchmarks interleaved
#   round.sh b [new|v4]  compute-sanitizer (memcheck, racecheck) on d256 cases of the Hopper backward
#   round.sh c   ncu of both variants (b4 s4k h8 d256 bf16)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
source benchmarks/results/round_lib.sh
case "${1:?a or b}" in
  a)
    start=$(date +%s)
    build_bwd build/bwd_new 16 ""
    variant_bwd build/bwd_new build/bwd_v4 "-DTF_FLASH_SM90_BWD_DQ_V4=1" "flash_bwd_bf16_hdim256.cu flash_bwd_fp16_hdim256.cu"
    echo "built in $(( $(date +%s) - start ))s"
    grep -h "bwd_dkdv" -A2 "$OUT"/bwd_v4_build.log | grep -E "spill" | sort | uniq -c
    for kind in new v4; do
      BWD_TEST_FILTER=d256 timeout 100 build/bwd_$kind/bwd_harness test > "$OUT/test_$kind.log" 2>&1
      echo "$kind d256 cases rc $?: $(tail -n 1 "$OUT/test_$kind.log")"; grep -E "FAIL|NOT REP" "$OUT/test_$kind.log" | head -5
    done
    BWD_TEST_FILTER=deterministic timeout 100 build/bwd_new/bwd_harness test > "$OUT/test_new_det.log" 2>&1
    echo "new deterministic cases rc $?: $(tail -n 1 "$OUT/test_new_det.log")"
    TF_FLASH_CUDA_FAMILY=sm80 BWD_TEST_FILTER=d256 timeout 120 build/bwd_new/bwd_harness test > "$OUT/test_sm80_d256.log" 2>&1
    echo "sm80 family, d256 cases: rc $?: $(tail -n 1 "$OUT/test_sm80_d256.log")"; grep -E "FAIL" "$OUT/test_sm80_d256.log" | head -5
    for r in 1 2 3; do
      for kind in new v4; do
        BWD_BENCH_DTYPE=bf16 timeout 60 build/bwd_$kind/bwd_harness bench 256 > "$OUT/bwdbench_${kind}_$r.txt" 2>&1 || echo "bench $kind failed"
      done
    done
    bwd_summary "new v4" "8-byte dQ reductions | 16-byte"
    echo "total $(( $(date +%s) - start ))s" ;;
  b)
    start=$(date +%s)
    bin=build/bwd_${2:-new}/bwd_harness
    for filter in "d256 odd lengths causal" "d256 attn_mask causal" "d256 dropout 0.17 causal GQA" "deterministic causal d256"; do
      for tool in memcheck racecheck; do
        BWD_TEST_FILTER="$filter" timeout 65 compute-sanitizer --tool $tool $bin test > "$OUT/san_${tool}_${filter// /_}.log" 2>&1
        echo "$tool '$filter' rc $?: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/san_${tool}_${filter// /_}.log" | tail -1) | $(grep -E "cases failed" "$OUT/san_${tool}_${filter// /_}.log")"
      done
    done
    echo "total $(( $(date +%s) - start ))s" ;;
  c)
    ncu_bwd build/bwd_new/bwd_harness d256 bf16 256 4 4096 8 0
    ncu_bwd build/bwd_v4/bwd_harness d256v4 bf16 256 4 4096 8 0
    grep -E "Duration|pipe_tensor_cycles|inst_executed.sum|Issue Slots|Throughput" "$OUT"/ncu_d256*.txt
    ;;
esac
