#!/usr/bin/env bash
# Round 24, third harness command (session 24): TF_FLASH_SM90_POLY_EXP2_EVERY=N, every N-th exponential of the d64
# forward's plain three-consumer kernel on the FMA pipe (common.cuh's poly_exp2, FlashAttention-4's emulation)
# instead of MUFU, whose 16 per cycle per SM match that kernel's tensor rate (round 23's ncu). N = 8, 4, 2 (1/8,
# 1/4, 1/2 of the scores) against the default (lazy rescaling on). ptxas: spills as the default's (228 / 124 bytes),
# MUFU.EX2 in the kernel 130 -> 98 at N = 4. The forward tests on each build (huge logits, empty rows: poly_exp2
# gives exactly 0 at -inf); `bench 64 128` base / p8 / p4 / p2, four times interleaved.
#   OUT=... bash harness_c.sh   (carry .gpu_build)
# Run once (README.md, item 6) and the switch removed: the script no longer builds what it measured.
set -uo pipefail
cd "$(dirname "$0")/../../.."
root=$PWD
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
source benchmarks/results/round_lib.sh
start=$(date +%s)
build_fwd build/fwd_base || exit 1
sm90="$(cd cc/kernels/cuda && ls flash_fwd_sm90_*hdim64.cu)"
for n in 8 4 2; do variant_fwd build/fwd_base build/fwd_p$n "-DTF_FLASH_SM90_POLY_EXP2_EVERY=$n" "$sm90" & done
wait
for n in 8 4 2; do echo "== p$n"; cat "$OUT/fwd_p${n}_build.log"; done > "$OUT/fwd_variants_build.log"  # at most 8 files back
rm -f "$OUT"/fwd_p?_build.log
grep -hE "^== |spill" "$OUT/fwd_variants_build.log" | sed 's/.*FwdTraitsSm90//' | cut -c1-110
echo "built in $(( $(date +%s) - start ))s"
for v in base p8 p4 p2; do
  (timeout 240 build/fwd_$v/fwd_harness test > "$OUT/test_$v.log" 2>&1; echo "$v tests rc $?: $(tail -n 1 "$OUT/test_$v.log")") &
done
wait
grep -h FAIL "$OUT"/test_*.log | head -8
echo "[$(( $(date +%s) - start ))s]"
for r in 1 2 3 4; do
  for v in base p8 p4 p2; do
    timeout 60 build/fwd_$v/fwd_harness bench 64 128 > "$OUT/fwdbench_${v}_$r.txt" 2>&1 || echo "bench $v failed"
  done
done
fwd_summary "base p8 p4 p2" "MUFU only | 1/8 on FMA | 1/4 | 1/2"
echo "total $(( $(date +%s) - start ))s"
