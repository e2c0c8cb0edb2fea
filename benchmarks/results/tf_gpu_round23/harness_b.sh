#!/usr/bin/env bash
# Round 23's second harness command (no TensorFlow): the d64 forward, 0.85-0.95 of cuDNN through TF (tf/a).
# 1. round 23's ncu report of the d64 forward (b4 s4k h32 bf16, `tf/d`, carried in .gpu_build/) read out: every
#    section's details, and the per-instruction samples.
# 2. TF_FLASH_SM90_D64_STAGES=3 and 4 (the three-consumer d64 tiles' K/V ring; 2 by default): a K/V stage of 32 KB
#    feeds three consumers' short GEMMs, so two stages may not hide the loads. The two d64 objects rebuilt with
#    each into copies of the default build; the forward tests on each; `bench 64` interleaved three times.
#   OUT=... bash harness_b.sh   (carry .gpu_build)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
source benchmarks/results/round_lib.sh
start=$(date +%s)
rep=.gpu_build/ncu_d64_4k.ncu-rep
ncu -i $rep --page details > "$OUT/ncu_d64_details.txt" 2>&1
ncu -i $rep --page source --csv --print-source sass 2>/dev/null | gzip > "$OUT/ncu_d64_sass.csv.gz"
grep -E "Duration|Throughput|L2|Issue|Warp Cycles Per|Executed Ipc|Registers|Local|Theoretical|Stall" \
  "$OUT/ncu_d64_details.txt" | awk '{$1=$1; print}' | cut -c1-140 | head -60
build_fwd build/fwd_base || exit 1
d64="flash_fwd_sm90_bf16_hdim64.cu flash_fwd_sm90_fp16_hdim64.cu"
variant_fwd build/fwd_base build/fwd_s3 "-DTF_FLASH_SM90_D64_STAGES=3" "$d64" &
variant_fwd build/fwd_base build/fwd_s4 "-DTF_FLASH_SM90_D64_STAGES=4" "$d64" &
wait
grep -h "spill" "$OUT"/fwd_s*_build.log | sed 's/.*FwdTraitsSm90//' | cut -c1-120
echo "built in $(( $(date +%s) - start ))s"
for v in s3 s4; do
  (timeout 200 build/fwd_$v/fwd_harness test > "$OUT/test_$v.log" 2>&1; echo "$v tests rc $?: $(tail -n 1 "$OUT/test_$v.log")") &
done
wait
grep -h FAIL "$OUT"/test_s*.log | head -5
echo "[$(( $(date +%s) - start ))s]"
for r in 1 2 3; do
  for v in base s3 s4; do
    timeout 60 build/fwd_$v/fwd_harness bench 64 > "$OUT/fwdbench_${v}_$r.txt" 2>&1 || echo "bench $v failed"
  done
done
fwd_summary "base s3 s4" "2 stages | 3 | 4"
echo "total $(( $(date +%s) - start ))s"
