#!/usr/bin/env bash
# Round 20 through TensorFlow (after the five stash calls), one device command:
#   round.sh ab  the Keras training step (bench_model.py: 4 blocks, d64, 4096 x 4) with this tree's library (new)
#                and with one whose d64 backward files are compiled from 95e3708 (old: round 18's changes 1 and 2,
#                before change 3, d64's dQ GEMM split by query rows), and Keras' MultiHeadAttention + XLA (keras)
#                in the same run: new, old, keras, new, old, one process each; then the GPU determinism tests
#                (bwd_dq_splits now counts the d256 kernels' 64-key tiles) and, as time allows, 1024 x 16 (new,
#                keras).
#   round.sh tail  what `ab` left for want of time (its library build took 169 s), run as the next device command on
#                the same machine: FlashMHA at 1024 x 16 (this tree's library), then the GPU determinism tests.
#                Needs .gpu_build/old/cc/kernels: `git archive 95e3708 cc/kernels | tar -x -C .gpu_build/old`.
set -uo pipefail
cd "$(dirname "$0")/../../../.."
root=$PWD
export OUT="${OUT:-/tmp/out}"
source benchmarks/results/round_lib.sh  # with_tf
case "${1:?ab}" in
  ab)
    start=$(date +%s)
    elapsed() { echo $(( $(date +%s) - start )); }
    mkdir -p /tmp/cutlass_old && tar -xzf .gpu_build/cutlass_include.tgz -C /tmp/cutlass_old  # gpu_round.sh unpacks its own
    defines=$(tr ' ' '\n' < .gpu_build/flags | grep '^-D' | tr '\n' ' ')
    mkdir -p /tmp/old_obj
    for f in flash_bwd_bf16_hdim64 flash_bwd_fp16_hdim64; do  # beside the library's own build (16 cores)
      (cd .gpu_build/old && nvcc -std=c++17 -O3 --expt-relaxed-constexpr --expt-extended-lambda -lineinfo \
        -Xcompiler=-fPIC -gencode=arch=compute_90a,code=sm_90a $defines -DNDEBUG -I. -I/tmp/cutlass_old/include \
        -c cc/kernels/cuda/$f.cu -o /tmp/old_obj/$f.o > "/tmp/old_$f.log" 2>&1) &
    done
    with_tf
    wait
    echo "libraries' objects in $(elapsed)s"
    cat /tmp/old_*.log > "$OUT/old_build.log"
    site=$(python3 -c "import tensorflow as tf, os; print(os.path.dirname(tf.__file__))")
    objs=$(ls build/gpu/cuda_obj/*.o | grep -v -E "flash_bwd_(bf16|fp16)_hdim64\.o")
    g++ -shared -o build/gpu/old_d64_bwd.so .gpu_build/obj/*.o $objs /tmp/old_obj/*.o -L/usr/local/cuda/lib64 \
      -l:libcudart_static.a -ldl -lrt -lpthread -L"$site" -l:libtensorflow_framework.so.2 -l:libtensorflow_cc.so.2 ||
      { echo "old library: link failed"; exit 1; }
    new_lib=$TF_FLASH_LIBRARY
    step() {  # step RUN MODE LENGTH: one bench_model process
      local run=$1 mode=$2 length=$3 lib=$new_lib
      [[ $run == old* ]] && lib=$root/build/gpu/old_d64_bwd.so
      mkdir -p "/tmp/models/$run"  # $OUT takes 8 files: the runs' folders go back as one archive
      TF_FLASH_LIBRARY=$lib timeout 110 python3 benchmarks/bench_model.py --out-dir "/tmp/models/$run" \
        --modes "$mode" --lengths "$length" --xla-autotune-cache /tmp/xla_cache --time-limit 100 > "/tmp/models/$run.log" 2>&1
      echo "$run [$(elapsed)s]: $(grep -E "$mode .*ms/step" "/tmp/models/$run.log" | cut -c1-150)" | tee -a "$OUT/steps.txt"
      tar -czf "$OUT/models.tgz" -C /tmp models
    }
    step new_1 flash_mha_auto 4096
    step old_1 flash_mha_auto 4096
    step keras_1 keras_mha_xla 4096
    step new_2 flash_mha_auto 4096
    step old_2 flash_mha_auto 4096
    if (( $(elapsed) < 440 )); then
      timeout 80 python3 -m pytest -q tests/test_determinism.py -m gpu -p no:cacheprovider > "$OUT/pytest_gpu_determinism.log" 2>&1
      echo "determinism tests rc $? [$(elapsed)s]: $(tail -n 1 "$OUT/pytest_gpu_determinism.log")"
    fi
    (( $(elapsed) < 450 )) && step new_1024 flash_mha_auto 1024
    (( $(elapsed) < 500 )) && step keras_1024 keras_mha_xla 1024
    echo "total $(elapsed)s" ;;
  tail)
    with_tf
    mkdir -p /tmp/m
    timeout 100 python3 benchmarks/bench_model.py --out-dir /tmp/m --modes flash_mha_auto --lengths 1024 \
      --xla-autotune-cache /tmp/xla_cache --time-limit 90 > "$OUT/model_new_1024.log" 2>&1
    grep ms/step "$OUT/model_new_1024.log" | cut -c1-150
    timeout 80 python3 -m pytest -q tests/test_determinism.py -m gpu -p no:cacheprovider > "$OUT/pytest_gpu_determinism.log" 2>&1
    tail -n 2 "$OUT/pytest_gpu_determinism.log" ;;
esac
