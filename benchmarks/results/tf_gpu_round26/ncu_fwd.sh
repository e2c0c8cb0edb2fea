#!/usr/bin/env bash
# Round 26 (session 25), one device command, no TensorFlow (about 4 minutes): ncu of the default Hopper forward as it
# ships after round 24 (lazy rescaling, the exponent vote), bf16, non-causal, hidden 2048, b x s = 16k, to name what
# the two missed cells of issue 15 are bound by: d128 at 4k (593 TFLOP/s through TF against >= 600) beside d128 at
# 16k (647, the same kernel with four times the key tiles per query tile), and d64 at 4k (425 against >= 430).
# Per kernel: the SpeedOfLight, WarpStateStats, ComputeWorkloadAnalysis and SourceCounters sections, the tensor
# pipe's active cycles, and the per-instruction samples (CSV, gzipped), summed by summarize_ncu.py.
#   OUT=... bash ncu_fwd.sh   (carry .gpu_build)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
source benchmarks/results/round_lib.sh
start=$(date +%s)
build_fwd build/fwd_base || exit 1
echo "built in $(( $(date +%s) - start ))s"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
for shape in "128 4096" "128 16384" "64 4096"; do
  set -- $shape
  name=d$1_s$2
  timeout 150 ncu --clock-control none --kernel-name regex:flash_fwd_kernel_sm90 --launch-skip 4 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section SourceCounters \
    --section MemoryWorkloadAnalysis --section LaunchStats \
    --metrics regex:sm__pipe_tensor.*cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,sm__cycles_active.avg \
    --import-source yes -o /tmp/ncu_$name -f build/fwd_base/fwd_harness one $1 0 $2 > /tmp/ncu_${name}_run.log 2>&1 ||
    { echo "ncu $name rc $?"; tail -5 /tmp/ncu_${name}_run.log; }
  ncu -i /tmp/ncu_$name.ncu-rep --page details > /tmp/ncu_${name}_details.txt 2>&1
  { echo "== $name"; grep -E "Duration|Throughput|pipe_tensor|inst_executed|cycles_active|Issue|Warp Cycles Per|Executed Ipc|SM Busy|Registers|Local|L2 Hit|Grid Size|Block Size|Waves" \
      /tmp/ncu_${name}_details.txt | awk '{$1=$1; print}' | cut -c1-140; } >> "$OUT/ncu_summary.txt"
  ncu -i /tmp/ncu_$name.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > "$OUT/ncu_${name}_sass.csv.gz"
done
python3 "$here/summarize_ncu.py" "$OUT"/ncu_*_sass.csv.gz | tee "$OUT/ncu_stalls.txt"
cat "$OUT/ncu_summary.txt"
echo "total $(( $(date +%s) - start ))s"
