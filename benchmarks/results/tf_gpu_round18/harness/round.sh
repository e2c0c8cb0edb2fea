#!/usr/bin/env bash
# Round 18 in the CUDA harness (no TensorFlow).
#   round.sh w    the Hopper backward of three builds: the session's start (b9968d2, build/basetree), this tree
#                 (the plain variant at head dim 64 on 128-query tiles) and this tree with the dQ reduce-add
#                 deferred to the next step (-DTF_FLASH_SM90_BWD_DQ_DEFER=1): builds, this tree's full test,
#                 benchmarks interleaved, ncu of this tree's d64 kernel (per-instruction stall samples)
#   round.sh v    this tree (e82cf9e: both kept, the switch removed): full build, the full test, the deterministic
#                 cases twice more, compute-sanitizer on subsets (odd lengths, deterministic d64, MQA causal)
#   round.sh vb   after v: fp16 benchmarks against the session's start (build/basetree, rebuilt reduced), the
#                 general variant (dropout 0.1), ncu of the d128 and d64 kernels
#   round.sh p    each warp reduce-adds its own dQ rows (no barrier across the warpgroup) against 59b39f1
#                 (build/basetree): builds (this tree full, for its test), test, benchmarks interleaved; and the
#                 forward (reduced, -lineinfo): ncu of d128 and d64 with per-instruction stall samples
#   round.sh g    the backward's grid as one linear index with the key tiles slowest (the longest causal CTAs
#                 first) against 59b39f1 (build/basetree): builds, full test, benchmarks (also deterministic)
#   round.sh q    d64 (128-query tiles): the dQ GEMM split by query rows between the warpgroups (N = 64) instead of
#                 by head dim (N = 32), against the README commit (build/basetree): builds, full test, d64 benchmarks
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
mkdir -p /tmp/cutlass && tar -xzf .gpu_build/cutlass_include.tgz -C /tmp/cutlass && export CUTLASS_INCLUDE=/tmp/cutlass/include
build_bwd() {  # $1: build dir, $2: jobs, $3: extra flags, $4: tree (default: this one)
  (NVCC_ARCHS=90a JOBS=$2 BUILD_ONLY=1 EXTRA_FLAGS="$3" BWD_BUILD=$root/$1 ${4:-.}/tests/cuda_harness/run_bwd_harness.sh \
    > "$OUT/$(basename $1)_build.log" 2>&1) || { echo "backward build $1 failed"; grep -E "error" "$OUT/$(basename $1)_build.log" | head; }
}
# ncu of one backward: per-instruction stall samples, and the summary sections. $1 binary, $2 name, $3.. bench1 shape
ncu_bwd() {
  local bin=$1 name=$2; shift 2
  timeout 150 ncu --clock-control none --kernel-name regex:bwd_dkdv_kernel_sm90 --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section SourceCounters \
    --metrics regex:sm__pipe_tensor.*cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum \
    --import-source yes -o /tmp/ncu_$name -f $bin bench1 "$@" > /tmp/ncu_${name}_run.log 2>&1 || echo "ncu $name rc $?"
  ncu -i /tmp/ncu_$name.ncu-rep 2>&1 | grep -E "Duration|Throughput|pipe_tensor|inst_executed|Issue|Stall|Warp Cycles Per|Executed Ipc|SM Busy|Registers|Local" |
    awk '{$1=$1; print}' | cut -c1-140 > "$OUT/ncu_$name.txt"
  ncu -i /tmp/ncu_$name.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > "$OUT/ncu_${name}_sass.csv.gz"
}
bwd_summary() {  # $1: kinds (space separated, first = reference), $2: title
  python3 - "$OUT" "$1" "$2" <<'PY'
import collections, glob, re, sys
out, kinds, title = sys.argv[1], sys.argv[2].split(), sys.argv[3]
rows = collections.defaultdict(dict)
for path in glob.glob(f"{out}/bwdbench_*.txt"):
    kind = re.match(r".*bwdbench_([a-z0-9]+)_\d\.txt", path).group(1)
    for line in open(path):
        f = [x.strip() for x in line.split("|")]
        if len(f) > 9 and f[1] in ("bf16", "fp16"):
            key = (f[1], int(f[2]), f[3], int(f[5]))
            rows[key][kind] = max(rows[key].get(kind, 0.0), float(f[9]))
with open(f"{out}/summary_bwd.txt", "w") as fh:
    print("dtype d causal seqlen | backward TFLOP/s (max of runs):", title, "| each / first", file=fh)
    for key in sorted(rows):
        v = rows[key]
        ref = v.get(kinds[0], 0) or 1
        print(*key, "|", " | ".join(f"{v.get(k, 0):.0f}" for k in kinds), "|",
              " ".join(f"{v.get(k, 0) / ref:.3f}" for k in kinds[1:]), file=fh)
PY
  rm -f "$OUT"/bwdbench_*.txt
  cat "$OUT/summary_bwd.txt"
}
case "${1:?w, v or vb}" in
  v)
    start=$(date +%s)
    build_bwd build/bwd_new 11 "-lineinfo" & build_bwd build/bwd_base 5 "-DTF_FLASH_CUDA_REDUCED" build/basetree & wait
    echo "built in $(( $(date +%s) - start ))s"
    grep -h "bwd_dkdv_kernel_sm90" -A2 "$OUT/bwd_new_build.log" | grep -E "spill" | sort | uniq -c
    timeout 200 build/bwd_new/bwd_harness test > "$OUT/bwd_test.log" 2>&1; echo "backward test rc $?: $(tail -n 1 "$OUT/bwd_test.log")"
    grep -E "FAIL|NOT REP" "$OUT/bwd_test.log" | head -5
    for i in 1 2; do
      echo "deterministic cases, run $i: $(BWD_TEST_FILTER=deterministic timeout 100 build/bwd_new/bwd_harness test 2>&1 |
        tee "$OUT/det_$i.log" | grep -cE "FAIL|NOT REP") failing; $(tail -n 1 "$OUT/det_$i.log")"
    done
    for run in "racecheck:odd lengths" "memcheck:deterministic d64" "racecheck:deterministic d64" "racecheck:MQA 8/1 causal" "memcheck:q/kv lengths, NaN"; do
      [ $(( $(date +%s) - start )) -gt 520 ] && { echo "no time left for $run"; continue; }
      tool=${run%%:*} filter=${run#*:}
      BWD_TEST_FILTER="$filter" timeout 90 compute-sanitizer --tool $tool build/bwd_new/bwd_harness test > "$OUT/san_$tool.log" 2>&1
      echo "$tool [$filter]: $(grep -E "cases failed" "$OUT/san_$tool.log" | tail -n 1); $(tail -n 1 "$OUT/san_$tool.log")"
    done
    echo "total $(( $(date +%s) - start ))s" ;;
  p)
    start=$(date +%s)
    build_bwd build/bwd_new 8 "" & build_bwd build/bwd_base 4 "-DTF_FLASH_CUDA_REDUCED" build/basetree &
    (REDUCED=1 ARCHS=90a VARIANTS=0 JOBS=4 tests/cuda_harness/build.sh build/fwd_prof > "$OUT/fwd_build.log" 2>&1 ||
      echo "forward build failed") & wait
    echo "built in $(( $(date +%s) - start ))s"
    timeout 200 build/bwd_new/bwd_harness test > "$OUT/bwd_test.log" 2>&1; echo "backward test rc $?: $(tail -n 1 "$OUT/bwd_test.log")"
    grep -E "FAIL|NOT REP" "$OUT/bwd_test.log" | head -5
    echo "deterministic: $(BWD_TEST_FILTER=deterministic timeout 100 build/bwd_new/bwd_harness test 2>&1 | tail -n 1)"
    for r in 1 2 3; do
      for kind in new base; do
        BWD_BENCH_DTYPE=bf16 timeout 60 build/bwd_$kind/bwd_harness bench 64 128 > "$OUT/bwdbench_${kind}_$r.txt" 2>&1 || echo "bench $kind failed"
      done
    done
    bwd_summary "base new" "59b39f1 | per-warp dQ reduce-adds" | grep -v " yes 512"
    for d in 128 64; do  # the forward: b4 s4k (d128 h16, d64 h32), bf16, non-causal
      timeout 120 ncu --clock-control none --kernel-name regex:flash_fwd_kernel_sm90 --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SourceCounters \
        --metrics regex:sm__pipe_tensor.*cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum \
        --import-source yes -o /tmp/ncu_fwd$d -f build/fwd_prof/fwd_harness one $d 0 4096 > /tmp/ncu_fwd${d}_run.log 2>&1 || echo "ncu fwd $d rc $?"
      ncu -i /tmp/ncu_fwd$d.ncu-rep 2>&1 | grep -E "Duration|pipe_tensor_cycles|inst_executed|Issue Slots|Warp Cycles Per|Registers" |
        awk '{$1=$1; print}' | cut -c1-140 > "$OUT/ncu_fwd$d.txt"
      ncu -i /tmp/ncu_fwd$d.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > "$OUT/ncu_fwd${d}_sass.csv.gz"
    done
    grep -E "Duration|pipe_tensor_cycles_active|inst_executed.sum" "$OUT"/ncu_fwd*.txt
    echo "total $(( $(date +%s) - start ))s" ;;
  g)
    start=$(date +%s)
    build_bwd build/bwd_new 10 "" & build_bwd build/bwd_base 6 "-DTF_FLASH_CUDA_REDUCED" build/basetree & wait
    echo "built in $(( $(date +%s) - start ))s"
    timeout 200 build/bwd_new/bwd_harness test > "$OUT/bwd_test.log" 2>&1; echo "backward test rc $?: $(tail -n 1 "$OUT/bwd_test.log")"
    grep -E "FAIL|NOT REP" "$OUT/bwd_test.log" | head -5
    echo "deterministic: $(BWD_TEST_FILTER=deterministic timeout 100 build/bwd_new/bwd_harness test 2>&1 | tail -n 1)"
    for r in 1 2 3; do
      for kind in new base; do
        BWD_BENCH_DTYPE=bf16 timeout 60 build/bwd_$kind/bwd_harness bench 64 128 > "$OUT/bwdbench_${kind}_$r.txt" 2>&1 || echo "bench $kind failed"
      done
    done
    bwd_summary "base new" "59b39f1 | key tiles slowest in the grid" | grep -v " yes 512"
    for kind in new base new base; do
      for c in 0 1; do
        echo "$kind deterministic d128 b4 s4k causal=$c: $(BWD_BENCH_DETERMINISTIC=1 timeout 60 build/bwd_$kind/bwd_harness bench1 bf16 128 4 4096 16 $c 2>&1 | tail -n 1)"
      done
    done
    echo "total $(( $(date +%s) - start ))s" ;;
  q)
    start=$(date +%s)
    build_bwd build/bwd_new 10 "" & build_bwd build/bwd_base 6 "-DTF_FLASH_CUDA_REDUCED" build/basetree & wait
    echo "built in $(( $(date +%s) - start ))s"
    timeout 200 build/bwd_new/bwd_harness test > "$OUT/bwd_test.log" 2>&1; echo "backward test rc $?: $(tail -n 1 "$OUT/bwd_test.log")"
    grep -E "FAIL|NOT REP" "$OUT/bwd_test.log" | head -5
    echo "deterministic: $(BWD_TEST_FILTER=deterministic timeout 100 build/bwd_new/bwd_harness test 2>&1 | tail -n 1)"
    for r in 1 2 3 4; do
      for kind in new base; do
        BWD_BENCH_DTYPE=bf16 timeout 60 build/bwd_$kind/bwd_harness bench 64 > "$OUT/bwdbench_${kind}_$r.txt" 2>&1 || echo "bench $kind failed"
      done
    done
    bwd_summary "base new" "README commit | dQ split by query rows" | grep -v " yes 512"
    echo "total $(( $(date +%s) - start ))s" ;;
  vb)
    start=$(date +%s)
    for r in 1 2 3; do
      for kind in new base; do
        BWD_BENCH_DTYPE=fp16 timeout 60 build/bwd_$kind/bwd_harness bench 64 128 > "$OUT/bwdbench_${kind}_$r.txt" 2>&1 || echo "bench $kind failed"
      done
    done
    bwd_summary "base new" "b9968d2 | this tree" | grep -v "^fp16 [0-9]* yes 512"
    for kind in new base new base; do  # dropout 0.1: the general variant (64-query tiles)
      echo "$kind general d128 b4 s4k: $(timeout 60 build/bwd_$kind/bwd_harness bench1 bf16 128 4 4096 16 0 0.1 20 2>&1 | tail -n 1)"
      echo "$kind general d64 b4 s4k: $(timeout 60 build/bwd_$kind/bwd_harness bench1 bf16 64 4 4096 32 0 0.1 20 2>&1 | tail -n 1)"
    done
    ncu_bwd build/bwd_new/bwd_harness d128 bf16 128 4 4096 16 0
    ncu_bwd build/bwd_new/bwd_harness d64 bf16 64 4 4096 32 0
    grep -E "Duration|pipe_tensor_cycles|inst_executed.sum|Issue Slots" "$OUT"/ncu_d*.txt
    echo "total $(( $(date +%s) - start ))s" ;;
  w)
    start=$(date +%s)
    build_bwd build/bwd_new 6 "-lineinfo" & build_bwd build/bwd_base 5 "-DTF_FLASH_CUDA_REDUCED" build/basetree &
    build_bwd build/bwd_defer 5 "-DTF_FLASH_CUDA_REDUCED -DTF_FLASH_SM90_BWD_DQ_DEFER=1" & wait
    echo "built in $(( $(date +%s) - start ))s"
    timeout 200 build/bwd_new/bwd_harness test > "$OUT/bwd_test.log" 2>&1; echo "backward test rc $?: $(tail -n 1 "$OUT/bwd_test.log")"
    grep -E "FAIL|NOT REP" "$OUT/bwd_test.log" | head -5
    for r in 1 2 3; do
      for kind in new defer base; do
        [ $(( $(date +%s) - start )) -gt 470 ] && break 2
        BWD_BENCH_DTYPE=bf16 timeout 60 build/bwd_$kind/bwd_harness bench 64 128 > "$OUT/bwdbench_${kind}_$r.txt" 2>&1 ||
          echo "bench $kind $r failed"
      done
    done
    bwd_summary "base new defer" "b9968d2 | d64 on 128-query tiles | + dQ reduce-add deferred"
    ncu_bwd build/bwd_new/bwd_harness new64 bf16 64 4 4096 32 0
    grep -E "Duration|pipe_tensor_cycles|inst_executed.sum|Issue Slots" "$OUT/ncu_new64.txt"
    echo "total $(( $(date +%s) - start ))s" ;;
esac
