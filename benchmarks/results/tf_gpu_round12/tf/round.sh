#!/usr/bin/env bash
# Round 12 through TensorFlow (after the five stash calls), three device commands back to back:
#   round.sh a   build the library; kernel family, robustness, determinism, softcap, validation, float32 range;
#                the op, dropout and sparsity tests
#   round.sh b   the float32 suites with TF32 off (round 11's last change, 4529732, had not run on a GPU);
#                XLA; layers, saving, Keras' switch, KerasHub
#   round.sh c   the Keras training step, Hopper and sm_80 families alternating
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export OUT="${OUT:-/tmp/out}"
case "${1:?a, b or c}" in
  a) bash scripts/gpu_round.sh device family test 2>&1 | grep -E "gpu_round|passed|failed|FAILED|Error" | head -30 ;;
  b) bash scripts/gpu_round.sh device none 2>&1 | tail -1
     (source .gpu/env/env.sh >/dev/null 2>&1
      export TF_FLASH_LIBRARY=$PWD/build/gpu/_flash_attention_ops.so PYTHONPATH=$PWD:$PYTHONPATH TF_FLASH_TEST_TF32=0
      timeout 200 python3 -m pytest -q tests/test_flash_attention.py tests/test_dropout.py tests/test_sparsity.py \
        tests/test_robustness.py tests/test_softcap.py tests/test_xla.py -m gpu -k "float32 or f32" -p no:cacheprovider
      timeout 120 python3 -m pytest -q tests/test_float32_range.py tests/test_determinism.py -m gpu -p no:cacheprovider
     ) > "$OUT/pytest_tf32_off.log" 2>&1
     grep -E "passed|failed" "$OUT/pytest_tf32_off.log"; grep FAILED "$OUT/pytest_tf32_off.log" | head -5
     (source .gpu/env/env.sh >/dev/null 2>&1
      export TF_FLASH_LIBRARY=$PWD/build/gpu/_flash_attention_ops.so PYTHONPATH=$PWD:$PYTHONPATH
      timeout 60 python3 -m pytest -q tests/test_flash_attention.py -m gpu -k refuses -p no:cacheprovider 2>&1 | tail -2)
     bash scripts/gpu_round.sh device xla layers 2>&1 | grep -E "passed|failed|FAILED|Error" | head -20 ;;
  c) BENCH_MODEL_ARGS="--modes flash_mha_auto --lengths 1024,4096 --families default,sm80 --repeats 2" \
       bash scripts/gpu_round.sh device bench_model 2>&1 | tail -30 ;;
esac
