#!/usr/bin/env bash
# Round 15 in the CUDA harness (no TensorFlow): the persistent Hopper forward (a CTA per SM running query tiles
# one after another, FwdScheduleSm90) with its TMA-store epilogue, against the forward before it (round 14's
# sources, carried in build/oldtree) and against itself with a CTA per tile (TF_FLASH_SM90_FORWARD_SCHEDULE=tiles).
#   round.sh a   build both harnesses (spill report), the quick test under both schedules, benchmarks interleaved
#   round.sh b   the full forward test, memcheck and racecheck (quick cases)
set -uo pipefail
root="$(cd "$(dirname "$0")/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
mkdir -p /tmp/cutlass && tar -xzf .gpu_build/cutlass_include.tgz -C /tmp/cutlass && export CUTLASS_INCLUDE=/tmp/cutlass/include
new=build/cuda_harness_dev/fwd_harness old=build/cuda_harness_old/fwd_harness
build_new() { ARCHS=90a VARIANTS=0 JOBS=${1:-16} PTXAS_VERBOSE=1 tests/cuda_harness/build.sh build/cuda_harness_dev > "$OUT/fwd_build.log" 2>&1 ||
  { echo "forward build failed"; grep -E " error|error:" "$OUT/fwd_build.log" | head; exit 1; }; }
case "${1:?a or b}" in
  a)
    start=$(date +%s)
    build_new 10 &
    (ARCHS=90a VARIANTS=0 JOBS=6 build/oldtree/tests/cuda_harness/build.sh build/cuda_harness_old > "$OUT/old_build.log" 2>&1 ||
       echo "old build failed") &
    wait
    echo "built in $(( $(date +%s) - start ))s"
    grep -E "Compiling entry function .*flash_fwd_kernel_sm90|spill stores" "$OUT/fwd_build.log" | grep -A1 sm_90a |
      sed 's/.*FwdTraitsSm90I//; s/EEvNS0.*//' | paste - - | awk '{print $1, $(NF-7), "spill"}' | sort -u | tee "$OUT/spills.txt"
    cuobjdump -sass build/cuda_harness_dev/flash_fwd_sm90_bf16_hdim64.o > "$OUT/sass_d64.txt" 2>/dev/null
    timeout 120 $new test quick > "$OUT/test_quick.log" 2>&1; echo "quick test rc $?: $(tail -1 "$OUT/test_quick.log")"
    grep FAIL "$OUT/test_quick.log" | head -5
    TF_FLASH_SM90_FORWARD_SCHEDULE=tiles timeout 120 $new test quick > "$OUT/test_quick_tiles.log" 2>&1
    echo "quick test, a CTA per tile, rc $?: $(tail -1 "$OUT/test_quick_tiles.log")"
    for r in 1 2; do
      timeout 100 $new bench 64 128 256 > "$OUT/bench_new_$r.txt" 2>&1 || echo "bench new $r failed"
      timeout 100 $old bench 64 128 256 > "$OUT/bench_old_$r.txt" 2>&1 || echo "bench old $r failed"
      TF_FLASH_SM90_FORWARD_SCHEDULE=tiles timeout 100 $new bench 64 128 256 > "$OUT/bench_tiles_$r.txt" 2>&1 || echo "bench tiles $r failed"
    done
    python3 - "$OUT" <<'PY'
import sys, collections
out = sys.argv[1]
rows = collections.defaultdict(dict)
for kind in ("old", "tiles", "new"):
    for r in (1, 2):
        for line in open(f"{out}/bench_{kind}_{r}.txt"):
            f = line.split()
            if len(f) >= 9 and f[0] in ("bf16", "fp16"):
                key = (f[0], int(f[1]), int(f[2]), int(f[4]))
                rows[key].setdefault(kind, []).append(float(f[8]))
print("dtype d causal seqlen | TFLOP/s old tiles new (max of 2 runs) | new/old")
for key in sorted(rows):
    v = {k: max(x) for k, x in rows[key].items()}
    print(*key, "|", *(f"{v.get(k, 0):.0f}" for k in ("old", "tiles", "new")), "|", f"{v.get('new', 0) / max(v.get('old', 1), 1):.3f}")
PY
    ;;
  b)
    [ -x $new ] || build_new
    timeout 280 $new test > "$OUT/test.log" 2>&1; echo "test rc $?: $(tail -1 "$OUT/test.log")"; grep FAIL "$OUT/test.log" | head -5
    for tool in memcheck racecheck; do
      timeout 130 compute-sanitizer --tool $tool $new test quick > "$OUT/$tool.log" 2>&1; echo "$tool: $(tail -1 "$OUT/$tool.log")"
    done ;;
esac
