#!/usr/bin/env bash
# Round 16 in the CUDA harness (no TensorFlow): the Hopper forward's P in two register buffers (kDoubleBufferP,
# so that the wait for P V comes after the softmax) and P converted straight into its operand registers, against
# the forward before (HEAD's sources of round 15, carried in build/oldtree) and against this round's code with one
# buffer of P (-DTF_FLASH_SM90_DOUBLE_BUFFER_P=0).
#   round.sh a      build the three, the quick test, ncu of d128 for each
#   round.sh bench  benchmarks interleaved (before, one buffer, two), two runs
#   round.sh b      the full forward test, memcheck and racecheck (quick cases)
#   round.sh det    HEAD's Hopper backward (this round's sources; d64 and d128 only): the deterministic case that did
#                   not repeat in round bwd, eight times, then under racecheck and synccheck
#   round.sh bwd    the backward test and benchmarks against HEAD's backward. It measured a change that was not
#                   committed (0.89-0.98x): the plain Hopper backward exponentiating P^T before its wait for dP^T
#                   (the mask's zeros applied after, in a block of their own, so that ptxas keeps the wait after the
#                   exponentials); on the committed sources the two builds are the same kernels.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
mkdir -p /tmp/cutlass && tar -xzf .gpu_build/cutlass_include.tgz -C /tmp/cutlass && export CUTLASS_INCLUDE=/tmp/cutlass/include
new=build/cuda_harness_dev/fwd_harness one=build/cuda_harness_one/fwd_harness old=build/cuda_harness_old/fwd_harness
build_new() { [ -x $new ] || ARCHS=90a VARIANTS=0 JOBS=${1:-16} PTXAS_VERBOSE=1 tests/cuda_harness/build.sh build/cuda_harness_dev \
  > "$OUT/fwd_build.log" 2>&1 || { echo "forward build failed"; grep -E " error|error:" "$OUT/fwd_build.log" | head; exit 1; }; }
build_one() { [ -x $one ] || ARCHS=90a VARIANTS=0 JOBS=${1:-6} EXTRA_NVCC_FLAGS=-DTF_FLASH_SM90_DOUBLE_BUFFER_P=0 \
  tests/cuda_harness/build.sh build/cuda_harness_one > "$OUT/one_build.log" 2>&1 || echo "one-buffer build failed"; }
build_old() { [ -x $old ] || ARCHS=90a VARIANTS=0 JOBS=${1:-6} build/oldtree/tests/cuda_harness/build.sh build/cuda_harness_old \
  > "$OUT/old_build.log" 2>&1 || echo "old build failed"; }
build_all() { build_new 6 & build_one 5 & build_old 5 & wait; }
summarize() { PYTHONPATH="$here/../../tf_gpu_round15/harness" python3 - "$OUT"; }  # round 15 summarize.py: load/remove
case "${1:?a, bench or b}" in
  a)
    start=$(date +%s)
    build_all
    echo "built in $(( $(date +%s) - start ))s"
    grep -E "Compiling entry function .*flash_fwd_kernel_sm90|spill stores" "$OUT/fwd_build.log" | grep -A1 sm_90a |
      sed 's/.*FwdTraitsSm90I//; s/EEvNS0.*//' | paste - - | sed -E 's/\s+.* ([0-9]+) bytes spill stores.*/ \1 bytes of spill stores/' |
      sort -u > "$OUT/spills.txt"
    grep -c C7514 "$OUT/fwd_build.log" | sed 's/^/wgmma serialization warnings: /' >> "$OUT/spills.txt"
    timeout 120 $new test quick > "$OUT/test_quick.log" 2>&1; echo "quick test rc $?: $(tail -1 "$OUT/test_quick.log")"
    grep FAIL "$OUT/test_quick.log" | head -5
    # ncu of d128 (b4 s4k h16 bf16, non-causal; clocks left alone): tensor pipe, issue, stalls, instructions
    for kind in old one new; do
      bin=$(eval echo \$$kind)
      echo "== $kind"
      timeout 100 ncu --clock-control none --kernel-name regex:flash_fwd_kernel_sm90 --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
        --metrics regex:sm__pipe_tensor.*cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__inst_executed_pipe_xu.sum \
        $bin one 128 0 4096 2>&1 | grep -E "Duration|Throughput|pipe_tensor|inst_executed|Issue|Stall|Warp Cycles Per|Executed Ipc|SM Busy" |
        awk '{$1=$1; print}' | cut -c1-130
    done > "$OUT/ncu_d128.txt" 2>&1
    cat "$OUT/ncu_d128.txt" | head -80 ;;
  bench)
    build_all
    for r in 1 2; do
      for kind in old one new; do
        bin=$(eval echo \$$kind)
        timeout 100 $bin bench 64 128 256 > "$OUT/bench_${kind}_$r.txt" 2>&1 || echo "bench $kind $r failed"
      done
    done
    summarize <<'PY'
