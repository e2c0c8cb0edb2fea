#!/usr/bin/env bash
# Round 24 through TF, prepared in session 23 and NOT RUN yet (round 23's tf_vote.sh with the switch as an
# argument), after harness.sh and the six stash calls: the library built with a -D switch against the default one
# in one process tree. The library as gpu_round.sh builds it, and (its VARIANT_FLAGS) a copy with the files FLAG
# changes rebuilt with it; on the variant the GPU cases of test_robustness.py and the forward schedule tests;
# bench_gpu.py (bf16, d64, d128 and d256, ten attentions per tf.function) with each library, alternated; the Keras
# step (FlashMHA, 4096 x 4) with each.
#   OUT=... bash tf_ab.sh a FLAG [FILES]   the two libraries (~4-5 min), the tests on the variant
#   OUT=... bash tf_ab.sh b FLAG [FILES]   the benchmark of each library, twice, alternated (~8 min)
#   OUT=... bash tf_ab.sh c FLAG [FILES]   the Keras step with each, twice, in alternating order (~4 min)
# (carry .gpu/env, .gpu_build). FILES: the instantiation files FLAG changes, globs separated by spaces, default the
# Hopper forward's.
# e.g. FLAG=-DTF_FLASH_SM90_LAZY_RESCALE=1
set -uo pipefail
cd "$(dirname "$0")/../../.."
root=$PWD
export OUT="${OUT:-/tmp/out}"
source benchmarks/results/round_lib.sh  # with_tf, model_step
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
flag=${2:?the -D switch}
files=${3:-flash_fwd_sm90_*.cu}  # the objects FLAG changes (globs under cc/kernels/cuda/)
# a: gpu_round.sh builds the variant library beside the default one (VARIANT_FLAGS); b and c find both built.
if [ "${1:?a, b or c}" = a ]; then VARIANT_FLAGS=$flag VARIANT_FILES=$files with_tf; else with_tf; fi
base_lib=$TF_FLASH_LIBRARY variant_lib=$root/build/gpu_variant/_flash_attention_ops.so
bench() {  # bench RUN: each library once, alternated
  for v in base variant; do
    lib=${v}_lib
    TF_FLASH_LIBRARY=${!lib} timeout 140 python3 benchmarks/bench_gpu.py --impls tf_flash --dtypes bf16 --dims 64 128 256 \
      --skip-memory --skip-extras --time-limit 125 --calls-per-function 10 --out-dir /tmp/bench_${v}_$1 \
      > "$OUT/bench_${v}_$1.log" 2>&1
    echo "== $v $1 [$(elapsed)s]"; grep -A14 -E "^bf16 d(64|128|256), TFLOP" "$OUT/bench_${v}_$1.log" | grep -E "^\| (full|causal)" |
      awk -F'|' '{printf "%s:%s ", $2, $3} END {print ""}'
  done
}
case "$1" in
  b) bench 1; bench 2; echo "total $(elapsed)s"; exit 0 ;;
  c) i=0
     for v in base variant variant base; do
       lib=${v}_lib i=$((i + 1))
       TF_FLASH_LIBRARY=${!lib} model_step flash_4096_${v}_$i flash_mha_auto 4096
     done
     echo "total $(elapsed)s"; exit 0 ;;
esac
echo "libraries ready [$(elapsed)s]"
TF_FLASH_LIBRARY=$variant_lib timeout 200 python3 -m pytest -q -m gpu tests/test_robustness.py \
  "tests/test_kernel_family.py::test_forward_schedules_give_identical_results" -p no:cacheprovider 2>&1 |
  tee "$OUT/pytest_variant.log" | tail -2
echo "total $(elapsed)s"
