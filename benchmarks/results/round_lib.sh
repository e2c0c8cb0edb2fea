# Helpers shared by the device rounds' scripts (from round 19 on; rounds 15-18 keep their own copies as run):
# source it from a round script after setting root (the repository) and OUT.
#   build_bwd DIR JOBS "FLAGS" [TREE]   the backward harness (sm_90a only) of TREE (default: this one) into DIR
#   variant_bwd FROM TO "FLAGS" "FILES"  a copy of build FROM with FILES (instantiation .cu names) recompiled with FLAGS
#   ncu_bwd BIN NAME SHAPE...           ncu of one Hopper backward (bench1 SHAPE): summary and per-instruction samples
#   bwd_summary "KINDS" "TITLE"         max TFLOP/s per shape over $OUT/bwdbench_KIND_RUN.txt, ratios to the first kind
#   with_tf                             (TF rounds, after the stash) the library built, TensorFlow's environment set
#   build_fwd DIR                       the forward harness (sm_90a, no tile variants) into DIR, log in $OUT
#   model_step NAME MODE LENGTH         (TF rounds) one bench_model.py process, its line appended to $OUT/steps.txt
#   variant_fwd FROM TO "FLAGS" "FILES"  a copy of a forward harness build (tests/cuda_harness/build.sh, sm_90a) with
#                                       FILES (instantiation .cu names) recompiled with FLAGS, relinked
#   fwd_summary "KINDS" "TITLE"         max TFLOP/s per shape over $OUT/fwdbench_KIND_RUN.txt, ratios to the first kind
#   harness_tests fwd|bwd SECONDS KIND...  the `test` of each build build/WHICH_KIND at once, into $OUT/test_KIND.log;
#                                       then their failing lines (from round 25 on)
#   harness_bench fwd|bwd RUNS SECONDS "KINDS" ARGS...  `bench ARGS` of each build in turn, RUNS times, into
#                                       $OUT/WHICHbench_KIND_RUN.txt (fwd_summary's and bwd_summary's input)
cutlass_headers() {  # the CUTLASS headers the harness builds need, unpacked once per machine
  [ -d /tmp/cutlass/include ] || { mkdir -p /tmp/cutlass && tar -xzf "$root/.gpu_build/cutlass_include.tgz" -C /tmp/cutlass; }
  export CUTLASS_INCLUDE=/tmp/cutlass/include
}
with_tf() {
  bash "$root/scripts/gpu_round.sh" device none > /dev/null 2>&1
  source "$root/.gpu/env/env.sh" > /dev/null 2>&1
  export TF_FLASH_LIBRARY=$root/build/gpu/_flash_attention_ops.so PYTHONPATH=$root:${PYTHONPATH:-}
}
build_bwd() {
  cutlass_headers
  (NVCC_ARCHS=90a JOBS=$2 BUILD_ONLY=1 EXTRA_FLAGS="$3" BWD_BUILD=$root/$1 ${4:-$root}/tests/cuda_harness/run_bwd_harness.sh \
    > "$OUT/$(basename $1)_build.log" 2>&1) || { echo "backward build $1 failed"; grep -E "error" "$OUT/$(basename $1)_build.log" | head; }
}
variant_bwd() {
  cutlass_headers
  rm -rf "$root/$2" && cp -r "$root/$1" "$root/$2"
  (NVCC_ARCHS=90a JOBS=8 BUILD_ONLY=1 EXTRA_FLAGS="$3" RECOMPILE="$4" BWD_BUILD=$root/$2 \
    $root/tests/cuda_harness/run_bwd_harness.sh > "$OUT/$(basename $2)_build.log" 2>&1) ||
    { echo "backward variant $2 failed"; grep -E "error" "$OUT/$(basename $2)_build.log" | head; }
}
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
bench_summary() {  # bench_summary fwd|bwd "KINDS" "TITLE": the two harnesses' tables, one parser each
  python3 - "$OUT" "$1" "$2" "$3" <<'PY'
import collections, glob, re, sys
out, which, kinds, title = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4]
rows = collections.defaultdict(dict)
for path in glob.glob(f"{out}/{which}bench_*.txt"):
    kind = re.match(rf".*{which}bench_([a-z0-9]+)_\d\.txt", path).group(1)
    for line in open(path):
        if which == "bwd":  # | dtype | d | causal | ... | seqlen | ... | TFLOP/s |
            f = [x.strip() for x in line.split("|")]
            ok, key, value = len(f) > 9 and f[1] in ("bf16", "fp16"), (1, 2, 3, 5), 9
        else:  # dtype d causal batch seqlen med_ms min_ms max_ms TFLOP/s kernel
            f = line.split()
            ok, key, value = len(f) == 10 and f[0] in ("bf16", "fp16"), (0, 1, 2, 4), 8
        if ok:
            k = (f[key[0]], int(f[key[1]]), f[key[2]], int(f[key[3]]))
            rows[k][kind] = max(rows[k].get(kind, 0.0), float(f[value]))
