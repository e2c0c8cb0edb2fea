#!/usr/bin/env bash
# Round 20 through TensorFlow (after the six stash calls), one device command:
#   round.sh ab  the Keras training step (bench_model.py: FlashMHA d64, compile()'s default, 4096 x 4) with this
#                tree's library and with one whose d64 backward files are compiled from 95e3708 (round 18's changes
#                1 and 2, before change 3: d64's dQ GEMM split by query rows); new, old, new, old, one process each.
#                Needs .gpu_build/old/cc/kernels: `git archive 95e3708 cc/kernels | tar -x -C .gpu_build/old`.
set -uo pipefail
cd "$(dirname "$0")/../../../.."
root=$PWD
export OUT="${OUT:-/tmp/out}"
source benchmarks/results/round_lib.sh  # with_tf
case "${1:?ab}" in
  ab)
    start=$(date +%s)
    mkdir -p /tmp/cutlass_old && tar -xzf .gpu_build/cutlass_include.tgz -C /tmp/cutlass_old  # gpu_round.sh unpacks its own
    defines=$(tr ' ' '\n' < .gpu_build/flags | grep '^-D' | tr '\n' ' ')
    mkdir -p /tmp/old_obj
    for f in flash_bwd_bf16_hdim64 flash_bwd_fp16_hdim64; do  # beside the library's own build (16 cores)
      (cd .gpu_build/old && nvcc -std=c++17 -O3 --expt-relaxed-constexpr --expt-extended-lambda -lineinfo \
        -Xcompiler=-fPIC -gencode=arch=compute_90a,code=sm_90a $defines -DNDEBUG -I. -I/tmp/cutlass_old/include \
        -c cc/kernels/cuda/$f.cu -o /tmp/old_obj/$f.o > "$OUT/old_$f.log" 2>&1) &
    done
    with_tf
    wait
    echo "libraries' objects in $(( $(date +%s) - start ))s"
    site=$(python3 -c "import tensorflow as tf, os; print(os.path.dirname(tf.__file__))")
    objs=$(ls build/gpu/cuda_obj/*.o | grep -v -E "flash_bwd_(bf16|fp16)_hdim64\.o")
    g++ -shared -o build/gpu/old_d64_bwd.so .gpu_build/obj/*.o $objs /tmp/old_obj/*.o -L/usr/local/cuda/lib64 \
      -l:libcudart_static.a -ldl -lrt -lpthread -L"$site" -l:libtensorflow_framework.so.2 -l:libtensorflow_cc.so.2 ||
      { echo "old library: link failed"; exit 1; }
    new_lib=$TF_FLASH_LIBRARY
    for run in new_1 old_1 new_2 old_2; do
      lib=$([[ $run == new* ]] && echo "$new_lib" || echo "$root/build/gpu/old_d64_bwd.so")
      mkdir -p "$OUT/model_$run"
      TF_FLASH_LIBRARY=$lib timeout 110 python3 benchmarks/bench_model.py --out-dir "$OUT/model_$run" \
        --modes flash_mha_auto --lengths 4096 --xla-autotune-cache /tmp/xla_cache --time-limit 100 > "$OUT/model_$run.log" 2>&1
      echo "$run: $(grep -E "flash_mha_auto .*ms/step" "$OUT/model_$run.log" | cut -c1-150)"
    done
    echo "total $(( $(date +%s) - start ))s" ;;
esac
