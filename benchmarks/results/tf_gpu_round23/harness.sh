#!/usr/bin/env bash
# Round 23 in the CUDA harness, prepared in session 22 and NOT RUN yet (one device command, no TensorFlow; run it
# first, then the stash and round.sh): TF_FLASH_SM90_EARLY_Q_RELEASE=1 (fwd_kernel_sm90.h: where O has its own
# buffer, d64 and d128, the consumers free Q's buffer after a tile's last S instead of its last P V, so that the next
# tile's Q loads during the last softmax, P V and epilogue; round 18's ncu at d128 4k put 1.3% of the samples on the
# consumers' wait for Q). The four d64 / d128 objects rebuilt with it into a copy of the default build; the forward
# tests on the variant (the persistent cases: lengths-waves, gqa, the schedule shapes), racecheck on lengths-waves,
# then `bench 64 128` interleaved three times. Expected: +1-1.5% at 4k, less at 16k (same tile count, 4x the
# key tiles per query tile). ptxas here: the variant's spills are the default's (d128 44/40/20/12, d64 232/132/0).
#   OUT=/tmp/out bash harness.sh; tar -czf $OUT/harness.tgz -C /tmp/out .   (carry .gpu_build)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
source benchmarks/results/round_lib.sh
start=$(date +%s)
build_fwd build/fwd_base || exit 1
variant_fwd build/fwd_base build/fwd_early "-DTF_FLASH_SM90_EARLY_Q_RELEASE=1" \
  "flash_fwd_sm90_bf16_hdim64.cu flash_fwd_sm90_fp16_hdim64.cu flash_fwd_sm90_bf16_hdim128.cu flash_fwd_sm90_fp16_hdim128.cu"
grep -c "spill" "$OUT/fwd_early_build.log"
echo "built in $(( $(date +%s) - start ))s"
timeout 150 build/fwd_early/fwd_harness test > "$OUT/test_early.log" 2>&1
echo "early tests rc $?: $(tail -n 1 "$OUT/test_early.log")"; grep -E "FAIL" "$OUT/test_early.log" | head -5
FWD_HARNESS_CASES=lengths-waves timeout 60 compute-sanitizer --tool racecheck build/fwd_early/fwd_harness test \
  > "$OUT/racecheck_early.log" 2>&1
echo "racecheck rc $?: $(grep -E "RACECHECK SUMMARY" "$OUT/racecheck_early.log" | tail -1)"
echo "[$(( $(date +%s) - start ))s]"
for r in 1 2 3; do
  timeout 60 build/fwd_base/fwd_harness bench 64 128 > "$OUT/fwdbench_base_$r.txt" 2>&1 || echo "bench failed"
  timeout 60 build/fwd_early/fwd_harness bench 64 128 > "$OUT/fwdbench_early_$r.txt" 2>&1 || echo "bench early failed"
done
fwd_summary "base early" "default | early Q release"
echo "total $(( $(date +%s) - start ))s"
