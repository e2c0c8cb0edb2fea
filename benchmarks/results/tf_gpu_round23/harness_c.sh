#!/usr/bin/env bash
# Round 23's third harness command (no TensorFlow): TF_FLASH_SM90_EXPONENT_VOTE=1. harness_b's ncu of the d64
# forward: FADD 22.7% and FMUL 16.8% of the executed instructions, FFMA ~0 (the Hopper forward always exponentiates
# (s - max) * scale_log2, round 9's choice); with the vote, the plain variant does one FMA per score unless a row of
# the warp passes kFmaExponentLimit (as the sm_80 family). The six Hopper forward objects rebuilt with it; the
# forward tests on it (huge-logits / huge-causal among them); `bench 64 128 256` interleaved three times.
#   OUT=... bash harness_c.sh   (carry .gpu_build)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
source benchmarks/results/round_lib.sh
start=$(date +%s)
build_fwd build/fwd_base || exit 1
variant_fwd build/fwd_base build/fwd_vote "-DTF_FLASH_SM90_EXPONENT_VOTE=1" "$(cd cc/kernels/cuda && ls flash_fwd_sm90_*.cu)"
grep -h "spill" "$OUT/fwd_vote_build.log" | sed 's/.*FwdTraitsSm90//' | cut -c1-120
echo "built in $(( $(date +%s) - start ))s"
timeout 200 build/fwd_vote/fwd_harness test > "$OUT/test_vote.log" 2>&1
echo "vote tests rc $?: $(tail -n 1 "$OUT/test_vote.log")"; grep -E "FAIL" "$OUT/test_vote.log" | head -5
grep -E "^huge" "$OUT/test_vote.log" | head -12
echo "[$(( $(date +%s) - start ))s]"
for r in 1 2 3; do
  for v in base vote; do
    timeout 90 build/fwd_$v/fwd_harness bench 64 128 256 > "$OUT/fwdbench_${v}_$r.txt" 2>&1 || echo "bench $v failed"
  done
done
fwd_summary "base vote" "(s - max) * c | FMA unless large"
echo "total $(( $(date +%s) - start ))s"
