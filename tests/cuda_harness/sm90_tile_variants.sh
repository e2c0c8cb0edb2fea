#!/usr/bin/env bash
# Same-run comparison of Hopper forward tile configurations for one head dim, on the GPU machine, after
# `device_round.sh build` (which built the tree's configuration into build/cuda_harness_dev/):
#   tests/cuda_harness/sm90_tile_variants.sh 64 "128,2 128,3 96,3 64,3"
# Each "kBlockN,consumer warpgroups" variant recompiles only the two Hopper objects of that head dim
# (FwdConfigSm90 edited in a copy of the header, causal included), relinks a harness, runs `bench d` and `test` with it
# (the test's log: variant_<n>_<wg>_test.log in $OUT).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-/tmp/out}"
bin="$root/build/cuda_harness_dev"
d="${1:?head dim}"; variants="${2:?variants}"
cutlass="${CUTLASS_INCLUDE:?}"
flags="-std=c++17 --expt-relaxed-constexpr -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -I$cutlass"
for v in $variants; do
  n="${v%,*}"; wg="${v#*,}"; dir="/tmp/sm90_variant_${n}_${wg}"
  rm -rf "$dir" && mkdir -p "$dir/obj" && cp -r "$root/cc" "$dir/"
  # Both configurations of FwdConfigSm90<d> (Traits and BandedTraits) become the variant.
  sed -i -E "/struct FwdConfigSm90<$d, E>/,/^};/s/FwdTraitsSm90<$d, [0-9]+, ([0-9]+), E(, [0-9]+)?>/FwdTraitsSm90<$d, $n, \1, E, $wg>/" \
    "$dir/cc/kernels/cuda/fwd_kernel_sm90.h"
  grep -q "Traits = FwdTraitsSm90<$d, $n, [0-9]*, E, $wg>" "$dir/cc/kernels/cuda/fwd_kernel_sm90.h" || { echo "variant $v: edit failed"; continue; }
  ( for dt in bf16 fp16; do
      nvcc $flags -I"$dir" -Xptxas -warn-spills -c "$dir/cc/kernels/cuda/flash_fwd_sm90_${dt}_hdim$d.cu" \
        -o "$dir/obj/flash_fwd_sm90_${dt}_hdim$d.o" 2>&1 | grep -o "[0-9]* bytes spill stores" | sort -u | sed "s/^/$v $dt: /" &
    done; wait
    objs=$(ls "$bin"/*.o | grep -v "flash_fwd_sm90_.*_hdim$d.o")
    nvcc -gencode=arch=compute_90a,code=sm_90a $objs "$dir"/obj/*.o -o "$dir/fwd_harness" ) &
done
wait
for v in $variants; do
  n="${v%,*}"; wg="${v#*,}"; dir="/tmp/sm90_variant_${n}_${wg}"
  [ -x "$dir/fwd_harness" ] || { echo "variant $v: no binary"; continue; }
  echo "=== kBlockN $n, $wg consumer warpgroups"
  timeout 120 "$dir/fwd_harness" bench "$d" | grep -v "^device\|^dtype"
  timeout "${TEST_TIMEOUT:-150}" "$dir/fwd_harness" test > "$out/variant_${n}_${wg}_test.log" 2>&1
  echo "test rc $?: $(tail -1 "$out/variant_${n}_${wg}_test.log")"; grep FAIL "$out/variant_${n}_${wg}_test.log" | head -5
done
