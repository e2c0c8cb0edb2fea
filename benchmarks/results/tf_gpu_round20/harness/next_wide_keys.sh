#!/usr/bin/env bash
# Prepared in round 20 and NOT RUN (no device time was left): the d128 forward's plain variant over unmasked,
# non-causal attention with wider key tiles (TF_FLASH_SM90_D128_UNMASKED_BLOCK_N, fwd_kernel_sm90.h; one register
# buffer of P, since two do not fit beside a wider S), against the kept 128-key tiles with two P buffers. One device
# command (about 8 minutes by the parts' earlier timings):
#   next_wide_keys.sh  the forward harness (sm_90a), then variants of the two d128 Hopper objects: 176 and 160 keys
#                      with CuTe's extended wgmma shapes (one wgmma of N = 176 / 160 per k-slice), 192 (a base
#                      shape); the forward tests on each (in parallel: correctness, not time), then the d128
#                      benchmark interleaved twice over the four binaries, and the summary.
# ptxas here (nvcc 13.0, bf16): 176 keys spill 300 bytes (seven 8-byte reloads before each S GEMM, behind the
# ping-pong barrier; the rest on the masked edge tiles' path), 160 148 bytes, 144 84 bytes; the kept kernel 20.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
source benchmarks/results/round_lib.sh
start=$(date +%s)
cutlass_headers
ARCHS=90a VARIANTS=0 JOBS=16 tests/cuda_harness/build.sh build/fwd_base > "$OUT/fwd_base_build.log" 2>&1 ||
  { tail -20 "$OUT/fwd_base_build.log"; exit 1; }
files="flash_fwd_sm90_bf16_hdim128.cu flash_fwd_sm90_fp16_hdim128.cu"
ext=-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
variant_fwd build/fwd_base build/fwd_w176 "-DTF_FLASH_SM90_D128_UNMASKED_BLOCK_N=176 $ext" "$files" &
variant_fwd build/fwd_base build/fwd_w160 "-DTF_FLASH_SM90_D128_UNMASKED_BLOCK_N=160 $ext" "$files" &
variant_fwd build/fwd_base build/fwd_w192 "-DTF_FLASH_SM90_D128_UNMASKED_BLOCK_N=192" "$files" &
wait
echo "built in $(( $(date +%s) - start ))s"
grep -H "spill" "$OUT"/fwd_w*_build.log | sort | uniq -c | cut -c1-160
for kind in w176 w160 w192; do
  timeout 200 build/fwd_$kind/fwd_harness test > "/tmp/test_$kind.log" 2>&1 &
done
wait
for kind in w176 w160 w192; do  # $OUT takes 8 files: one log of the three
  echo "$kind tests: $(tail -n 1 "/tmp/test_$kind.log")"; grep -E "FAIL" "/tmp/test_$kind.log" | head -5
  { echo "=== $kind"; cat "/tmp/test_$kind.log"; } >> "$OUT/test_variants.log"
done
for r in 1 2; do
  for kind in base w176 w160 w192; do
    timeout 60 build/fwd_$kind/fwd_harness bench 128 > "$OUT/fwdbench_${kind}_$r.txt" 2>&1 || echo "bench $kind failed"
  done
done
fwd_summary "base w176 w160 w192" "128 keys, two P buffers (kept) | 176 | 160 | 192"
echo "total $(( $(date +%s) - start ))s"
