#!/usr/bin/env bash
# Round 15 in the CUDA harness (no TensorFlow): the persistent Hopper forward (a CTA per SM running query tiles
# one after another, FwdScheduleSm90) with its TMA-store epilogue, against the forward before it (round 14's
# sources, carried in build/oldtree) and against itself with a CTA per tile (TF_FLASH_SM90_FORWARD_SCHEDULE=tiles).
#   round.sh a   build both harnesses (spill report), the quick test under both schedules, benchmarks interleaved
#   round.sh b   the full forward test, memcheck and racecheck (quick cases)
#   round.sh l2, c, ncu, order: the schedule study, the launch rule, ncu of d128, d128 with the new kernels first
# l2 and c measured switches that were never committed: l2 an environment variable TF_FLASH_SM90_L2_BYTES read by
# make_fwd_schedule (the L2 budget of a head group), c a -DTF_FLASH_SM90_OUTPUT_IN_Q that put d128's O in Q's
# buffer. On the committed sources neither has an effect, so those two modes do not reproduce their summaries.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
mkdir -p /tmp/cutlass && tar -xzf .gpu_build/cutlass_include.tgz -C /tmp/cutlass && export CUTLASS_INCLUDE=/tmp/cutlass/include
new=build/cuda_harness_dev/fwd_harness old=build/cuda_harness_old/fwd_harness
build_old() { [ -x $old ] || ARCHS=90a VARIANTS=0 JOBS=${1:-6} build/oldtree/tests/cuda_harness/build.sh build/cuda_harness_old \
  > "$OUT/old_build.log" 2>&1 || echo "old build failed"; }
summarize() { PYTHONPATH="$here" python3 - "$OUT"; }  # a heredoc's script with summarize.py's load/remove
build_new() { ARCHS=90a VARIANTS=0 JOBS=${1:-16} PTXAS_VERBOSE=1 tests/cuda_harness/build.sh build/cuda_harness_dev > "$OUT/fwd_build.log" 2>&1 ||
  { echo "forward build failed"; grep -E " error|error:" "$OUT/fwd_build.log" | head; exit 1; }; }
case "${1:?a or b}" in
  a)
    start=$(date +%s)
    build_new 10 &
    build_old 6 &
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
    summarize <<'PY'
import sys
from summarize import load
rows = load(sys.argv[1], ("old", "tiles", "new"))
print("dtype d causal seqlen | TFLOP/s old tiles new (max of 2 runs) | new/old")
for key in sorted(rows):
    v = rows[key]
    print(*key, "|", *(f"{v.get(k, 0):.0f}" for k in ("old", "tiles", "new")), "|", f"{v.get('new', 0) / max(v.get('old', 1), 1):.3f}")
PY
    ;;
  l2)  # the schedule's head groups (L2 bytes a group's K/V may take; 1: one head per group, the old order)
    build_new 10 &
    build_old 6
    wait; echo "built"
    for r in 1 2; do
      timeout 100 $old bench 64 128 256 > "$OUT/bench_old_$r.txt" 2>&1 || echo "bench old $r failed"
      for l2 in 33554432 8388608 1; do
        for sched in tiles persistent; do
          TF_FLASH_SM90_FORWARD_SCHEDULE=$sched TF_FLASH_SM90_L2_BYTES=$l2 timeout 100 $new bench 64 128 256 \
            > "$OUT/bench_${sched}_${l2}_$r.txt" 2>&1 || echo "bench $sched $l2 $r failed"
        done
      done
    done
    summarize <<'PY'
import sys
from summarize import load, remove
out = sys.argv[1]
kinds = ["old"] + [f"{s}_{l}" for l in ("33554432", "8388608", "1") for s in ("tiles", "persistent")]
rows = load(out, kinds)
with open(f"{out}/l2_summary.txt", "w") as fh:
    print("dtype d causal seqlen | old | tiles/persistent at L2 32M, 8M, one head (max of 2 runs, TFLOP/s)", file=fh)
    for key in sorted(rows):
        print(*key, "|", *(f"{rows[key].get(k, 0):.0f}" for k in kinds), file=fh)
remove(out)
PY
    cat "$OUT/l2_summary.txt" ;;
  c)  # the launch rule (persistent, or a CTA per tile for long causal work); O in Q's buffer at d128 too (the
      # d128 kernel's loss against the old one at long non-causal work: its own O buffer, 32 KB more shared memory?)
    build_new 8 &
    (ARCHS=90a VARIANTS=0 JOBS=6 EXTRA_NVCC_FLAGS=-DTF_FLASH_SM90_OUTPUT_IN_Q tests/cuda_harness/build.sh build/cuda_harness_oq \
       > "$OUT/oq_build.log" 2>&1 || echo "oq build failed") &
    build_old 4
    wait; echo "built"
    timeout 100 $new test quick > "$OUT/test_quick.log" 2>&1; echo "quick test rc $?: $(tail -1 "$OUT/test_quick.log")"
    for r in 1 2; do
      timeout 100 $old bench 64 128 256 > "$OUT/bench_old_$r.txt" 2>&1 || echo "bench old $r failed"
      timeout 100 $new bench 64 128 256 > "$OUT/bench_new_$r.txt" 2>&1 || echo "bench new $r failed"
      timeout 100 build/cuda_harness_oq/fwd_harness bench 128 > "$OUT/bench_oq_$r.txt" 2>&1 || echo "bench oq $r failed"
    done
    summarize <<'PY'
