#!/usr/bin/env bash
# Round 11, Hopper backward (dropout, soft-capping, dQ by TMA reduce-add) in the CUDA harness, two device calls:
#   round.sh build   the full backward harness of this tree, and the reduced (d64/d128) harnesses of this tree
#                    and of .baseline (git archive of the previous commit), in parallel; then the test
#   round.sh bench   compare.sh's same-run benchmark (two rounds, order alternating), sanitizers
set -uo pipefail
root="$(cd "$(dirname "$0")/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
case "${1:?build or bench}" in
  build)
    start=$(date +%s)
    (ARCHS=90a tests/cuda_harness/device_round.sh bwd_build > "$OUT/full_build.txt" 2>&1) &
    (BWD_ONLY=1 ROUNDS=0 tests/cuda_harness/compare.sh .baseline 64 128 > "$OUT/compare_build.txt" 2>&1) &
    wait
    echo "built in $(( $(date +%s) - start ))s"; cat "$OUT/full_build.txt"; grep -i "fail" "$OUT/compare_build.txt"
    grep -h -A2 "Compiling entry function.*bwd_dkdv_kernel_sm90" build/cuda_harness_dev/bwd/*.o.log | grep -E "spill" | sort | uniq -c
    tests/cuda_harness/device_round.sh bwd_test
    grep -E "dropout|softcap" "$OUT/bwd_test.log" | grep -E " sm90$" | head -40 ;;
  bench)
    SKIP_BUILD=1 BWD_ONLY=1 ROUNDS=2 tests/cuda_harness/compare.sh .baseline 64 128 2>&1 | tail -30
    bin=build/cuda_harness_dev/bwd/bwd_harness
    for tool in memcheck racecheck; do
      for cfg in "128 1 333 2 0 0" "128 1 333 2 1 0.1" "64 2 200 3 1 0.17"; do
        timeout 150 compute-sanitizer --tool $tool $bin bench1 bf16 $cfg > "$OUT/san.log" 2>&1
        echo "$tool $cfg: $(tail -1 "$OUT/san.log")"
      done
    done
    # dropout and soft-capping at the benchmark shape (b4 s4k h16 d128; b16 s1k h12 d64, the model's)
    for fam in default sm80; do
      for cfg in "128 4 4096 16 0 0" "128 4 4096 16 0 0.1" "128 4 4096 16 0 0 20 30" "64 16 1024 12 0 0" \
                 "64 16 1024 12 0 0.1" "64 16 1024 12 0 0 20 30"; do
        set -- $cfg; [ $# = 6 ] && cfg="$cfg 20"
        echo "$fam $cfg: $(env $([ $fam = sm80 ] && echo TF_FLASH_CUDA_FAMILY=sm80) $bin bench1 bf16 $cfg 2>&1 | tail -1)"
      done
    done ;;
esac
