#!/usr/bin/env bash
# Round 12, fifth harness round (one device call): the sm_80 forward's general variant (element and block
# masks, soft-capping) on 64-row tiles (FwdConfig::MaskedTraits: the 128-row tiles spilled 270-370 bytes in
# the tile loop, ncu: long-scoreboard stalls first) against .baseline (HEAD, 128 rows): forward harnesses of
# both trees (reduced for the baseline), the forward test of this tree, `feat` of both in both families.
set -uo pipefail
root="$(cd "$(dirname "$0")/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
new=build/cuda_harness_dev base=/tmp/base_fwd
start=$(date +%s)
(ARCHS=90a VARIANTS=0 JOBS=10 tests/cuda_harness/build.sh $new > "$OUT/fwd_build.log" 2>&1 || echo "new fwd build failed") &
(ARCHS=90a VARIANTS=0 REDUCED=1 JOBS=6 .baseline/tests/cuda_harness/build.sh $base > "$OUT/base_build.log" 2>&1 ||
   echo "base fwd build failed") &
wait
echo "built in $(( $(date +%s) - start ))s"
timeout 150 $new/fwd_harness test > "$OUT/fwd_test.log" 2>&1; echo "fwd test rc $?"
grep -E "FAIL|passed" "$OUT/fwd_test.log" | tail -6
for fam in default sm80; do
  for tree in new base; do
    echo "== feat $tree $fam"
    env $([ $fam = sm80 ] && echo TF_FLASH_CUDA_FAMILY=sm80) timeout 60 $(eval echo \$$tree)/fwd_harness feat 2>&1 |
      grep -E "plain|mask|block"
  done
done