import sys
from summarize import load, remove
out = sys.argv[1]
kinds = ["old", "new", "oq"]
rows = load(out, kinds)
with open(f"{out}/rule_summary.txt", "w") as fh:
    print("dtype d causal seqlen | TFLOP/s (max of 2 runs): before | this round | d128 with O in Q's buffer | this/before", file=fh)
    for key in sorted(rows):
        v = rows[key]
        print(*key, "|", *(f"{v.get(k, 0):.0f}" for k in kinds), "|", f"{v['new'] / v['old']:.3f}", file=fh)
remove(out)
PY
    cat "$OUT/rule_summary.txt" ;;
  order)  # d128 again with this round's kernels first in each pair (round c ran the old ones first)
    build_new 10 &
    build_old 6
    wait; echo "built"
    for r in 1 2; do
      timeout 100 $new bench 128 > "$OUT/bench_new_$r.txt" 2>&1 || echo "bench new $r failed"
      timeout 100 $old bench 128 > "$OUT/bench_old_$r.txt" 2>&1 || echo "bench old $r failed"
    done
    summarize <<'PY'
import sys
from summarize import load, remove
out = sys.argv[1]
rows = load(out, ("new", "old"))
with open(f"{out}/order_summary.txt", "w") as fh:
    print("dtype d causal seqlen | TFLOP/s (max of 2 runs; this round's kernels first): now | before | now/before", file=fh)
    for key in sorted(rows):
        v = rows[key]
        print(*key, "|", f"{v['new']:.0f} | {v['old']:.0f} | {v['new'] / v['old']:.3f}", file=fh)
remove(out)
PY
    cat "$OUT/order_summary.txt" ;;
  ncu)  # the d128 kernel's loss against the old one on long non-causal work (b4 s4k h16 bf16): ncu of both, and
        # where the new plain kernel's spill sits in its SASS
    build_new 10 &
    build_old 6
    wait; echo "built"
    metrics=gpu__time_duration.sum,smsp__inst_executed.sum,smsp__inst_executed_op_local_ld.sum,smsp__inst_executed_op_local_st.sum,dram__bytes.sum,lts__t_sector_hit_rate.pct,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,smsp__cycles_active.avg
    for kind in old new; do
      echo "== $kind"
      timeout 150 ncu --kernel-name regex:flash_fwd_kernel_sm90 --launch-skip 2 --launch-count 1 --section WarpStateStats \
        --metrics $metrics build/cuda_harness_$([ $kind = old ] && echo old || echo dev)/fwd_harness one 128 0 4096 2>&1 |
        grep -E "gpu__time|smsp__inst|dram__bytes|lts__t_sector|gmma|cycles_active|Stall|Warp Cycles Per" | awk '{$1=$1; print}' | cut -c1-120
    done | tee "$OUT/ncu_d128.txt"
    for kind in old dev; do
      cuobjdump -sass build/cuda_harness_$kind/flash_fwd_sm90_bf16_hdim128.o | python3 -c '
import re, sys
fn = None; out = {}
for line in sys.stdin:
    m = re.search(r"Function : (\S+)", line)
    if m: fn = m.group(1); out[fn] = []; continue
    if fn: out[fn].append(line.rstrip())
for fn, lines in out.items():
    if "Lb0ELb0E" not in fn: continue
    ins = [l for l in lines if re.search(r"/\*[0-9a-f]{4}\*/", l)]
    print(fn[-60:], "instructions", len(ins), "HGMMA", sum("HGMMA" in l for l in ins), "LDL", sum(" LDL" in l for l in ins), "STL", sum(" STL" in l for l in ins))
    for i, l in enumerate(ins):
        if " LDL" in l or " STL" in l:
            print("  @%d/%d" % (i, len(ins)), l.strip()[:100])
' > "$OUT/sass_spills_$kind.txt"; done
    cat "$OUT"/sass_spills_*.txt | head -40 ;;
  b)
    [ -x $new ] || build_new
    timeout 280 $new test > "$OUT/test.log" 2>&1; echo "test rc $?: $(tail -1 "$OUT/test.log")"; grep FAIL "$OUT/test.log" | head -5
    for tool in memcheck racecheck; do
      timeout 130 compute-sanitizer --tool $tool $new test quick > "$OUT/$tool.log" 2>&1; echo "$tool: $(tail -1 "$OUT/$tool.log")"
    done ;;
esac
