#!/usr/bin/env bash
# Round 13 in the CUDA harness (no TensorFlow): attn_mask in the Hopper forward (packed_mask.h).
#   round.sh test   build the forward harness (sm_90a), run its full test (the attn_mask cases: family and
#                   result), the feature costs of both families (attn_mask rows), memcheck and racecheck of
#                   the quick test
set -uo pipefail
root="$(cd "$(dirname "$0")/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
mkdir -p /tmp/cutlass && tar -xzf .gpu_build/cutlass_include.tgz -C /tmp/cutlass && export CUTLASS_INCLUDE=/tmp/cutlass/include
case "${1:?test}" in
  test)
    start=$(date +%s)
    ARCHS=90a VARIANTS=0 JOBS=16 PTXAS_VERBOSE=1 tests/cuda_harness/build.sh build/cuda_harness_dev > "$OUT/fwd_build.log" 2>&1 ||
      { echo "forward build failed"; grep -B2 -A10 "error" "$OUT/fwd_build.log" | head -40; exit 1; }
    echo "built in $(( $(date +%s) - start ))s"
    timeout 240 build/cuda_harness_dev/fwd_harness test > "$OUT/fwd_test.log" 2>&1; echo "fwd test rc $?"
    grep -E "FAIL|passed" "$OUT/fwd_test.log" | tail -12
    grep -E "^(attn-mask|doc-|mask-|key-nan|key-mask)" "$OUT/fwd_test.log" | awk '{print $1, $(NF-1), $NF}' | sort | uniq -c
    for fam in default sm80; do
      echo "== feat $fam"; env $([ $fam = sm80 ] && echo TF_FLASH_CUDA_FAMILY=sm80) timeout 150 \
        build/cuda_harness_dev/fwd_harness feat 2>&1 | grep -E "plain|mask|dropout" | tee "$OUT/feat_$fam.txt"
    done
    for tool in memcheck racecheck; do
      timeout 100 compute-sanitizer --tool $tool build/cuda_harness_dev/fwd_harness test quick > "$OUT/fwd_$tool.log" 2>&1
      echo "$tool: $(tail -1 "$OUT/fwd_$tool.log")"
    done ;;
esac
# round.sh both: the forward and backward harnesses (attn_mask in both Hopper kernels): build (sm_90a), the
# forward's mask cases, the backward's full test, backward timings with masks in both families, memcheck and
# racecheck of the mask cases of both
if [[ "${1}" == both ]]; then
  start=$(date +%s)
  (ARCHS=90a VARIANTS=0 JOBS=8 tests/cuda_harness/build.sh build/cuda_harness_dev > "$OUT/fwd_build.log" 2>&1 ||
     echo "forward build failed") &
  (NVCC_ARCHS=90a JOBS=8 BUILD_ONLY=1 BWD_BUILD=build/bwd_dev tests/cuda_harness/run_bwd_harness.sh > "$OUT/bwd_build.log" 2>&1 ||
     echo "backward build failed") &
  wait
  echo "built in $(( $(date +%s) - start ))s"; grep -E "error" "$OUT/fwd_build.log" "$OUT/bwd_build.log" | head -10
  grep -E "sm_90a" "$OUT/bwd_build.log" | head -20
  FWD_HARNESS_CASES=mask,doc,nan timeout 120 build/cuda_harness_dev/fwd_harness test > "$OUT/fwd_test_masks.log" 2>&1
  echo "fwd mask cases rc $?: $(tail -1 "$OUT/fwd_test_masks.log")"
  timeout 300 build/bwd_dev/bwd_harness test > "$OUT/bwd_test.log" 2>&1; echo "bwd test rc $?: $(tail -1 "$OUT/bwd_test.log")"
  grep -E "FAIL|fail" "$OUT/bwd_test.log" | head -10
  grep -E "attn_mask|doc mask|key mask|NaN hidden" "$OUT/bwd_test.log" | awk '{print $NF}' | sort | uniq -c
  for fam in default sm80; do
    for mask in none 1 random random_keys; do
      for cfg in "128 2 8192 16 0" "64 16 1024 12 0" "128 2 8192 16 1"; do
        echo "$fam mask=$mask $cfg: $(env $([ $fam = sm80 ] && echo TF_FLASH_CUDA_FAMILY=sm80) \
          $([ $mask != none ] && echo BWD_BENCH_ATTN_MASK=$mask) build/bwd_dev/bwd_harness bench1 bf16 $cfg 0 20 2>&1 | tail -1)"
      done
    done
  done | tee "$OUT/bwd_bench_masks.txt"
  for tool in memcheck racecheck; do
    FWD_HARNESS_CASES=mask,doc,nan timeout 100 compute-sanitizer --tool $tool build/cuda_harness_dev/fwd_harness test quick \
      > "$OUT/fwd_masks_$tool.log" 2>&1; echo "fwd $tool: $(tail -1 "$OUT/fwd_masks_$tool.log")"
    BWD_TEST_FILTER=" d" timeout 120 compute-sanitizer --tool $tool build/bwd_dev/bwd_harness test \
      > "$OUT/bwd_masks_$tool.log" 2>&1; echo "bwd $tool: $(tail -1 "$OUT/bwd_masks_$tool.log")"
  done
