#!/usr/bin/env bash
# Round 23 through TensorFlow, prepared in session 22 and NOT RUN yet (harness.sh beside it first, no stash; then the
# six stash calls and these, device commands back
# to back; round 22's timings: the library build 200 s, the family + op suites 300 s, four Keras steps 250 s):
#   round.sh a  build the library; the schedule tests first (test_kernel_family.py -k schedules: round 22's new d256
#               case, a CTA whose first tiles have no work, persistent against a CTA per tile, never run on a GPU);
#               bench_gpu.py --torch at d64 (the Keras model's head dim) and d256, bf16, ten attentions per
#               tf.function (round 22 ran d128 so, d256 one per call only)
#   round.sh b  kernel family, robustness, determinism, softcap, validation, float32 range; op, dropout, sparsity
#   round.sh c  the Keras training step (bench_model.py, 4 blocks, d64, mixed bf16) at 4096 x 4 and 1024 x 16:
#               FlashMHA with compile()'s default and Keras' MultiHeadAttention + XLA, one process each
set -uo pipefail
cd "$(dirname "$0")/../../.."
root=$PWD
export OUT="${OUT:-/tmp/out}"
source benchmarks/results/round_lib.sh  # with_tf, model_step
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
case "${1:?a, b or c}" in
  a) with_tf
     echo "library ready [$(elapsed)s]"
     timeout 150 python3 -m pytest -q tests/test_kernel_family.py -k schedules -p no:cacheprovider 2>&1 |
       tee "$OUT/pytest_schedules.log" | tail -3
     echo "[$(elapsed)s]"
     timeout 280 python3 benchmarks/bench_gpu.py --torch --impls tf_flash --dtypes bf16 --dims 64 256 --skip-memory \
       --skip-extras --time-limit 250 --calls-per-function 10 --out-dir /tmp/bench > "$OUT/bench_gpu_chain10.log" 2>&1
     rm -f /tmp/bench/*.png; tar -czf "$OUT/bench_gpu_chain10.tgz" -C /tmp bench  # $OUT takes 8 files
     grep -A15 -E "^bf16 d(64|256), TFLOP" "$OUT/bench_gpu_chain10.log"
     echo "total $(elapsed)s" ;;
  b) bash scripts/gpu_round.sh device family test 2>&1 | grep -E "gpu_round|passed|failed|FAILED|Error" | head -30
     echo "total $(elapsed)s" ;;
  c) with_tf
     model_step flash_4096 flash_mha_auto 4096
     model_step keras_4096 keras_mha_xla 4096
     model_step flash_1024 flash_mha_auto 1024
     model_step keras_1024 keras_mha_xla 1024
     echo "total $(elapsed)s" ;;
esac
