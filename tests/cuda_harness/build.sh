#!/usr/bin/env bash
# Builds the standalone forward harness (no TensorFlow) with nvcc, one object per instantiation, in
# parallel. Usage: tests/cuda_harness/build.sh [outdir]
#   ARCHS="80 90a"   targets (default both)      JOBS=N     parallel compiles (default nproc)
#   REDUCED=1        only head dims 64 and 128 (CI-sized build, TF_FLASH_CUDA_REDUCED)
#   VARIANTS=0       leave out the tile-shape variants (fwd_variants.cu)
#   EXTRA_NVCC_FLAGS more nvcc flags
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:-$root/build/cuda_harness}"
mkdir -p "$out"
cutlass="${CUTLASS_INCLUDE:-$(python3 -c 'import cutlass_library,os;print(os.path.join(os.path.dirname(cutlass_library.__file__),"source","include"))')}"
archs="${ARCHS:-80 90a}"
gencode=""
for a in $archs; do gencode+=" -gencode=arch=compute_${a},code=sm_${a}"; done
flags="-std=c++17 --expt-relaxed-constexpr -O3 -lineinfo $gencode -I$root -I$cutlass"
[ "${REDUCED:-0}" = 1 ] && flags+=" -DTF_FLASH_CUDA_REDUCED"
srcs=("$root"/cc/kernels/cuda/flash_fwd_*.cu "$root/cc/kernels/cuda/cuda_entry.cu" "$root/cc/kernels/cuda/family.cu" "$root/cc/kernels/cuda/support.cu"
      "$root/cc/kernels/cuda/stage.cu" "$root/cc/kernels/cuda/float32_kernels.cu" "$root/cc/kernels/cuda/packed_mask.cu"
      "$root/tests/cuda_harness/fwd_harness.cu")
[ "${PTXAS_VERBOSE:-0}" = 1 ] && flags+=" -Xptxas -v"
flags+=" ${EXTRA_NVCC_FLAGS:-}"  # e.g. -D switches of an experiment
jobs=()
for src in "${srcs[@]}"; do jobs+=("$src|"); done
if [ "${VARIANTS:-1}" = 1 ]; then  # one object per tile variant, plus the name table
  n=$(grep -c '^  X(' "$root/tests/cuda_harness/fwd_variants.cu")
  for ((i = 0; i < n; ++i)); do jobs+=("$root/tests/cuda_harness/fwd_variants.cu|$i"); done
  jobs+=("$root/tests/cuda_harness/fwd_variants.cu|registry")
fi
rm -f "$out"/*.o
printf '%s\n' "${jobs[@]}" | xargs -P "${JOBS:-$(nproc)}" -I{} sh -c '
  src="${1%|*}"; v="${1#*|}"; name=$(basename "$src" .cu); extra=""
  if [ "$v" = registry ]; then extra="-DTF_FLASH_VARIANT_REGISTRY"; name="${name}_registry"
  elif [ -n "$v" ]; then extra="-DTF_FLASH_VARIANT=$v"; name="${name}_$v"; fi
  nvcc '"$flags"' $extra -Xptxas -warn-spills -c "$src" -o "'"$out"'/$name.o"' _ {}
nvcc $gencode "$out"/*.o -o "$out/fwd_harness"
echo "built $out/fwd_harness"