fi
# round.sh bwd2: the backward's masked variant split from dropout / soft-capping (kAttnMask without kGeneral):
# build, the mask cases, timings with masks (and with dropout 0.1) in the Hopper family
if [[ "${1}" == bwd2 ]]; then
  start=$(date +%s)
  NVCC_ARCHS=90a JOBS=16 BUILD_ONLY=1 BWD_BUILD=build/bwd_dev tests/cuda_harness/run_bwd_harness.sh > "$OUT/bwd_build.log" 2>&1 ||
    { echo "backward build failed"; grep error "$OUT/bwd_build.log" | head; exit 1; }
  echo "built in $(( $(date +%s) - start ))s"
  BWD_TEST_FILTER=" d" timeout 200 build/bwd_dev/bwd_harness test > "$OUT/bwd_test_masks.log" 2>&1
  echo "bwd mask cases rc $?: $(tail -1 "$OUT/bwd_test_masks.log")"; grep FAIL "$OUT/bwd_test_masks.log" | head -5
  for mask in none 1 random random_keys; do
    for cfg in "128 2 8192 16 0 0" "64 16 1024 12 0 0" "128 2 8192 16 1 0" "128 2 8192 16 0 0.1" "64 16 1024 12 0 0.1"; do
      echo "mask=$mask $cfg: $(env $([ $mask != none ] && echo BWD_BENCH_ATTN_MASK=$mask) \
        build/bwd_dev/bwd_harness bench1 bf16 $cfg 20 2>&1 | tail -1)"
    done
  done | tee "$OUT/bwd_bench_masks2.txt"
fi
# round.sh fix: after the review fix (rows past q_len no longer count as seeing a key in the forward's exact
# zeroing; the harnesses' NaN-hidden keys stay visible to those rows): both harnesses' mask cases, racecheck of
# the forward's NaN cases, the forward's spill report
if [[ "${1}" == fix ]]; then
  start=$(date +%s)
  (ARCHS=90a VARIANTS=0 JOBS=8 PTXAS_VERBOSE=1 tests/cuda_harness/build.sh build/cuda_harness_dev > "$OUT/fwd_build.log" 2>&1 ||
     echo "forward build failed") &
  (NVCC_ARCHS=90a JOBS=8 BUILD_ONLY=1 BWD_BUILD=build/bwd_dev tests/cuda_harness/run_bwd_harness.sh > "$OUT/bwd_build.log" 2>&1 ||
     echo "backward build failed") &
  wait
  echo "built in $(( $(date +%s) - start ))s"; grep -E " error" "$OUT/fwd_build.log" "$OUT/bwd_build.log" | head -5
  grep -A2 "Compiling entry function.*flash_fwd_kernel_sm90" "$OUT/fwd_build.log" | grep -E "entry|spill" | \
    sed -E 's/.*TraitsSm90ILi([0-9]+)ELi([0-9]+)ELi2EN7cutlass[0-9a-z_]+ELi([0-9])EEELb([01])ELb([01]).*/d\1 n\2 wg\3 general\4 masked\5/' | \
    paste - - | sort -u > "$OUT/fwd_spills.txt"; cat "$OUT/fwd_spills.txt"
  FWD_HARNESS_CASES=mask,doc,nan timeout 150 build/cuda_harness_dev/fwd_harness test > "$OUT/fwd_test_masks.log" 2>&1
  echo "fwd mask cases rc $?: $(tail -1 "$OUT/fwd_test_masks.log")"; grep FAIL "$OUT/fwd_test_masks.log" | head -5
  BWD_TEST_FILTER=" d" timeout 150 build/bwd_dev/bwd_harness test > "$OUT/bwd_test_masks.log" 2>&1
  echo "bwd mask cases rc $?: $(tail -1 "$OUT/bwd_test_masks.log")"; grep FAIL "$OUT/bwd_test_masks.log" | head -5
  FWD_HARNESS_CASES=nan timeout 120 compute-sanitizer --tool racecheck build/cuda_harness_dev/fwd_harness test quick \
    > "$OUT/fwd_nan_racecheck.log" 2>&1; echo "fwd racecheck (NaN cases): $(tail -1 "$OUT/fwd_nan_racecheck.log")"
