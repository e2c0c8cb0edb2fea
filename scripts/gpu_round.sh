#!/usr/bin/env bash
# The TensorFlow GPU test-and-benchmark round on the lent GPU machine, which has nvcc and 16 cores but
# no Bazel, no TF headers and no network (TensorFlow itself arrives as a stash in .gpu/: the
# workplace's GPU pack, unpacked by .gpu/env/env.sh).
#
#   bash scripts/gpu_round.sh host            here: host objects of the op library compiled with the
#                                             GPU kernels registered, plus CUTLASS headers, in .gpu_build/
#   bash scripts/gpu_round.sh device [steps]  there: nvcc the .cu files (same flags as cc/BUILD, sm_90a),
#                                             link the library, then run steps: test, family (which kernel
#                                             family ran, robustness, determinism, softcap, validation,
#                                             float32 range), xla,
#                                             layers (layers, saving, Keras' switch, KerasHub), multi, sanitize,
#                                             bench, bench_model (the GPU-marked tests of each file);
#                                             with VARIANT_FLAGS / VARIANT_FILES also a variant library (below)
#
# The .cu files compile on the device's 16 cores in about a minute (hours of CPU here). The library is
# the same as Bazel's //cc:_flash_attention_ops.so with TF_FLASH_CUDA_ARCHS=90a; TF_FLASH_CUDA_ARCHS="80;90a"
# at the host step gives both (a release wheel: scripts/build_wheel.sh --library build/gpu/...so).
# `device none` only builds the library. A carry holds 64 MiB with the work tree: the tree is ~10 MB, so
# pack with parts of ~52 MB (PART_BYTES=52000000 ../shared/gpu/pack.sh, six stash calls): the default 62 MB
# part is refused. PART_BYTES counts on pack.sh's first run only: it caches the split parts.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:?host or device}"; shift || true
build=.gpu_build

if [[ $mode == host ]]; then
  exclude=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.gpu_build/' "$exclude" 2>/dev/null || echo '/.gpu_build/' >> "$exclude"
  rm -rf "$build" && mkdir -p "$build/obj"
  pids=()
  python3 - > "$build/flags" <<'PY'
