#!/usr/bin/env bash
# Round 12, third harness round: three K/V stages in the Hopper forward at head dims 64 and 128 (.stages: a
# copy of HEAD with FwdConfigSm90's kStages 3) against two (.baseline = HEAD), same run (compare.sh, forward
# only, two rounds, order alternating), and the forward test of the three-stage build (d64 / d128 cases).
set -uo pipefail
root="$(cd "$(dirname "$0")/../../../.." && pwd)"
cd "$root/.stages"
export OUT="${OUT:-/tmp/out}"
FWD_ONLY=1 ROUNDS=2 tests/cuda_harness/compare.sh ../.baseline 64 128 2>&1 | tail -14
timeout 200 /tmp/cmp_new/fwd/fwd_harness test > "$OUT/stages_test.log" 2>&1
echo "3-stage test, d64/d128 cases: $(grep -E ' (64|128) +(64|128) ' "$OUT/stages_test.log" | grep -c ' ok')" \
     "ok, $(grep -E ' (64|128) +(64|128) ' "$OUT/stages_test.log" | grep -c FAIL) failed"
grep -E ' (64|128) +(64|128) ' "$OUT/stages_test.log" | grep FAIL | head -5
