#!/usr/bin/env bash
# Round 21 through TensorFlow (after the six stash calls), device commands back to back:
#   round.sh a  build the library (Q's wgmma descriptors now rebuilt per GEMM in the d128 and d256 Hopper forwards);
#               the op, dropout and sparsity tests, then kernel family, robustness, determinism, softcap, validation,
#               float32 range (the GPU-marked tests)
#   round.sh d  the forward and forward+backward through TF (bench_gpu.py, head dim 128, bf16 and fp16) with torch's
#               flash and cuDNN backends in the same run
#   round.sh e  the same at head dim 256, bf16, as time allows
#   round.sh ab the d128 bf16 forward through TF, this library (new) against one whose d128 bf16 forward object holds
#               Q's descriptors (old: TF_FLASH_SM90_REBUILD_DESCRIPTORS=0), 4k-16k, new old new old, no torch
set -uo pipefail
cd "$(dirname "$0")/../../../.."
root=$PWD
export OUT="${OUT:-/tmp/out}"
source benchmarks/results/round_lib.sh  # with_tf
bench() {  # bench NAME ARGS...: bench_gpu.py with torch's peers, into $OUT/NAME/
  local name=$1; shift
  with_tf
  timeout 560 python3 benchmarks/bench_gpu.py --torch --impls tf_flash --skip-memory --skip-extras --time-limit 500 \
    --out-dir "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1; tail -70 "$OUT/$name.log"
}
case "${1:?a, d or e}" in
  a) bash scripts/gpu_round.sh device test family 2>&1 | grep -E "gpu_round|passed|failed|FAILED|Error" | head -30 ;;
  d) bench bench_d128 --dtypes bf16 fp16 --dims 128 ;;
  e) bench bench_d256 --dtypes bf16 --dims 256 ;;
  ab) with_tf
      f=flash_fwd_sm90_bf16_hdim128; defines=$(tr ' ' '\n' < .gpu_build/flags | grep '^-D' | tr '\n' ' ')
      nvcc -std=c++17 -O3 --expt-relaxed-constexpr --expt-extended-lambda -lineinfo -Xcompiler=-fPIC \
        -gencode=arch=compute_90a,code=sm_90a $defines -DNDEBUG -DTF_FLASH_SM90_REBUILD_DESCRIPTORS=0 -I. \
        -I/tmp/cutlass/include -c cc/kernels/cuda/$f.cu -o /tmp/$f.o || exit 1
      site=$(python3 -c "import tensorflow as tf, os; print(os.path.dirname(tf.__file__))")
      g++ -shared -o build/gpu/old.so .gpu_build/obj/*.o $(ls build/gpu/cuda_obj/*.o | grep -v $f.o) /tmp/$f.o \
        -L/usr/local/cuda/lib64 -l:libcudart_static.a -ldl -lrt -lpthread -L"$site" -l:libtensorflow_framework.so.2 \
        -l:libtensorflow_cc.so.2 || exit 1
      new=$TF_FLASH_LIBRARY
      for run in new_1 old_1 new_2 old_2; do
        lib=$new; [[ $run == old* ]] && lib=$root/build/gpu/old.so
        TF_FLASH_LIBRARY=$lib timeout 100 python3 benchmarks/bench_gpu.py --impls tf_flash --dtypes bf16 --dims 128 \
          --grid 4:4096,2:8192,1:16384 --skip-memory --skip-extras --out-dir /tmp/ab_$run > "$OUT/ab_$run.log" 2>&1
        echo "== $run"; grep -E "^  tf_flash" "$OUT/ab_$run.log" | cut -c1-120
      done ;;
esac
