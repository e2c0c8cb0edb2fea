#!/usr/bin/env bash
# Round 13 through TensorFlow (after the six stash calls), three device commands back to back:
#   round.sh a   build the library; kernel family (attn_mask in both Hopper kernels, the XLA front door's
#                workspace), robustness, determinism, softcap, validation, float32 range; the op, dropout and
#                sparsity tests
#   round.sh b   XLA; layers, saving, Keras' switch (padding x causal routing), KerasHub (wheels in .whl/)
#   round.sh c   the Keras training step with packed documents (attention_mask [1, T, T]): Keras' MHA + XLA,
#                FlashMHA on the Hopper and the sm_80 families
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export OUT="${OUT:-/tmp/out}"
case "${1:?a, b or c}" in
  a) bash scripts/gpu_round.sh device family test 2>&1 | grep -E "gpu_round|passed|failed|FAILED|Error" | head -30 ;;
  b) bash scripts/gpu_round.sh device xla layers 2>&1 | grep -E "passed|failed|FAILED|Error|skipped" | head -30
     # a's attn_mask family test again, its backward family expectation fixed (the Hopper backward takes them)
     (source .gpu/env/env.sh >/dev/null 2>&1; source scripts/device_keras_hub.sh
      export TF_FLASH_LIBRARY=$PWD/build/gpu/_flash_attention_ops.so PYTHONPATH=$PWD:$PYTHONPATH
      timeout 200 python3 -m pytest -q tests/test_kernel_family.py -m gpu -k "attention_mask" -p no:cacheprovider         > "$OUT/pytest_gpu_family_masks.log" 2>&1; tail -3 "$OUT/pytest_gpu_family_masks.log") ;;
  c) BENCH_MODEL_ARGS="--modes keras_mha_xla,flash_mha_auto --lengths 1024,4096 --families default,sm80 --doc-tokens 512 --time-limit 480" \
       bash scripts/gpu_round.sh device bench_model 2>&1 | tail -30 ;;
esac
