#!/usr/bin/env bash
# Round 15 through TensorFlow (after the six stash calls), device commands back to back:
#   round.sh a   build the library; kernel family, robustness, determinism, softcap, validation, float32 range;
#                the op, dropout and sparsity tests (the persistent Hopper forward under every front door's tests)
#   round.sh e   (after the schedule test was added to test_kernel_family.py) the kernel family suite again
#   round.sh b   XLA; layers, saving, Keras' switch, KerasHub (wheels in .whl/)
#   round.sh c   the Keras training step (FlashMHA, compile()'s default: XLA around the attention), alternating
#                the forward's persistent CTAs with a CTA per tile (TF_FLASH_SM90_FORWARD_SCHEDULE=tiles), and
#                (1024 x 16, two runs each)
#   round.sh d   the forward and forward+backward through TF (bench_gpu.py, bf16 d128)
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export OUT="${OUT:-/tmp/out}"
case "${1:?a, b or c}" in
  a) bash scripts/gpu_round.sh device family test 2>&1 | grep -E "gpu_round|passed|failed|FAILED|Error" | head -30 ;;
  e) bash scripts/gpu_round.sh device family 2>&1 | grep -E "gpu_round|passed|failed|FAILED|Error" | head -30 ;;
  b) bash scripts/gpu_round.sh device xla layers 2>&1 | grep -E "passed|failed|FAILED|Error|skipped" | head -30 ;;
  c) bash scripts/gpu_round.sh device none > /dev/null 2>&1
     (source .gpu/env/env.sh >/dev/null 2>&1
      export TF_FLASH_LIBRARY=$PWD/build/gpu/_flash_attention_ops.so PYTHONPATH=$PWD:$PYTHONPATH
      for r in 1 2; do
        for sched in persistent tiles; do
          mkdir -p "$OUT/model_${sched}_$r"
          TF_FLASH_SM90_FORWARD_SCHEDULE=$sched timeout 130 python3 benchmarks/bench_model.py --out-dir "$OUT/model_${sched}_$r" \
            --modes flash_mha_auto --lengths 1024 --xla-autotune-cache /tmp/xla_cache --time-limit 110 \
            > "$OUT/model_${sched}_$r.log" 2>&1
          echo "== $sched run $r"; grep -E "flash_mha_auto" "$OUT/model_${sched}_$r.log" | tail -2
        done
      done
    ) ;;
  d) bash scripts/gpu_round.sh device none > /dev/null 2>&1
     (source .gpu/env/env.sh >/dev/null 2>&1
      export TF_FLASH_LIBRARY=$PWD/build/gpu/_flash_attention_ops.so PYTHONPATH=$PWD:$PYTHONPATH
      timeout 400 python3 benchmarks/bench_gpu.py --impls tf_flash --dtypes bf16 --dims 128 --skip-memory --skip-extras \
        --time-limit 330 --out-dir "$OUT/bench_gpu" > "$OUT/bench_gpu.log" 2>&1; tail -16 "$OUT/bench_gpu.log") ;;
esac
