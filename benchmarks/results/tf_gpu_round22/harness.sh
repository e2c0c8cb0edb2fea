#!/usr/bin/env bash
# Round 22 in the CUDA harness, prepared in round 21, run in session 22 (results: README.md beside it; the dynamic
# schedule was removed after it). One device command, no TensorFlow:
# the dynamic schedule of the Hopper forward (TF_FLASH_SM90_FORWARD_SCHEDULE=dynamic: causal attention over more
# than 4k keys on persistent CTAs that take their query tiles from a counter, where the default runs a CTA per
# tile). One build serves both (the variable is read at run time): the forward tests under each (the new cases
# causal-4k-waves and window-4k-waves have more query tiles than SMs), compute-sanitizer memcheck and racecheck
# of those cases under the dynamic schedule, then `bench 64 128 256` interleaved twice (the causal rows over 4k
# keys are the ones that differ). ptxas here (nvcc 13.0): the dynamic kernels' consumers spill as the default ones; their loading
# thread (24 registers) spills where the default keeps the tile's coordinates in uniform registers (d128 plain
# 108 bytes in all, against 20).
#   OUT=/tmp/out bash harness.sh; tar -czf $OUT/harness.tgz -C /tmp/out .   ($OUT takes 8 files; carry .gpu_build,
#   made here by `bash scripts/gpu_round.sh host`, for the CUTLASS headers)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
source benchmarks/results/round_lib.sh
start=$(date +%s)
cutlass_headers
ARCHS=90a VARIANTS=0 JOBS=16 tests/cuda_harness/build.sh build/fwd_base > "$OUT/fwd_base_build.log" 2>&1 ||
  { tail -20 "$OUT/fwd_base_build.log"; exit 1; }
grep -c "spill" "$OUT/fwd_base_build.log"
echo "built in $(( $(date +%s) - start ))s"
bin=build/fwd_base/fwd_harness
timeout 300 $bin test > "$OUT/test_default.log" 2>&1 &
TF_FLASH_SM90_FORWARD_SCHEDULE=dynamic timeout 300 $bin test > "$OUT/test_dynamic.log" 2>&1 &
wait
for kind in default dynamic; do
  echo "$kind tests: $(tail -n 1 "$OUT/test_$kind.log")"; grep -E "FAIL" "$OUT/test_$kind.log" | head -5
done
for tool in memcheck racecheck; do
  TF_FLASH_SM90_FORWARD_SCHEDULE=dynamic FWD_HARNESS_CASES=4k-waves timeout 200 \
    compute-sanitizer --tool $tool $bin test > "/tmp/san_$tool.log" 2>&1
  echo "$tool rc $?: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "/tmp/san_$tool.log" | tail -1)"
done
cat /tmp/san_*.log > "$OUT/sanitizer.log"
echo "[$(( $(date +%s) - start ))s]"
for r in 1 2; do
  timeout 100 $bin bench 64 128 256 > "$OUT/fwdbench_base_$r.txt" 2>&1 || echo "bench failed"
  TF_FLASH_SM90_FORWARD_SCHEDULE=dynamic timeout 100 $bin bench 64 128 256 > "$OUT/fwdbench_dyn_$r.txt" 2>&1 ||
    echo "bench dynamic failed"
done
fwd_summary "base dyn" "a CTA per tile (default) | dynamic"
echo "total $(( $(date +%s) - start ))s"