import sys
from summarize import load, remove
out = sys.argv[1]
kinds = ("old", "one", "new")
rows = load(out, kinds)
remove(out)
with open(f"{out}/summary_bench.txt", "w") as fh:
    print("dtype d causal seqlen | TFLOP/s (max of 2 runs): before | one P buffer | two (this round) | this/before", file=fh)
    for key in sorted(rows):
        v = rows[key]
        print(*key, "|", *(f"{v.get(k, 0):.0f}" for k in kinds), "|", f"{v['new'] / v['old']:.3f}", file=fh)
PY
    cat "$OUT/summary_bench.txt" ;;
  det)
    NVCC_ARCHS=90a JOBS=16 BUILD_ONLY=1 EXTRA_FLAGS=-DTF_FLASH_CUDA_REDUCED BWD_BUILD=build/bwd_det \
      tests/cuda_harness/run_bwd_harness.sh > "$OUT/det_build.log" 2>&1 || { echo "backward build failed"; exit 1; }
    export BWD_TEST_FILTER="deterministic causal GQA d128"
    for i in 1 2 3 4 5 6 7 8; do echo "run $i: $(timeout 60 build/bwd_det/bwd_harness test 2>&1 | grep -E "FAIL|cases" | cut -c1-150 | tr '\n' ' ')"; done | tee "$OUT/det_repeats.txt"
    for tool in racecheck synccheck; do
      timeout 150 compute-sanitizer --tool $tool build/bwd_det/bwd_harness test > "$OUT/det_$tool.log" 2>&1; echo "$tool: $(tail -1 "$OUT/det_$tool.log")"
    done ;;
  bwd)
    start=$(date +%s)
    (NVCC_ARCHS=90a JOBS=8 BUILD_ONLY=1 BWD_BUILD=build/bwd_new tests/cuda_harness/run_bwd_harness.sh > "$OUT/bwd_build_new.log" 2>&1 ||
       echo "new backward build failed") &
    (NVCC_ARCHS=90a JOBS=8 BUILD_ONLY=1 BWD_BUILD=$root/build/bwd_old build/oldtree/tests/cuda_harness/run_bwd_harness.sh \
       > "$OUT/bwd_build_old.log" 2>&1 || echo "old backward build failed") &
    wait; echo "built in $(( $(date +%s) - start ))s"
    timeout 300 build/bwd_new/bwd_harness test > "$OUT/bwd_test.log" 2>&1; echo "backward test rc $?: $(tail -1 "$OUT/bwd_test.log")"
    grep FAIL "$OUT/bwd_test.log" | head -5
    for r in 1 2; do
      for kind in old new; do
        BWD_BENCH_DTYPE=bf16 timeout 150 build/bwd_$kind/bwd_harness bench 64 128 > "$OUT/bwdbench_${kind}_$r.txt" 2>&1 || echo "bench $kind $r failed"
      done
    done
    python3 - "$OUT" <<'PY'
import collections, sys
out = sys.argv[1]
rows = collections.defaultdict(dict)
for kind in ("old", "new"):
    for r in (1, 2):
        for line in open(f"{out}/bwdbench_{kind}_{r}.txt"):
            f = [x.strip() for x in line.split("|")]
            if len(f) > 9 and f[1] in ("bf16", "fp16"):
                key = (f[1], int(f[2]), f[3], int(f[5]))
                rows[key][kind] = max(rows[key].get(kind, 0.0), float(f[9]))
with open(f"{out}/summary_bwd.txt", "w") as fh:
    print("dtype d causal seqlen | backward TFLOP/s (max of 2 runs): before | now | now/before", file=fh)
    for key in sorted(rows):
        v = rows[key]
        print(*key, "|", f"{v['old']:.0f} | {v['new']:.0f} | {v['new'] / v['old']:.3f}", file=fh)
PY
    rm -f "$OUT"/bwdbench_*.txt
    cat "$OUT/summary_bwd.txt" ;;
  b)
    build_new
    timeout 280 $new test > "$OUT/test.log" 2>&1; echo "test rc $?: $(tail -1 "$OUT/test.log")"; grep FAIL "$OUT/test.log" | head -5
    for tool in memcheck racecheck; do
      timeout 130 compute-sanitizer --tool $tool $new test quick > "$OUT/$tool.log" 2>&1; echo "$tool: $(tail -1 "$OUT/$tool.log")"
    done ;;
esac
