#!/usr/bin/env bash
# Round 22, third harness command (session 22): the tree that lands (the dynamic schedule removed, the d256 Q-buffer
# fix kept): the forward harness's tests, and compute-sanitizer racecheck on lengths-waves (static persistent
# schedule, first tiles without work) and window-4k-waves (a CTA per tile).
#   OUT=/tmp/out bash harness_final.sh; tar -czf $OUT/harness_final.tgz -C /tmp/out .   (carry .gpu_build)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
source benchmarks/results/round_lib.sh
start=$(date +%s)
cutlass_headers
ARCHS=90a VARIANTS=0 JOBS=16 tests/cuda_harness/build.sh build/fwd_final > "$OUT/fwd_final_build.log" 2>&1 ||
  { tail -20 "$OUT/fwd_final_build.log"; exit 1; }
echo "built in $(( $(date +%s) - start ))s"
bin=build/fwd_final/fwd_harness
timeout 100 $bin test > "$OUT/test_final.log" 2>&1
echo "tests rc $?: $(tail -n 1 "$OUT/test_final.log")"; grep -E "FAIL|waves" "$OUT/test_final.log" | head -8
FWD_HARNESS_CASES=lengths-waves,window-4k-waves timeout 60 compute-sanitizer --tool racecheck $bin test \
  > "$OUT/racecheck.log" 2>&1
echo "racecheck rc $?: $(grep -E "RACECHECK SUMMARY" "$OUT/racecheck.log" | tail -1)"
echo "total $(( $(date +%s) - start ))s"