name = {"fwd": "forward", "bwd": "backward"}[which]
with open(f"{out}/summary_{which}.txt", "w") as fh:
    print(f"dtype d causal seqlen | {name} TFLOP/s (max of runs):", title, "| each / first", file=fh)
    for key in sorted(rows):
        v = rows[key]
        ref = v.get(kinds[0], 0) or 1
        print(*key, "|", " | ".join(f"{v.get(k, 0):.0f}" for k in kinds), "|",
              " ".join(f"{v.get(k, 0) / ref:.3f}" for k in kinds[1:]), file=fh)
PY
  rm -f "$OUT"/"$1"bench_*.txt
  cat "$OUT/summary_$1.txt"
}
bwd_summary() { bench_summary bwd "$1" "$2"; }
fwd_summary() { bench_summary fwd "$1" "$2"; }
build_fwd() {
  cutlass_headers
  ARCHS=90a VARIANTS=0 JOBS=16 "$root/tests/cuda_harness/build.sh" "$root/$1" > "$OUT/$(basename $1)_build.log" 2>&1 ||
    { tail -20 "$OUT/$(basename $1)_build.log"; return 1; }
}
model_step() {  # the Keras training step: FlashMHA or Keras' MHA at one length, 4 blocks (bench_model.py's defaults)
  mkdir -p "/tmp/models/$1"
  timeout 110 python3 "$root/benchmarks/bench_model.py" --out-dir "/tmp/models/$1" --modes "$2" --lengths "$3" \
    --xla-autotune-cache /tmp/xla_cache --time-limit 100 > "/tmp/models/$1.log" 2>&1
  echo "$1: $(grep -E "$2 .*ms/step" "/tmp/models/$1.log" | cut -c1-150)" | tee -a "$OUT/steps.txt"
  tar -czf "$OUT/models.tgz" -C /tmp models
}
variant_fwd() {
  cutlass_headers
  rm -rf "$root/$2" && cp -r "$root/$1" "$root/$2"
  local f
  for f in $4; do
    nvcc -std=c++17 --expt-relaxed-constexpr -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -I"$root" \
      -I"$CUTLASS_INCLUDE" $3 -Xptxas -warn-spills -c "$root/cc/kernels/cuda/$f" -o "$root/$2/$(basename "$f" .cu).o" \
      > "/tmp/$(basename $2)_$(basename "$f" .cu).log" 2>&1 &
  done
  wait
  for f in $4; do cat "/tmp/$(basename $2)_$(basename "$f" .cu).log"; done > "$OUT/$(basename $2)_build.log"
  nvcc -gencode=arch=compute_90a,code=sm_90a "$root/$2"/*.o -o "$root/$2/fwd_harness" ||
    echo "forward variant $2 failed"
}
harness_tests() {
  local which=$1 limit=$2 kind
  shift 2
  for kind; do
    (timeout "$limit" "$root/build/${which}_$kind/${which}_harness" test > "$OUT/test_$kind.log" 2>&1
     echo "$kind tests rc $?: $(tail -n 1 "$OUT/test_$kind.log")") &
  done
  wait
  grep -hE "FAIL|NOT REP" "$OUT"/test_*.log | head -8
}
harness_bench() {
  local which=$1 runs=$2 limit=$3 kinds=$4 r kind
  shift 4
  for r in $(seq "$runs"); do
    for kind in $kinds; do
      timeout "$limit" "$root/build/${which}_$kind/${which}_harness" bench "$@" \
        > "$OUT/${which}bench_${kind}_$r.txt" 2>&1 || echo "bench $kind failed"
    done
  done
}
