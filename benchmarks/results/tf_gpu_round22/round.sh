#!/usr/bin/env bash
# Round 22 through TensorFlow, prepared in round 21 (trimmed in session 22 to fit 30 minutes: a's time limits, b without
# bench_overhead.py, whose question --calls-per-function answers) (after the six stash calls; device commands back
# to back, each well inside 10 minutes by round 19-21's timings; harness.sh beside it needs no stash: run it first):
#   round.sh a  build the library; bench_gpu.py --torch at d128 and d256, bf16: forward+backward now takes dO as the
#               output's gradient, as torch's peer does (round 21's README: the old loss added float32 passes to every
#               TF call); then the same TF rows at d128 with --calls-per-function 10 (ten chained attentions per tf.function,
#               as in a model's graph): whether round 21's gap between the harness (585-633 TFLOP/s at 4k) and
#               bench_gpu.py (512-535) is TF's per-call cost, which a model's graph does not pay per attention
#   round.sh b  kernel family (with the dynamic schedule's test: TF_FLASH_SM90_FORWARD_SCHEDULE=dynamic in a child
#               process, bit-identical to a CTA per tile), robustness, determinism, softcap, validation, float32
#               range; the op, dropout and sparsity tests
#   round.sh c  the XLA suite; layers, saving, Keras' switch, KerasHub (wheels in .whl/) -- last run in round 19
#   round.sh d  the Keras training step (bench_model.py, 4 blocks, d64, mixed bf16): FlashMHA with compile()'s
#               default and Keras' MultiHeadAttention + XLA at 4096 x 4 and 1024 x 16, one process each
set -uo pipefail
cd "$(dirname "$0")/../../.."
root=$PWD
export OUT="${OUT:-/tmp/out}"
source benchmarks/results/round_lib.sh  # with_tf
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
case "${1:?a, b, c or d}" in
  a) with_tf
     echo "library ready [$(elapsed)s]"
     timeout 270 python3 benchmarks/bench_gpu.py --torch --impls tf_flash --dtypes bf16 --dims 128 256 --skip-memory \
       --skip-extras --time-limit 230 --out-dir /tmp/bench > "$OUT/bench_gpu.log" 2>&1
     rm -f /tmp/bench/*.png; tar -czf "$OUT/bench_gpu.tgz" -C /tmp bench  # $OUT takes 8 files
     grep -A15 -E "^bf16 d(128|256), TFLOP" "$OUT/bench_gpu.log"
     echo "[$(elapsed)s]"
     timeout 140 python3 benchmarks/bench_gpu.py --impls tf_flash --dtypes bf16 --dims 128 --skip-memory \
       --skip-extras --time-limit 110 --calls-per-function 10 --out-dir /tmp/bench10 > "$OUT/bench_gpu_chain10.log" 2>&1
     rm -f /tmp/bench10/*.png; tar -czf "$OUT/bench_gpu_chain10.tgz" -C /tmp bench10
     grep -A15 -E "^bf16 d(128|256), TFLOP" "$OUT/bench_gpu_chain10.log"
     echo "total $(elapsed)s" ;;
  b) bash scripts/gpu_round.sh device family test 2>&1 | grep -E "gpu_round|passed|failed|FAILED|Error" | head -30
     echo "total $(elapsed)s" ;;
  c) bash scripts/gpu_round.sh device xla layers 2>&1 | grep -E "gpu_round|passed|failed|FAILED|Error|skipped" | head -30
     echo "total $(elapsed)s" ;;
  d) with_tf
     step() {  # step NAME MODE LENGTH: one bench_model.py process
       mkdir -p "/tmp/models/$1"
       timeout 110 python3 benchmarks/bench_model.py --out-dir "/tmp/models/$1" --modes "$2" --lengths "$3" \
         --xla-autotune-cache /tmp/xla_cache --time-limit 100 > "/tmp/models/$1.log" 2>&1
       echo "$1 [$(elapsed)s]: $(grep -E "$2 .*ms/step" "/tmp/models/$1.log" | cut -c1-150)" | tee -a "$OUT/steps.txt"
       tar -czf "$OUT/models.tgz" -C /tmp models
     }
     step flash_4096 flash_mha_auto 4096
     step keras_4096 keras_mha_xla 4096
     step flash_1024 flash_mha_auto 1024
     step keras_1024 keras_mha_xla 1024
     echo "total $(elapsed)s" ;;
esac
