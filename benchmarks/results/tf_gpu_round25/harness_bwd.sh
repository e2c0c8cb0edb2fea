#!/usr/bin/env bash
# Round 25 in the CUDA harness, prepared in session 24, run in session 25 (results in README.md; the switch was removed after: run it on the tree of 1d057e9) (one device command, no TensorFlow; about
# 7 minutes): TF_FLASH_SM90_DQ_ATOMIC_V4=1, head dim 256's dQ into the fp32 accumulator by 16-byte atomics (lanes
# 2j and 2j + 1 trade a column pair, then one red.v4 per four columns for the whole warp) instead of 8-byte ones:
# half the red instructions of the d256 backward, which rounds 19-20 found bound by its dQ atomics in L2. The same
# 32-byte sectors are written either way, so this asks whether L2 counts requests or sectors. ptxas here (bf16):
# the variant's REDG.E.ADD.F32x4 16 per query tile against 32 F32x2; spills attn_mask 76 / 64 -> 0 bytes, general
# 0 -> 8, plain none either way; the default's SASS unchanged. The backward tests on both builds, then
# `bench 256` (bf16) interleaved three times.
#   OUT=... bash harness_bwd.sh   (carry .gpu_build)
set -uo pipefail
cd "$(dirname "$0")/../../.."
root=$PWD
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
source benchmarks/results/round_lib.sh
start=$(date +%s)
build_bwd build/bwd_base 16 ""
variant_bwd build/bwd_base build/bwd_v4 "-DTF_FLASH_SM90_DQ_ATOMIC_V4=1" "$(cd cc/kernels/cuda && ls flash_bwd_*_hdim256.cu | tr '\n' ' ')"
grep -h "bwd_dkdv_kernel_sm90" -A2 "$OUT"/bwd_v4_build.log | grep -E "spill" | sort | uniq -c | head -8
echo "built in $(( $(date +%s) - start ))s"
harness_tests bwd 300 base v4
echo "[$(( $(date +%s) - start ))s]"
BWD_BENCH_DTYPE=bf16 harness_bench bwd 3 90 "base v4" 256
bwd_summary "base v4" "8-byte dQ atomics | 16-byte"
echo "total $(( $(date +%s) - start ))s"