fi
# round.sh pack: the packing pass reading contiguous mask rows in 16-byte loads: both harnesses' mask cases,
# the forward's feature costs (Hopper), backward timings with masks
if [[ "${1}" == pack ]]; then
  start=$(date +%s)
  (ARCHS=90a VARIANTS=0 JOBS=8 tests/cuda_harness/build.sh build/cuda_harness_dev > "$OUT/fwd_build.log" 2>&1 ||
     echo "forward build failed") &
  (NVCC_ARCHS=90a JOBS=8 BUILD_ONLY=1 BWD_BUILD=build/bwd_dev tests/cuda_harness/run_bwd_harness.sh > "$OUT/bwd_build.log" 2>&1 ||
     echo "backward build failed") &
  wait
  echo "built in $(( $(date +%s) - start ))s"; grep -E " error" "$OUT/fwd_build.log" "$OUT/bwd_build.log" | head -5
  FWD_HARNESS_CASES=mask,doc,nan timeout 150 build/cuda_harness_dev/fwd_harness test > "$OUT/fwd_test_masks.log" 2>&1
  echo "fwd mask cases rc $?: $(tail -1 "$OUT/fwd_test_masks.log")"; grep FAIL "$OUT/fwd_test_masks.log" | head -5
  BWD_TEST_FILTER=" d" timeout 150 build/bwd_dev/bwd_harness test > "$OUT/bwd_test_masks.log" 2>&1
  echo "bwd mask cases rc $?: $(tail -1 "$OUT/bwd_test_masks.log")"; grep FAIL "$OUT/bwd_test_masks.log" | head -5
  timeout 150 build/cuda_harness_dev/fwd_harness feat 2>&1 | grep -E "plain|mask" | tee "$OUT/feat_default.txt"
  for mask in none 1 random random_keys; do
    for cfg in "128 2 8192 16 0 0" "64 16 1024 12 0 0"; do
      echo "mask=$mask $cfg: $(env $([ $mask != none ] && echo BWD_BENCH_ATTN_MASK=$mask) \
        build/bwd_dev/bwd_harness bench1 bf16 $cfg 20 2>&1 | tail -1)"
    done
  done | tee "$OUT/bwd_bench_masks.txt"
fi
# round.sh parts: the forward's feature costs with the packing pass timed alone (what a mask that shows every
# tile costs over the plain kernel: the pass, or the masked kernel variant)
if [[ "${1}" == parts ]]; then
  ARCHS=90a VARIANTS=0 JOBS=16 tests/cuda_harness/build.sh build/cuda_harness_dev > "$OUT/fwd_build.log" 2>&1 ||
    { echo "forward build failed"; grep error "$OUT/fwd_build.log" | head; exit 1; }
  for r in 1 2; do timeout 150 build/cuda_harness_dev/fwd_harness feat 2>&1 | grep -E "plain|mask|packing"; done | tee "$OUT/feat_parts.txt"
fi
