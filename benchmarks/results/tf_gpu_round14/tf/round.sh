#!/usr/bin/env bash
# Round 14 through TensorFlow (after the six stash calls), three device commands back to back:
#   round.sh a   build the library; kernel family (the deterministic dQ in the Hopper backward, with attention
#                masks), robustness, determinism, softcap, validation, float32 range; the op, dropout and sparsity
#                tests
#   round.sh b   XLA; layers, saving, Keras' switch, KerasHub (wheels in .whl/)
#   round.sh c   the deterministic backward's cost (bench_determinism.py, both families, with and without
#                dropout, d128 and the model's d64) and the Keras training step under TF_DETERMINISTIC_OPS=1
#   round.sh d   the Keras training step with packed documents (the forward's new attn_mask variant), as round 13's c
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export OUT="${OUT:-/tmp/out}"
case "${1:?a, b or c}" in
  a) bash scripts/gpu_round.sh device family test 2>&1 | grep -E "gpu_round|passed|failed|FAILED|Error" | head -30 ;;
  b) bash scripts/gpu_round.sh device xla layers 2>&1 | grep -E "passed|failed|FAILED|Error|skipped" | head -30 ;;
  c) bash scripts/gpu_round.sh device none > /dev/null 2>&1
     (source .gpu/env/env.sh >/dev/null 2>&1
      export TF_FLASH_LIBRARY=$PWD/build/gpu/_flash_attention_ops.so PYTHONPATH=$PWD:$PYTHONPATH
      for fam in default sm80; do
        for drop in 0 0.1; do
          env $([ $fam = sm80 ] && echo TF_FLASH_CUDA_FAMILY=sm80) timeout 100 python3 benchmarks/bench_determinism.py \
            --seqlens 4096 8192 --dropout $drop 2>&1 | grep "^b"
          env $([ $fam = sm80 ] && echo TF_FLASH_CUDA_FAMILY=sm80) timeout 100 python3 benchmarks/bench_determinism.py \
            --batch 16 --heads 12 --dim 64 --seqlens 1024 --dropout $drop 2>&1 | grep "^b"
        done
      done | tee "$OUT/bench_determinism.txt"
      mkdir -p "$OUT/model_det"
      TF_DETERMINISTIC_OPS=1 timeout 300 python3 benchmarks/bench_model.py --out-dir "$OUT/model_det" --modes flash_mha_auto \
        --lengths 1024,4096 --families default,sm80 --time-limit 240 2>&1 | tail -12) ;;
  d) BENCH_MODEL_ARGS="--modes keras_mha_xla,flash_mha_auto --lengths 1024,4096 --doc-tokens 512 --time-limit 420" \
       bash scripts/gpu_round.sh device bench_model 2>&1 | tail -30 ;;
esac
