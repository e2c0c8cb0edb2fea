#!/usr/bin/env bash
# Round 21 through TensorFlow (after the six stash calls), device commands back to back:
#   round.sh a  build the library (Q's wgmma descriptors now rebuilt per GEMM in the d128 and d256 Hopper forwards);
#               the op, dropout and sparsity tests, then kernel family, robustness, determinism, softcap, validation,
#               float32 range (the GPU-marked tests)
#   round.sh d  the forward and forward+backward through TF (bench_gpu.py, head dim 128, bf16 and fp16) with torch's
#               flash and cuDNN backends in the same run
#   round.sh e  the same at head dim 256, bf16, as time allows
set -uo pipefail
cd "$(dirname "$0")/../../../.."
root=$PWD
export OUT="${OUT:-/tmp/out}"
source benchmarks/results/round_lib.sh  # with_tf
bench() {  # bench NAME ARGS...: bench_gpu.py with torch's peers, into $OUT/NAME/
  local name=$1; shift
  with_tf
  timeout 560 python3 benchmarks/bench_gpu.py --torch --impls tf_flash --skip-memory --skip-extras --time-limit 500 \
    --out-dir "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1; tail -70 "$OUT/$name.log"
}
case "${1:?a, d or e}" in
  a) bash scripts/gpu_round.sh device test family 2>&1 | grep -E "gpu_round|passed|failed|FAILED|Error" | head -30 ;;
  d) bench bench_d128 --dtypes bf16 fp16 --dims 128 ;;
  e) bench bench_d256 --dtypes bf16 --dims 256 ;;
esac
