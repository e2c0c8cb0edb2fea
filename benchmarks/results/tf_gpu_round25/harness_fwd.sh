#!/usr/bin/env bash
# Round 25's forward A/B in the CUDA harness, prepared in session 24, run in session 25 (results in README.md; the switch was removed after: run it on the tree of 1d057e9) (one device command, no
# TensorFlow; about 5 minutes): TF_FLASH_SM90_ROWSUM_GEMM=1, the plain variant's row sums of P on the tensor cores
# (P times a shared-memory tile of ones, N = 8, in the P V GEMM's commit group) instead of one FADD per score.
# Round 23's ncu of the d64 forward: issue-bound; round 24's harness_c: an instruction more per score (the
# polynomial exp2) cost in proportion, so one fewer may gain likewise. ptxas here (bf16): FADD in the d64
# three-consumer plain kernel 278 -> 144, HGMMA 64x8x16 16 more; spills d64 228 -> 244 bytes, d128 plain 84 -> 76,
# d256 plain 80 -> 72; the default build's SASS unchanged (d64, d128, d256 compared). The forward tests on both builds
# (the sums are now of the 16-bit P the numerators use: lse moves by at most ~2^-10), then `bench 64 128 256`
# base / rowsum interleaved three times.
#   OUT=... bash harness_fwd.sh   (carry .gpu_build)
set -uo pipefail
cd "$(dirname "$0")/../../.."
root=$PWD
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
source benchmarks/results/round_lib.sh
start=$(date +%s)
build_fwd build/fwd_base || exit 1
variant_fwd build/fwd_base build/fwd_rowsum "-DTF_FLASH_SM90_ROWSUM_GEMM=1" "$(cd cc/kernels/cuda && ls flash_fwd_sm90_*.cu)"
grep -h "spill" "$OUT/fwd_rowsum_build.log" | sed 's/.*FwdTraitsSm90//' | cut -c1-110
echo "built in $(( $(date +%s) - start ))s"
harness_tests fwd 240 base rowsum
echo "[$(( $(date +%s) - start ))s]"
harness_bench fwd 3 60 "base rowsum" 64 128 256
fwd_summary "base rowsum" "FADD row sums | row sums by GEMM"
echo "total $(( $(date +%s) - start ))s"
