#!/usr/bin/env bash
# Round 16 through TensorFlow (after the six stash calls), device commands back to back:
#   round.sh a   build the library; kernel family, robustness, determinism, softcap, validation, float32 range;
#                the op, dropout and sparsity tests
#   round.sh b   XLA; layers, saving, Keras' switch, KerasHub (wheels in .whl/)
#   round.sh d   the forward and forward+backward through TF (bench_gpu.py, bf16 d128) with torch's flash and
#                cuDNN backends in the same run (the machine's last minutes: a 230 s time limit)
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export OUT="${OUT:-/tmp/out}"
with_tf() { bash scripts/gpu_round.sh device none > /dev/null 2>&1
  source .gpu/env/env.sh > /dev/null 2>&1
  export TF_FLASH_LIBRARY=$PWD/build/gpu/_flash_attention_ops.so PYTHONPATH=$PWD:${PYTHONPATH:-}; }
case "${1:?a, b or d}" in
  a) bash scripts/gpu_round.sh device family test 2>&1 | grep -E "gpu_round|passed|failed|FAILED|Error" | head -30 ;;
  b) bash scripts/gpu_round.sh device xla layers 2>&1 | grep -E "passed|failed|FAILED|Error|skipped" | head -30 ;;
  d) with_tf
     timeout 290 python3 benchmarks/bench_gpu.py --torch --impls tf_flash --dtypes bf16 --dims 128 --skip-memory --skip-extras \
       --time-limit 230 --out-dir "$OUT/bench_gpu" > "$OUT/bench_gpu.log" 2>&1; tail -40 "$OUT/bench_gpu.log" ;;
esac
