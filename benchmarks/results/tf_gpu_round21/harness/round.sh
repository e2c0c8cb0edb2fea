#!/usr/bin/env bash
# Round 21 in the CUDA harness (prepared in round 20 as next_round.sh; ran on one H100, 2026-11-26, in the order
# wide, rebuild, clocks, each a device command: `OUT=/tmp/out bash round.sh MODE; tar -czf $OUT/MODE.tgz -C /tmp/out .`,
# since $OUT takes 8 files). `wide` ran at a2ada8a: its switch, TF_FLASH_SM90_D128_UNMASKED_BLOCK_N, was removed
# afterwards (measured slower); `rebuild` forces the rebuilt descriptors at every head dim (the kept default
# rebuilds them from head dim 128 on). Results and reading: ../README.md.
#   round.sh wide    the d128 forward's plain variant over unmasked, non-causal attention with wider key tiles
#                         (TF_FLASH_SM90_D128_UNMASKED_BLOCK_N, fwd_kernel_sm90.h; one register buffer of P, since two
#                         do not fit beside a wider S) against the kept 128-key tiles with two P buffers (about 8
#                         minutes by the parts' earlier timings): the forward harness (sm_90a), variants of the two d128
#                         Hopper objects at 176 and 160 keys with CuTe's extended wgmma shapes (one wgmma of N = 176 /
#                         160 per k-slice), 192 (a base shape) and 176 with `rebuild`'s switch (244 bytes of spills
#                         instead of 300), the forward tests on each (in parallel: correctness,
#                         not time), then the d128 benchmark interleaved twice over the four binaries, and the summary.
#                         ptxas here (nvcc 13.0, bf16): 176 keys spill 300 bytes (seven 8-byte reloads before each S
#                         GEMM, behind the ping-pong barrier; the rest on the masked edge tiles' path), 160 148 bytes,
#                         192 416; the kept kernel 20.
#   round.sh clocks  why fp16 runs below bf16 (round 20's README): the d128 forward (8k, non-causal) and torch's
#                         cuDNN, each bf16, fp16, bf16, fp16 in turn for 15 s (`fwd_harness one ... dtype seconds`), with
#                         nvidia-smi sampling the SM clock, power and throttle reasons every 100 ms: the mean of each per
#                         run. Both harnesses' benchmarks run every bf16 shape before any fp16 one, so until now fp16 was
#                         always measured on a card that had run longer. Reuses `wide`'s build if there (about 3 minutes).
#   round.sh rebuild TF_FLASH_SM90_REBUILD_DESCRIPTORS=1 (fwd_kernel_sm90.h's loop_operand: Q's wgmma
#                         descriptors rebuilt at each GEMM instead of held across the loop) against the kept forward:
#                         the six Hopper forward objects rebuilt, the forward tests, `bench 64 128 256` interleaved
#                         twice. ptxas here (bf16 d128): every variant spill-free (kept: 20 / 12 / 40 / 44 bytes for
#                         plain / general / attn_mask / both).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
source benchmarks/results/round_lib.sh
start=$(date +%s)
cutlass_headers
build_base() {
  [ -x build/fwd_base/fwd_harness ] && return 0
  ARCHS=90a VARIANTS=0 JOBS=16 tests/cuda_harness/build.sh build/fwd_base > "$OUT/fwd_base_build.log" 2>&1 ||
    { tail -20 "$OUT/fwd_base_build.log"; exit 1; }
}
case "${1:?wide, clocks or rebuild}" in
  wide)
    build_base
    files="flash_fwd_sm90_bf16_hdim128.cu flash_fwd_sm90_fp16_hdim128.cu"
    ext=-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
    variant_fwd build/fwd_base build/fwd_w176 "-DTF_FLASH_SM90_D128_UNMASKED_BLOCK_N=176 $ext" "$files" &
    variant_fwd build/fwd_base build/fwd_w160 "-DTF_FLASH_SM90_D128_UNMASKED_BLOCK_N=160 $ext" "$files" &
    variant_fwd build/fwd_base build/fwd_w192 "-DTF_FLASH_SM90_D128_UNMASKED_BLOCK_N=192" "$files" &
    variant_fwd build/fwd_base build/fwd_w176rb \
      "-DTF_FLASH_SM90_D128_UNMASKED_BLOCK_N=176 $ext -DTF_FLASH_SM90_REBUILD_DESCRIPTORS=1" "$files" &
    wait
    echo "built in $(( $(date +%s) - start ))s"
    grep -H "spill" "$OUT"/fwd_w*_build.log | sort | uniq -c | cut -c1-160
    for kind in w176 w160 w192 w176rb; do
      timeout 200 build/fwd_$kind/fwd_harness test > "/tmp/test_$kind.log" 2>&1 &
    done
    wait
    for kind in w176 w160 w192 w176rb; do  # $OUT takes 8 files: one log of the four
      echo "$kind tests: $(tail -n 1 "/tmp/test_$kind.log")"; grep -E "FAIL" "/tmp/test_$kind.log" | head -5
      { echo "=== $kind"; cat "/tmp/test_$kind.log"; } >> "$OUT/test_variants.log"
    done
    for r in 1 2; do
      for kind in base w176 w160 w192 w176rb; do
        timeout 60 build/fwd_$kind/fwd_harness bench 128 > "$OUT/fwdbench_${kind}_$r.txt" 2>&1 || echo "bench $kind failed"
      done
    done
    fwd_summary "base w176 w160 w192 w176rb" "128 keys, two P buffers (kept) | 176 | 160 | 192 | 176, Q rebuilt" ;;
  clocks)
    build_base
    reasons=clocks_event_reasons.active  # the older drivers' name: clocks_throttle_reasons.active
    nvidia-smi --query-gpu=$reasons --format=csv > /dev/null 2>&1 || reasons=clocks_throttle_reasons.active
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,$reasons \
      --format=csv,noheader,nounits -lms 100 > /tmp/smi.csv &
    smi=$!
    for dt in bf16 fp16 bf16 fp16; do
      build/fwd_base/fwd_harness one 128 0 8192 $dt 15 | grep sustained | tee -a /tmp/runs.txt
    done
    python3 - <<'PY' | tee -a /tmp/runs.txt
