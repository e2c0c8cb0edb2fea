#!/usr/bin/env bash
# One device round for the forward kernel: build (16 cores), test, benchmark, tile variants, profile.
# Usage on the GPU machine: tests/cuda_harness/device_round.sh [steps...]
#   steps: build sass test bigoffset fp32 bench bench80 tiles feat regs ncu sanitize racecheck torch, and for the
#   backward harness bwd_build bwd_test bwd_bench bwd_bench80 bwd_sanitize bwd_racecheck
#   (default: build test bigoffset bench tiles ncu sanitize). bench80: the benchmark with the forward held on
#   the sm_80 family (TF_FLASH_CUDA_FAMILY=sm80), for a same-run comparison with the Hopper family.
#   After `build`, tests/cuda_harness/sm90_tile_variants.sh compares Hopper forward tile configurations
#   of one head dim (benchmark and test per variant) in the same call.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp/out}"
bin="$root/build/cuda_harness_dev"
steps="${*:-build test bigoffset bench tiles ncu sanitize}"
for step in $steps; do
  echo "=== $step ($(date -u +%H:%M:%S))"
  case $step in
    build) ARCHS="${ARCHS:-90a}" JOBS=16 "$root/tests/cuda_harness/build.sh" "$bin" > "$out/build.log" 2>&1 ||
             { tail -30 "$out/build.log"; exit 1; }
           grep -h "spill" "$out/build.log" | sed 's/.*function .\(_Z[^ ]*\)., \(.*\)/\2  \1/' | cut -c1-160 ;;
    sass) for o in "$bin"/flash_fwd_sm90_bf16_hdim*.o; do
            echo "$(basename "$o"): $(cuobjdump -sass "$o" | grep -oE "HGMMA|USETMAXREG|UTMALDG|LDL|STL" | sort | uniq -c | tr '\n' ' ')"
          done ;;
    test) timeout 300 "$bin/fwd_harness" test > "$out/test.log" 2>&1; rc=$?; grep -E "FAIL|unsupported|passed" "$out/test.log" | tail -15
          [ $rc = 0 ] || echo "TEST FAILURES" ;;
    bigoffset) "$bin/fwd_harness" bigoffset ;;
    fp32) "$bin/fwd_harness" fp32 ;;
    bench) timeout 300 "$bin/fwd_harness" bench ${BENCH_DIMS:-64 128 256} > "$out/bench.log" 2>&1; cat "$out/bench.log" ;;
    bench80) TF_FLASH_CUDA_FAMILY=sm80 timeout 300 "$bin/fwd_harness" bench ${BENCH_DIMS:-64 128 256} > "$out/bench80.log" 2>&1
             cat "$out/bench80.log" ;;
    tiles) "$bin/fwd_harness" tiles 2>&1 | tee "$out/tiles.log" ;;
    feat) "$bin/fwd_harness" feat 2>&1 | tee "$out/feat.log" ;;
    regs) grep -A1 "Compiling entry function" "$out/build.log" | grep -o "_ZN8tf_flash[^']*\|Used [0-9]* registers" | paste - - | sed 's/_ZN8tf_flash4cuda16flash_fwd_kernelINS0_9FwdTraitsI//' | cut -c1-120 | sort -u ;;
    ncu) ncu --launch-skip 3 --launch-count 1 -k regex:flash_fwd --section SpeedOfLight --section Occupancy \
           --section WarpStateStats --section SchedulerStats --section LaunchStats --section ComputeWorkloadAnalysis \
           --section MemoryWorkloadAnalysis "$bin/fwd_harness" one 128 0 8192 > "$out/ncu.log" 2>&1
         grep -E "Duration|Throughput|Registers|Achieved Occupancy|Issue Slots Busy|No Eligible|Stall|Shared Memory Configuration|Block Limit|Eligible Warps|Executed Ipc" "$out/ncu.log" | head -40 ;;
    sanitize) timeout 300 compute-sanitizer --tool memcheck "$bin/fwd_harness" test quick > "$out/sanitize.log" 2>&1
              tail -3 "$out/sanitize.log" ;;
    racecheck) timeout 300 compute-sanitizer --tool racecheck "$bin/fwd_harness" test quick > "$out/racecheck.log" 2>&1
               tail -3 "$out/racecheck.log" ;;
    bwd_build) NVCC_ARCHS="${ARCHS:-90a}" BWD_BUILD="$bin/bwd" JOBS=16 BUILD_ONLY=1 \
                 "$root/tests/cuda_harness/run_bwd_harness.sh" > "$out/bwd_build.log" 2>&1 || { tail -30 "$out/bwd_build.log"; exit 1; } ;;
    bwd_test) timeout 300 "$bin/bwd/bwd_harness" test > "$out/bwd_test.log" 2>&1; rc=$?
              grep -E "FAIL|failed" "$out/bwd_test.log" | tail -15; echo "on the Hopper kernel: $(grep -c ' sm90$' "$out/bwd_test.log")"
              [ $rc = 0 ] || echo "BWD TEST FAILURES" ;;
    bwd_bench) timeout 300 "$bin/bwd/bwd_harness" bench ${BENCH_DIMS:-64 128} > "$out/bwd_bench.log" 2>&1; cat "$out/bwd_bench.log" ;;
    bwd_bench80) TF_FLASH_CUDA_FAMILY=sm80 timeout 300 "$bin/bwd/bwd_harness" bench ${BENCH_DIMS:-64 128} \
                 > "$out/bwd_bench80.log" 2>&1; cat "$out/bwd_bench80.log" ;;
    bwd_sanitize|bwd_racecheck)  # the Hopper backward on lengths off the tiles, plain and causal
              tool=$([ $step = bwd_sanitize ] && echo memcheck || echo racecheck)
              for cfg in "128 1 333 2 0" "128 1 333 2 1" "64 2 200 3 1"; do
                timeout 200 compute-sanitizer --tool $tool "$bin/bwd/bwd_harness" bench1 bf16 $cfg 0 > "$out/$step.log" 2>&1
                echo "$cfg: $(tail -1 "$out/$step.log")"
              done ;;
    torch) python3 "$root/tests/cuda_harness/torch_peer.py" 64 128 > "$out/torch.log" 2>&1; grep -c . "$out/torch.log" ;;
  esac
done