import tensorflow as tf
print(" ".join(tf.sysconfig.get_compile_flags()))
PY
  tf_include=$(python3 -c "import tensorflow as tf; print(tf.sysconfig.get_include())" 2>/dev/null)
  cutlass=$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
  archs="${TF_FLASH_CUDA_ARCHS:-90a}"
  echo "${archs//;/ }" > "$build/archs"  # the device step compiles for these
  info="cuda=1;cuda_archs=$(echo ${archs//;/ } | tr ' ' ,);tf=$(python3 -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null)"
  # Every host source of the library (as cc/BUILD's globs), the XLA lowering and its CUDA FFI handler included.
  # XLA's headers include highwayhash and farmhash by their own roots (as @local_tf//:tensorflow_cc).
  for src in cc/ops/*.cc cc/kernels/*.cc cc/kernels/cpu/*.cc; do
    g++ -c -fPIC -O3 -mavx2 -mfma -mf16c -Wno-deprecated-declarations $(cat "$build/flags") -I. \
      -I"$tf_include/external/highwayhash" -I"$tf_include/external/farmhash_archive/src" \
      -I"$tf_include/third_party/gpus/cuda/include" -DTF_FLASH_WITH_CUDA=1 -DGOOGLE_CUDA=1 \
      "-DTF_FLASH_BUILD_INFO=\"$info\"" "$src" -o "$build/obj/$(basename "$src" .cc).o" &
    pids+=($!)
  done
  failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  (( failed == 0 )) || { echo "gpu_round: a host object failed to compile" >&2; exit 1; }
  tar -czf "$build/cutlass_include.tgz" -C "$cutlass/.." include
  du -sh "$build"
  exit 0
fi

# ---- device ----
out="${OUT:-/tmp/out}"; mkdir -p "$out"
set +eo pipefail  # env.sh is written for interactive shells
source .gpu/env/env.sh || { echo "gpu_round: TensorFlow is not stashed on this machine (stash every .gpu/pN first)" >&2; exit 1; }
set -eo pipefail
site=$(python3 -c "import tensorflow as tf, os; print(os.path.dirname(tf.__file__))")
mkdir -p /tmp/cutlass build/gpu/cuda_obj && tar -xzf "$build/cutlass_include.tgz" -C /tmp/cutlass
defines=$(tr ' ' '\n' < "$build/flags" | grep '^-D' | tr '\n' ' ')
start=$(date +%s)
# Rebuild only when the sources or host objects changed (build/ survives between calls on one machine).
gencode=$(for arch in $(cat "$build/archs" 2>/dev/null || echo 90a); do
  echo -n " -gencode=arch=compute_$arch,code=sm_$arch"; done)
compile_cuda() {  # compile_cuda DIR LOG [FLAGS]: the .cu paths on stdin into DIR/cuda_obj
  xargs -P 16 -I{} sh -c 'nvcc -std=c++17 -O3 --expt-relaxed-constexpr --expt-extended-lambda \
    -lineinfo -Xcompiler=-fPIC '"$gencode $defines"' -DNDEBUG '"${3:-}"' -I. -I/tmp/cutlass/include \
    -c {} -o '"$1"'/cuda_obj/$(basename {} .cu).o' > "$2" 2>&1 || { tail -40 "$2"; exit 1; }
}
link_library() {  # link_library DIR: DIR/_flash_attention_ops.so from the host objects and DIR's CUDA objects
  g++ -shared -o "$1/_flash_attention_ops.so" "$build"/obj/*.o "$1"/cuda_obj/*.o \
    -L/usr/local/cuda/lib64 -l:libcudart_static.a -ldl -lrt -lpthread -L"$site" -l:libtensorflow_framework.so.2 -l:libtensorflow_cc.so.2
}
stamp=$(cat cc/kernels/cuda/* cc/kernels/flash/* "$build"/obj/*.o | sha256sum | cut -c1-16)
if [[ "$(cat build/gpu/stamp 2>/dev/null)" != "$stamp" ]]; then
ls cc/kernels/cuda/*.cu | compile_cuda build/gpu "$out/nvcc.log"
link_library build/gpu
echo "$stamp" > build/gpu/stamp
echo "gpu_round: library built in $(( $(date +%s) - start ))s"
fi
# VARIANT_FLAGS (-D switches) and VARIANT_FILES (instantiation files under cc/kernels/cuda/): a second library in
# build/gpu_variant, the default one's objects with those files recompiled under the flags, for an A/B through TF.
if [[ -n "${VARIANT_FLAGS:-}" ]]; then
  rm -rf build/gpu_variant && mkdir -p build/gpu_variant && cp -r build/gpu/cuda_obj build/gpu_variant/
  (cd cc/kernels/cuda && ls ${VARIANT_FILES:?the files VARIANT_FLAGS changes}) | sed 's|^|cc/kernels/cuda/|' |
    compile_cuda build/gpu_variant "$out/nvcc_variant.log" "$VARIANT_FLAGS"
  link_library build/gpu_variant
  echo "gpu_round: variant library ($VARIANT_FLAGS) built in $(( $(date +%s) - start ))s"
fi
export TF_FLASH_LIBRARY=$PWD/build/gpu/_flash_attention_ops.so PYTHONUNBUFFERED=1
# KerasHub for its tests, from wheels carried in .whl/ (pip download here: the device has no network).
source scripts/device_keras_hub.sh
python3 -c "import tf_flash, tensorflow as tf; print(tf_flash.build_info(), tf.config.list_physical_devices('GPU'))"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
set +e  # every step runs; each leaves its log under $OUT
for step in "${@:-test}"; do
  case $step in
    test) timeout 420 python3 -m pytest -q tests/test_flash_attention.py tests/test_dropout.py tests/test_sparsity.py \
            -m gpu -p no:cacheprovider 2>&1 | tee "$out/pytest_gpu_ops.log" | tail -25 ;;
    family) timeout 300 python3 -m pytest -q tests/test_kernel_family.py tests/test_robustness.py tests/test_determinism.py \
            tests/test_softcap.py tests/test_validation.py tests/test_float32_range.py -m gpu -p no:cacheprovider 2>&1 \
            | tee "$out/pytest_gpu_family.log" | tail -15 ;;
    xla) timeout 540 python3 -m pytest -q tests/test_xla.py -m gpu -p no:cacheprovider 2>&1 \
            | tee "$out/pytest_gpu_xla.log" | tail -25 ;;
    layers) timeout 300 python3 -m pytest -q tests/test_layers.py tests/test_saving.py tests/test_keras_hook.py \
            tests/test_keras_hub.py -m gpu -p no:cacheprovider 2>&1 \
            | tee "$out/pytest_gpu_layers.log" | tail -15 ;;
    multi) nvidia-smi -L; timeout 300 python3 -m pytest -q tests/test_saving.py -k mirrored -rs -p no:cacheprovider 2>&1 \
            | tee "$out/pytest_multi_gpu.log" | tail -8 ;;
    sanitize) timeout 200 compute-sanitizer --tool memcheck python3 -m pytest -q -x tests/test_flash_attention.py -m gpu \
            -k "outputs_fully_written or empty or nothing_visible" -p no:cacheprovider 2>&1 \
            | tee "$out/sanitize.log" | tail -8 ;;
    bench) timeout "${BENCH_TIMEOUT:-560}" python3 benchmarks/bench_gpu.py ${BENCH_ARGS:-} 2>&1 | tee "$out/bench_gpu.log" | tail -40 ;;
    bench_model) timeout "${BENCH_TIMEOUT:-560}" python3 benchmarks/bench_model.py --out-dir "$out" ${BENCH_MODEL_ARGS:-} 2>&1 \
            | tee "$out/bench_model.log" | tail -60 ;;
  esac
done