import time, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F
b, h, s, d = 2, 16, 8192, 128
for name in ("bf16", "fp16", "bf16", "fp16"):
    dtype = torch.bfloat16 if name == "bf16" else torch.float16
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(3))
    with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for _ in range(3): F.scaled_dot_product_attention(q, k, v)
        torch.cuda.synchronize()
        begin, t0, calls = int(time.time() * 1000), time.perf_counter(), 0
        while time.perf_counter() - t0 < 15:
            for _ in range(20): F.scaled_dot_product_attention(q, k, v)
            torch.cuda.synchronize()
            calls += 20
        el = time.perf_counter() - t0
    print(f"sustained cudnn-{name} d={d} causal=0 s={s}: {calls} calls in {el:.2f} s, "
          f"{4 * b * h * s * s * d * calls / el / 1e12:.1f} TFLOP/s, window_ms {begin} {int(time.time() * 1000)}")
PY
    kill $smi
    cp /tmp/smi.csv "$OUT/smi.csv"; cp /tmp/runs.txt "$OUT/runs.txt"
    python3 - /tmp/smi.csv /tmp/runs.txt <<'PY' | tee "$OUT/summary_clocks.txt"
import datetime, re, sys
samples = []
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    try:
        t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp() * 1000
        samples.append((t, float(f[1]), float(f[2]), float(f[3]), f[4]))
    except (ValueError, IndexError):
        pass
print("run | TFLOP/s | mean SM MHz | mean W | mean C | throttle reasons seen")
for line in open(sys.argv[2]):
    m = re.match(r"sustained (\S+) .*?([0-9.]+) TFLOP/s, window_ms (\d+) (\d+)", line)
    if not m:
        continue
    lo, hi = int(m.group(3)) + 2000, int(m.group(4))  # the first 2 s settle
    w = [x for x in samples if lo <= x[0] <= hi]
    if w:
        mean = lambda i: sum(x[i] for x in w) / len(w)
        print(f"{m.group(1)} | {m.group(2)} | {mean(1):.0f} | {mean(2):.0f} | {mean(3):.0f} | {sorted(set(x[4] for x in w))}")
PY
    ;;
  rebuild)
    build_base
    files=$(cd cc/kernels/cuda && ls flash_fwd_sm90_*.cu | tr '\n' ' ')
    variant_fwd build/fwd_base build/fwd_rb "-DTF_FLASH_SM90_REBUILD_DESCRIPTORS=1" "$files"
    grep -H "spill" "$OUT"/fwd_rb_build.log | sort | uniq -c | cut -c1-160
    timeout 200 build/fwd_rb/fwd_harness test > "$OUT/test_fwd_rb.log" 2>&1
    echo "tests rc $?: $(tail -n 1 "$OUT/test_fwd_rb.log")"; grep -E "FAIL" "$OUT/test_fwd_rb.log" | head -5
    for r in 1 2; do
      for kind in base rb; do
        timeout 100 build/fwd_$kind/fwd_harness bench 64 128 256 > "$OUT/fwdbench_${kind}_$r.txt" 2>&1 || echo "bench $kind failed"
      done
    done
    fwd_summary "base rb" "kept | descriptors rebuilt" ;;
esac
echo "total $(( $(date +%s) - start ))s"
