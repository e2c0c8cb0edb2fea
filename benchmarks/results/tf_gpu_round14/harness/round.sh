#!/usr/bin/env bash
# Round 14 in the CUDA harness (no TensorFlow).
#   round.sh det   the deterministic dQ in the Hopper backward (a CTA per split running its key tiles in turn) and
#                  the forward's attn_mask variant without dropout / soft-capping: build both harnesses (sm_90a,
#                  spill reports), the backward's full test (deterministic cases: bit-identical reruns), the
#                  forward's mask cases, timings (deterministic against not, both families; the forward's
#                  feature costs), memcheck and racecheck of the deterministic cases
set -uo pipefail
root="$(cd "$(dirname "$0")/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
mkdir -p /tmp/cutlass && tar -xzf .gpu_build/cutlass_include.tgz -C /tmp/cutlass && export CUTLASS_INCLUDE=/tmp/cutlass/include
bench1() {  # family, env, cfg
  env $([ "$1" = sm80 ] && echo TF_FLASH_CUDA_FAMILY=sm80) $2 build/bwd_dev/bwd_harness bench1 bf16 $3 2>&1 | tail -1
}
case "${1:?det}" in
  det)
    start=$(date +%s)
    (ARCHS=90a VARIANTS=0 JOBS=8 PTXAS_VERBOSE=1 tests/cuda_harness/build.sh build/cuda_harness_dev > "$OUT/fwd_build.log" 2>&1 ||
       echo "forward build failed") &
    (NVCC_ARCHS=90a JOBS=8 BUILD_ONLY=1 BWD_BUILD=build/bwd_dev PTXAS_VERBOSE=1 tests/cuda_harness/run_bwd_harness.sh \
       > "$OUT/bwd_build.log" 2>&1 || echo "backward build failed") &
    wait
    echo "built in $(( $(date +%s) - start ))s"; grep -E " error" "$OUT/fwd_build.log" "$OUT/bwd_build.log" | head -10
    cat "$OUT/fwd_build.log" build/bwd_dev/*.o.log | python3 -c '
import re, sys
lines = sys.stdin.read().splitlines()
for i, l in enumerate(lines):
    m = re.search(r"Compiling entry function .*?(flash_fwd_kernel_sm90|bwd_dkdv_kernel_sm90)\w*?TraitsSm90ILi(\d+)E.*?((?:ELb[01])+)E", l)
    if m and "sm_90a" in l:
        spill = next((re.search(r"(\d+) bytes spill stores", x).group(1) for x in lines[i + 1:i + 4] if "spill stores" in x), "?")
        print(m.group(1), "d" + m.group(2), m.group(3).replace("ELb", ""), "spill", spill)
' | sort | uniq | tee "$OUT/spills.txt"
    timeout 360 build/bwd_dev/bwd_harness test > "$OUT/bwd_test.log" 2>&1; echo "bwd test rc $?: $(tail -1 "$OUT/bwd_test.log")"
    grep -E "FAIL" "$OUT/bwd_test.log" | head -10
    grep -E "deterministic" "$OUT/bwd_test.log" | awk '{print $(NF-1), $NF}' | sort | uniq -c
    FWD_HARNESS_CASES=mask,doc,nan timeout 150 build/cuda_harness_dev/fwd_harness test > "$OUT/fwd_test_masks.log" 2>&1
    echo "fwd mask cases rc $?: $(tail -1 "$OUT/fwd_test_masks.log")"; grep FAIL "$OUT/fwd_test_masks.log" | head -5
    for r in 1 2; do timeout 150 build/cuda_harness_dev/fwd_harness feat 2>&1 | grep -E "plain|mask|packing"; done |
      tee "$OUT/fwd_feat.txt"
    for cfg in "128 2 8192 16 0 0" "128 8 4096 16 1 0" "64 16 1024 12 0 0" "64 4 4096 12 0 0" "128 8 4096 16 0 0.1"; do
      for fam in default sm80; do
        echo "$fam $cfg: $(bench1 $fam "" "$cfg 20") | deterministic: $(bench1 $fam BWD_BENCH_DETERMINISTIC=1 "$cfg 20")"
      done
    done | tee "$OUT/bwd_bench_det.txt"
    for cfg in "128 2 8192 16 0 0" "64 16 1024 12 0 0"; do
      echo "mask=random $cfg: $(bench1 default BWD_BENCH_ATTN_MASK=random "$cfg 20") | deterministic: $(bench1 default \
        "BWD_BENCH_ATTN_MASK=random BWD_BENCH_DETERMINISTIC=1" "$cfg 20")"
    done | tee -a "$OUT/bwd_bench_det.txt"
    for tool in memcheck racecheck; do
      BWD_TEST_FILTER="deterministic d64" timeout 120 compute-sanitizer --tool $tool build/bwd_dev/bwd_harness test \
        > "$OUT/bwd_det_$tool.log" 2>&1; echo "bwd $tool: $(tail -1 "$OUT/bwd_det_$tool.log")"
    done ;;
esac
# round.sh ncu: what limits the deterministic Hopper backward (its own dQ accumulator per CTA, swept once per key
# tile): ncu's DRAM and L2 throughput and the dK/dV kernel's time, deterministic against not, two shapes
if [[ "${1}" == ncu ]]; then
  NVCC_ARCHS=90a JOBS=16 BUILD_ONLY=1 BWD_BUILD=build/bwd_dev tests/cuda_harness/run_bwd_harness.sh > "$OUT/bwd_build.log" 2>&1 ||
    { echo "backward build failed"; grep error "$OUT/bwd_build.log" | head; exit 1; }
  metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes.sum,lts__t_bytes.sum,lts__t_sector_hit_rate.pct,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed
  for cfg in "128 2 8192 16 0 0" "128 8 4096 16 1 0"; do
    for det in 0 1; do
      echo "== $cfg deterministic=$det"
      env $([ $det = 1 ] && echo BWD_BENCH_DETERMINISTIC=1) timeout 120 ncu --kernel-name regex:bwd_dkdv_kernel_sm90 \
        --launch-skip 2 --launch-count 1 --metrics $metrics build/bwd_dev/bwd_harness bench1 bf16 $cfg 3 2>&1 |
        grep -E "gpu__time|dram__|lts__|gmma" | awk '{print $1, $(NF-1), $NF}'
    done
  done | tee "$OUT/ncu_det.txt"
fi
# round.sh ncufwd: where the forward's masked variant spends the time a mask showing every tile costs over the
# plain kernel (b2 s8k h16 d128, all-True attn_mask; the first launch of each in `fwd_harness feat`)
if [[ "${1}" == ncufwd ]]; then
  ARCHS=90a VARIANTS=0 JOBS=16 tests/cuda_harness/build.sh build/cuda_harness_dev > "$OUT/fwd_build.log" 2>&1 ||
    { echo "forward build failed"; grep error "$OUT/fwd_build.log" | head; exit 1; }
  for kind in plain:Lb0ELb0E masked:Lb0ELb1E; do
    timeout 200 ncu --kernel-name-base mangled --kernel-name "regex:flash_fwd_kernel_sm90.*${kind#*:}" --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section InstructionStats --section LaunchStats \
      --section MemoryWorkloadAnalysis build/cuda_harness_dev/fwd_harness feat > "$OUT/ncu_fwd_${kind%%:*}.txt" 2>&1
    echo "== ${kind%%:*}"
    grep -E "Duration|Registers Per|Executed Instructions  |Issued Warp|Stall|Memory Throughput|Compute \(SM\)|Block Size|Warp Cycles Per Issued" \
      "$OUT/ncu_fwd_${kind%%:*}.txt" | head -16
  done
fi
# round.sh review: after the review's refactor (bwd_dkdv_ctas for both families' grids; the harness's download
# helper): the backward's full test
if [[ "${1}" == review ]]; then
  NVCC_ARCHS=90a JOBS=16 BUILD_ONLY=1 BWD_BUILD=build/bwd_dev tests/cuda_harness/run_bwd_harness.sh > "$OUT/bwd_build.log" 2>&1 ||
    { echo "backward build failed"; grep error "$OUT/bwd_build.log" | head; exit 1; }
  timeout 360 build/bwd_dev/bwd_harness test > "$OUT/bwd_test.log" 2>&1; echo "bwd test rc $?: $(tail -1 "$OUT/bwd_test.log")"
  grep FAIL "$OUT/bwd_test.log" | head -5
  grep -E "deterministic" "$OUT/bwd_test.log" | awk '{print $(NF-1), $NF}' | sort | uniq -c
fi
