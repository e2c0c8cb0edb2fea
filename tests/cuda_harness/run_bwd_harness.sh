#!/usr/bin/env bash
# Builds the CUDA backward (cc/kernels/cuda/flash_bwd_*.cu) with tests/cuda_harness/bwd_harness.cu, then runs
# the harness:   tests/cuda_harness/run_bwd_harness.sh [test | bench [head_dim ...]]   (default: test)
# Env: EXTRA_FLAGS (e.g. -DTF_FLASH_CUDA_REDUCED), CUTLASS_INCLUDE (default: the pip nvidia-cutlass headers), NVCC_ARCHS (default "80 90a"),
#      BWD_BUILD (default build/bwd_harness), JOBS (default nproc), BUILD_ONLY=1 to skip the run,
#      RECOMPILE="a.cu b.cu" to compile only those sources (names under cc/kernels/cuda/ or tests/cuda_harness/)
#      and link with the other objects already in BWD_BUILD (a variant of a few instantiation files).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cutlass=${CUTLASS_INCLUDE:-$(python3 -c "import cutlass_library,os;print(os.path.dirname(cutlass_library.__file__))")/source/include}
out=${BWD_BUILD:-$root/build/bwd_harness}
mkdir -p "$out"
gencode=""
for a in ${NVCC_ARCHS:-80 90a}; do gencode+=" -gencode=arch=compute_$a,code=sm_$a"; done
export BWD_FLAGS="-std=c++17 --expt-relaxed-constexpr -O3 -I$root -I$cutlass $gencode -Xcompiler -fopenmp ${EXTRA_FLAGS:-}"
export BWD_OUT=$out
sources=$(ls "$root"/cc/kernels/cuda/flash_bwd_*.cu "$root"/cc/kernels/cuda/{support,family,float32_kernels,packed_mask}.cu \
  "$root"/tests/cuda_harness/bwd_harness.cu)
if [ -n "${RECOMPILE:-}" ]; then
  sources=$(for f in $sources; do if [[ " $RECOMPILE " == *" $(basename "$f") "* ]]; then echo "$f"; fi; done)
fi
echo "$sources" | xargs -P "${JOBS:-$(nproc)}" -I{} sh -c \
    'f={}; o=$BWD_OUT/$(basename $f .cu).o; nvcc $BWD_FLAGS -Xptxas -v -c $f -o $o > $o.log 2>&1 || { cat $o.log; exit 1; }'
# Resource report of the dK/dV kernels: spills per (head dim, variant, arch).
grep -h -A2 "Compiling entry function.*bwd_dkdv" "$out"/*.o.log | grep -E "entry|spill" |
  sed -E "s/.*BwdTraitsILi([0-9]+)E.*N7cutlass[0-9]+([a-z0-9_]+)ELi([0-9])EEELb([01])ELb([01])E.*for '(sm_[0-9a]+)'.*/d\1 \2 stages=\3 masks=\4 dropout=\5 \6/" |
  paste - - | sort -u || true
nvcc $BWD_FLAGS -o "$out/bwd_harness" "$out"/*.o -lgomp
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
exec "$out/bwd_harness" "${@:-test}"
