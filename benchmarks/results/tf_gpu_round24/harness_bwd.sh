#!/usr/bin/env bash
# Round 24's backward A/B in the CUDA harness, prepared in session 23 and NOT RUN yet (one device command, no
# TensorFlow): TF_FLASH_SM90_BWD_FAST_TILES=1 (bwd_kernel_sm90.h: the plain variants compute P and dS without the
# selects of hidden entries, their bit tests and the exponent's clamp in tiles that need none of them: no boundary,
# no attn_mask bits, every lse of the warp's queries below kFmaExponentLimit). Round 18's ncu of the d64 backward:
# FSEL 11.4%, LOP3 6.1%, FMNMX 5.7% of the executed instructions, the loop issue-bound. ptxas here (bf16): d64 plain
# 8 -> 68 bytes of spill stores, d128 plain none either way, d128 attn_mask 44 -> 80. The six Hopper-capable
# backward objects rebuilt with it; the backward tests on both builds; `bench 64 128 256` (bf16) interleaved three
# times.
#   OUT=... bash harness_bwd.sh   (carry .gpu_build)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
source benchmarks/results/round_lib.sh
start=$(date +%s)
build_bwd build/bwd_base 16 ""
variant_bwd build/bwd_base build/bwd_fast "-DTF_FLASH_SM90_BWD_FAST_TILES=1" \
  "$(cd cc/kernels/cuda && ls flash_bwd_*_hdim{64,128,256}.cu | tr '\n' ' ')"
grep -h "bwd_dkdv" -A2 "$OUT"/bwd_fast_build.log | grep -E "spill" | sort | uniq -c | head -20
echo "built in $(( $(date +%s) - start ))s"
for kind in base fast; do
  (timeout 300 build/bwd_$kind/bwd_harness test > "$OUT/test_$kind.log" 2>&1; echo "$kind tests rc $?: $(tail -n 1 "$OUT/test_$kind.log")") &
done
wait
grep -hE "FAIL|NOT REP" "$OUT"/test_*.log | head -8
echo "[$(( $(date +%s) - start ))s]"
for r in 1 2 3; do
  for kind in base fast; do
    BWD_BENCH_DTYPE=bf16 timeout 90 build/bwd_$kind/bwd_harness bench 64 128 256 > "$OUT/bwdbench_${kind}_$r.txt" 2>&1 ||
      echo "bench $kind failed"
  done
done
bwd_summary "base fast" "selects and clamp everywhere | left out where not needed"
echo "total $(( $(date +%s) - start ))s"
