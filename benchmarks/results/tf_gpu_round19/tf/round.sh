#!/usr/bin/env bash
# Round 19 through TensorFlow (after the six stash calls), device commands back to back:
#   round.sh a   build the library; kernel family, robustness, determinism, softcap, validation, float32 range;
#                the op, dropout and sparsity tests (the Hopper backward at head dim 256 under TF's front door;
#                d64's dQ GEMM split by query rows, round 18's change 3, not yet run through TF)
#   round.sh bc  XLA; layers, saving, Keras' switch, KerasHub (wheels in .whl/); then the Keras training step
#                (bench_model.py: FlashMHA with compile()'s default, 1024 x 16 and 4096 x 4, two processes)
#   round.sh d   the forward and forward+backward through TF (bench_gpu.py, bf16, head dims 128 and 256) with
#                torch's flash and cuDNN backends in the same run
set -uo pipefail
cd "$(dirname "$0")/../../../.."
root=$PWD
export OUT="${OUT:-/tmp/out}"
source benchmarks/results/round_lib.sh  # with_tf
case "${1:?a, bc or d}" in
  a) bash scripts/gpu_round.sh device family test 2>&1 | grep -E "gpu_round|passed|failed|FAILED|Error" | head -30 ;;
  bc) bash scripts/gpu_round.sh device xla layers 2>&1 | grep -E "passed|failed|FAILED|Error|skipped" | head -30
     with_tf
     for r in 1 2; do
       mkdir -p "$OUT/model_$r"
       timeout 200 python3 benchmarks/bench_model.py --out-dir "$OUT/model_$r" --modes flash_mha_auto \
         --lengths 1024,4096 --xla-autotune-cache /tmp/xla_cache --time-limit 180 > "$OUT/model_$r.log" 2>&1
       echo "== Keras step, run $r"; grep -E "flash_mha_auto .*ms/step" "$OUT/model_$r.log"
     done ;;
  d) with_tf
     timeout 330 python3 benchmarks/bench_gpu.py --torch --impls tf_flash --dtypes bf16 --dims 128 256 --skip-memory \
       --skip-extras --time-limit 290 --out-dir "$OUT/bench_gpu" > "$OUT/bench_gpu.log" 2>&1; tail -60 "$OUT/bench_gpu.log" ;;
esac
