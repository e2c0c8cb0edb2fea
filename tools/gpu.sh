#!/usr/bin/env bash
# The GPU workflow in one tool: the op library built for the lent GPU machine, the GPU test suites and the
# benchmarks through TensorFlow, and the CUDA harnesses (the kernels without TensorFlow) with their same-run A/B.
# The lent machine has nvcc, 16 cores, PyTorch and ncu, but no Bazel, no TensorFlow headers and no network: the
# library's host objects are compiled here and carried, its .cu files compile there (about 80 s), and
# TensorFlow arrives as the workplace's stash (../shared/gpu/pack.sh -> .gpu/). docs/development.md has the
# session step by step, with the carry lists.
#
# Here:
#   tools/gpu.sh host              the library's host objects (GPU kernels registered) and the CUTLASS headers,
#                                  into .gpu_build/; TF_FLASH_CUDA_ARCHS="80;90a" has the device compile both
#                                  (default 90a); DRY_RUN=1 prints the compiles and writes nothing
#   tools/gpu.sh baseline REV      cc/ and tests/cuda_harness/ of git revision REV into .baseline/: `ab`'s base
#   tools/gpu.sh cuda-import DIR   a `cuda-export` call's files (DIR: its files_at) into .gpu_cuda/, which a fresh
#                                  machine's `lib` unpacks, compiling only the .cu files whose stamps changed
#                                  (carry .gpu_cuda)
#   tools/gpu.sh cuda-here         the same objects compiled here into build/gpu/ and packed into .gpu_cuda/ (the
#                                  lent machines' nvcc is this machine's, 13.0): after a kernel header changed,
#                                  a fresh machine links in about 20 s instead of compiling for about 4 minutes
#                                  of its 30 (here: about 20 minutes on 2 cores, no device time)
# There, through TensorFlow (after the stash calls; carry .gpu/env and .gpu_build, and .whl for KerasHub):
#   tools/gpu.sh lib               nvcc the .cu files (cc/BUILD's flags) and link build/gpu/_flash_attention_ops.so,
#                                  again only when a source changed. VARIANT_FLAGS="-D..." VARIANT_FILES="globs"
#                                  also link build/gpu_variant/: those files of cc/kernels/cuda recompiled under
#                                  the flags; USE_VARIANT=1 has the subcommands below load that one (built
#                                  by an earlier call on the machine, or by this one with VARIANT_FLAGS set)
#   tools/gpu.sh test [GROUP...]   lib, then the GPU-marked tests of each group, in turn (default: ops xla layers
#                                  family numerics sanitize, about 10 minutes on an H100 with the library built):
#                                  ops       op, dropout, sparsity
#                                  family    kernel family (about 8 minutes: a call of its own)
#                                  fp8       the FP8 (float8_e4m3fn) Hopper forward (tests/test_fp8.py)
#                                  segments  packed documents: segment ids through the op, the layers and
#                                            the kernel families (about 2 minutes)
#                                  numerics  robustness, determinism, softcap, validation, float32 range
#                                  xla       XLA
#                                  layers    layers, saving, Keras' switch, KerasHub (its wheels in .whl/)
#                                  other     every test file no group above names
#                                  multi     MirroredStrategy over the machine's GPUs
#                                  sanitize  compute-sanitizer memcheck over the op's output and empty-row cases
#   tools/gpu.sh bench [ARGS...]   lib, then benchmarks/bench_gpu.py ARGS (default: the kernel table's tf_flash rows:
#                                  bf16, head dims 64/128/256, ten attentions per tf.function). torch's rows run
#                                  outside this tool (bench_gpu.py --torch-only): TensorFlow's environment puts an
#                                  older cuDNN than torch's on the library path (docs/performance.md)
#   tools/gpu.sh model [ARGS...]   lib, then benchmarks/bench_model.py ARGS, XLA's autotuning cache shared
#   tools/gpu.sh run CMD...        lib, then CMD in TensorFlow's environment (TF_FLASH_LIBRARY, PYTHONPATH set)
#   tools/gpu.sh cuda-export       lib, then its CUDA objects and their stamps into $OUT as xz parts of 15 MiB
#                                  (cuda_obj.tar.xz.NN; the only files of the call): a later machine compiles only
#                                  the .cu files changed since (all of them after a header change; all take about
#                                  4 of its 30 minutes)
# There, the CUDA harnesses alone (no TensorFlow, no stash; carry .gpu_build for the CUTLASS headers):
#   tools/gpu.sh harness [STEP...] the harnesses of tests/cuda_harness, built in build/cuda_harness_dev/ when a
#                                  step needs them (default: build test bigoffset bench tiles sanitize):
#                                  forward   build sass regs test bigoffset fp32 bench bench80 tiles feat ncu
#                                            sanitize racecheck torch
#                                  backward  bwd_build bwd_test bwd_bench bwd_bench80 bwd_ncu bwd_sanitize bwd_racecheck
#   tools/gpu.sh ab [BASE] [D...]  same-run A/B of the harnesses: BASE's (a tree from `baseline`; default this
#                                  one) against this tree's built with VARIANT_FLAGS, benchmarks alternated,
#                                  the median TFLOP/s ratio new / base per dtype, head dim and causal
#   tools/gpu.sh sm90-tiles D "N,WG ..."   Hopper forward tile configurations of head dim D (key tile N,
#                                  WG consumer warpgroups): each variant's benchmark and tests
#
# Knobs: ARCHS (harness targets, default 90a), JOBS, REDUCED=1 (head dims 64 and 128 only; `ab`'s default),
# BENCH_DIMS, VARIANTS=0 (no tile variants in the forward harness), PTXAS_VERBOSE=1 (for `regs`), NCU_SHAPES
# ("d:seqlen ...", forward), BWD_NCU_SHAPE (`bench1` arguments); for `ab`: PASSES (2), FAMILIES ("default sm80"
# adds the sm_80 family), FWD_ONLY=1, BWD_ONLY=1, SKIP_BUILD=1, AB_TESTS=1 (the new side's harness tests first).
# A device subcommand ends DEADLINE seconds after it starts (default 570, inside a call's 10 minutes: each
# step's time limit is cut to what is left), packs its logs and results into $OUT/<subcommand>.tgz
# (<subcommand>_2.tgz for a second one in the same call: $OUT returns at most 8 files) and prints a short
# table last.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=.gpu_build    # made here by `host`, carried: host objects, TF's compile flags, the archs, CUTLASS headers
dev=build/cuda_harness_dev
say() { echo "tools/gpu.sh: $*"; }
die() { echo "tools/gpu.sh: $*" >&2; exit 1; }
gencode() { local a; for a; do echo -n " -gencode=arch=compute_$a,code=sm_$a"; done; }

# ---- here ----

host() {
  if [[ -z "${PYTHON:-}" && -n "${VIRTUAL_ENV:-}" ]]; then PYTHON="$VIRTUAL_ENV/bin/python"; fi
  local py=${PYTHON:-python3} tf flags tf_include cutlass archs info src pids=() failed=0 cxx=(g++)
  tf=$("$py" -c 'import tensorflow as tf
print(" ".join(tf.sysconfig.get_compile_flags())); print(tf.sysconfig.get_include()); print(tf.__version__)')
  flags=$(sed -n 1p <<<"$tf"); tf_include=$(sed -n 2p <<<"$tf")
  cutlass=$("$py" -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
  archs=${TF_FLASH_CUDA_ARCHS:-90a}; archs=${archs//[;,]/ }
  info="cuda=1;cuda_archs=$(echo $archs | tr ' ' ,);tf=$(sed -n 3p <<<"$tf")"
  # Every host source of the library (cc/BUILD's globs), the XLA lowering and its CUDA FFI handler included.
  # XLA's headers include highwayhash and farmhash by their own roots (as @local_tf//:tensorflow_cc).
  compile() {  # compile SOURCE; the CPU kernels' *_avx512.cc and *_avx512bf16.cc alone get AVX-512 (cc/BUILD's
    local isa=()  # _AVX512_COPTS and _AVX512BF16_COPTS)
    [[ $1 == *_avx512.cc ]] && isa=(-mavx512f -Wno-uninitialized -Wno-maybe-uninitialized)
    [[ $1 == *_avx512bf16.cc ]] &&
      isa=(-mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mamx-tile -mamx-bf16 -Wno-uninitialized
           -Wno-maybe-uninitialized)
    "${cxx[@]}" -c -fPIC -O3 -mavx2 -mfma -mf16c "${isa[@]}" -Wno-deprecated-declarations $flags -I. \
      -I"$tf_include/external/highwayhash" -I"$tf_include/external/farmhash_archive/src" \
      -I"$tf_include/third_party/gpus/cuda/include" -DTF_FLASH_WITH_CUDA=1 -DGOOGLE_CUDA=1 \
      "-DTF_FLASH_BUILD_INFO=\"$info\"" "$1" -o "$build/obj/$(basename "$1" .cc).o"
  }
  if [[ ${DRY_RUN:-0} == 1 ]]; then
    cxx=(echo g++)
    for src in cc/ops/*.cc cc/kernels/*.cc cc/kernels/cpu/*.cc; do compile "$src"; done
    say "would write $build/: obj/*.o, flags, archs ($archs), cutlass_include.tgz (from $cutlass)"
    return
  fi
  rm -rf "$build" && mkdir -p "$build/obj"
  echo "$flags" > "$build/flags"
  echo "$archs" > "$build/archs"  # the device step compiles for these
  # The tree travels without its git history: the results made there name this commit (+dirty: edits
  # not committed when `host` ran).
  echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo +dirty)" > "$build/source_commit"
  for src in cc/ops/*.cc cc/kernels/*.cc cc/kernels/cpu/*.cc; do
    compile "$src" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  (( failed == 0 )) || die "a host object failed to compile"
  tar -czf "$build/cutlass_include.tgz" -C "$cutlass/.." include
  du -sh "$build"
}

baseline() {
  local rev=${1:?usage: tools/gpu.sh baseline REV}
  rm -rf .baseline && mkdir -p .baseline
  git archive "$rev" cc tests/cuda_harness | tar -x -C .baseline
  say ".baseline/ holds cc/ and tests/cuda_harness/ of $(git rev-parse --short "$rev"): carry it"
}

# ---- there: common ----

device_start() {  # device_start NAME: the clock, the work folder, and its archive in $OUT at exit
  out=${OUT:-/tmp/out}; mkdir -p "$out"
  start=$(date +%s); deadline=$(( start + ${DEADLINE:-570} ))
  work=/tmp/tf_flash_gpu/$1
  rm -rf "$work" && mkdir -p "$work"
  archive=$out/$1.tgz
  local n=2
  while [[ -e $archive ]]; do archive=$out/${1}_$n.tgz; n=$(( n + 1 )); done
  trap 'tar -czf "$archive" -C "$(dirname "$work")" "$(basename "$work")"; say "logs: $archive, $(( $(date +%s) - start ))s in all"' EXIT
}
limit() {  # limit SECONDS: SECONDS, or the time left before the deadline when that is less
  local left=$(( deadline - $(date +%s) ))
  (( left > 1 )) || left=1
  echo $(( $1 < left ? $1 : left ))
}
has_arg() {  # has_arg OPTION ARGS...: whether ARGS name OPTION
  local option=$1 a; shift
  for a; do [[ $a == "$option" || $a == "$option="* ]] && return 0; done
  return 1
}
# sources_stamp [! GLOB] DIR... [-- WORDS]: a hash of the files under DIR... (but those named GLOB) and of WORDS
# (the flags).
sources_stamp() {
  local dirs=() skip=()
  if [[ $1 == '!' ]]; then skip=(! -name "$2"); shift 2; fi
  while [[ $# -gt 0 && $1 != -- ]]; do dirs+=("$1"); shift; done
  { find "${dirs[@]}" -type f "${skip[@]}" | sort | xargs cat; echo "$@"; } | sha256sum | cut -c1-16
}
cutlass_headers() {  # CUTLASS_INCLUDE: as set, else the headers `host` carried in .gpu_build, else pip's
  if [[ -z ${CUTLASS_INCLUDE:-} ]]; then
    if [[ -f $build/cutlass_include.tgz ]]; then
      [[ -d /tmp/cutlass/include ]] || { mkdir -p /tmp/cutlass && tar -xzf "$build/cutlass_include.tgz" -C /tmp/cutlass; }
      CUTLASS_INCLUDE=/tmp/cutlass/include
    else
      CUTLASS_INCLUDE=$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
    fi
  fi
  export CUTLASS_INCLUDE
}

cuda_import() {  # cuda_import DIR: cuda-export's parts from DIR into .gpu_cuda/cuda_obj.tar.xz, checked
  local parts
  parts=$(ls "${1:?usage: tools/gpu.sh cuda-import DIR}"/cuda_obj.tar.xz.[0-9]* 2>/dev/null) || die "no cuda_obj.tar.xz.NN in $1"
  mkdir -p .gpu_cuda
  # shellcheck disable=SC2086  # the parts' names hold no spaces
  cat $parts > .gpu_cuda/cuda_obj.tar.xz
  xz -t .gpu_cuda/cuda_obj.tar.xz || { rm -f .gpu_cuda/cuda_obj.tar.xz; die "the parts in $1 do not make a whole archive"; }
  say ".gpu_cuda/cuda_obj.tar.xz: $(du -h .gpu_cuda/cuda_obj.tar.xz | cut -f1), $(xz -dc .gpu_cuda/cuda_obj.tar.xz |
    tar -tf - | grep -c '\.o$') objects; carry .gpu_cuda"
}
# An object's stamp: the flags, every header of the kernels (any change recompiles every object) and its own .cu.
cuda_headers_stamp() { sources_stamp '!' '*.cu' cc/kernels/cuda cc/kernels/flash -- "$(cat "$build/flags" "$build/archs")"; }
cuda_object_stamp() { { echo "$1"; cat "$2"; } | sha256sum | cut -c1-16; }  # cuda_object_stamp HEADERS_STAMP FILE.cu

# ---- there: the library through TensorFlow ----

compile_cuda() {  # compile_cuda DIR LOG [FLAGS]: the .cu paths on stdin into DIR/cuda_obj, as cc/BUILD compiles them
  local gc defines
  gc=$(gencode $(cat "$build/archs"))
  defines=$(tr ' ' '\n' < "$build/flags" | grep '^-D' | tr '\n' ' ')
  mkdir -p "$1/cuda_obj"
  xargs -P "$(nproc)" -I{} sh -c 'nvcc -std=c++17 -O3 --expt-relaxed-constexpr --expt-extended-lambda \
    -lineinfo -Xcompiler=-fPIC '"$gc $defines"' -DNDEBUG '"${3:-}"' -I. -I"$CUTLASS_INCLUDE" \
    -c {} -o '"$1"'/cuda_obj/$(basename {} .cu).o' > "$2" 2>&1 || { tail -40 "$2"; die "nvcc failed ($2)"; }
}
link_library() {  # link_library DIR: DIR/_flash_attention_ops.so from the host objects and DIR's CUDA objects
  local site
  site=$(python3 -c "import tensorflow as tf, os; print(os.path.dirname(tf.__file__))")
  g++ -shared -o "$1/_flash_attention_ops.so" "$build"/obj/*.o "$1"/cuda_obj/*.o \
    -L/usr/local/cuda/lib64 -l:libcudart_static.a -ldl -lrt -lpthread -L"$site" -l:libtensorflow_framework.so.2 \
    -l:libtensorflow_cc.so.2 || die "linking $1 failed"
}
cuda_objects() {  # cuda_objects LOG: build/gpu/cuda_obj up to date with the tree's .cu files and headers
  local headers f o name stale=()
  # build/ stays between calls on one machine: a .cu file compiles again when it, a header or the flags
  # changed (its stamp). A fresh machine starts from the CUDA objects carried in .gpu_cuda (cuda-export and
  # cuda-import, or cuda-here): those whose stamps still hold are kept.
  if [[ ! -d build/gpu && -f .gpu_cuda/cuda_obj.tar.xz ]]; then
    mkdir -p build && { xz -dc .gpu_cuda/cuda_obj.tar.xz | tar -xf - -C build; } || rm -rf build/gpu
  fi
  mkdir -p build/gpu/cuda_obj
  for o in build/gpu/cuda_obj/*.o; do  # objects of .cu files no longer in the tree
    if [[ -f $o && ! -f cc/kernels/cuda/$(basename "$o" .o).cu ]]; then rm -f "$o" "${o%.o}.stamp"; fi
  done
  headers=$(cuda_headers_stamp)
  for f in cc/kernels/cuda/*.cu; do
    name=build/gpu/cuda_obj/$(basename "$f" .cu)
    if [[ ! -f $name.o || "$(cat "$name.stamp" 2>/dev/null)" != "$(cuda_object_stamp "$headers" "$f")" ]]; then
      stale+=("$f")
    fi
  done
  if (( ${#stale[@]} > 0 )); then
    say "compiling ${#stale[@]} of $(ls cc/kernels/cuda/*.cu | wc -l) .cu files"
    printf '%s\n' "${stale[@]}" | compile_cuda build/gpu "$1"
    for f in "${stale[@]}"; do cuda_object_stamp "$headers" "$f" > "build/gpu/cuda_obj/$(basename "$f" .cu).stamp"; done
  fi
}
tf_env() {  # TensorFlow's environment from the stash, the library built, KerasHub from the carried wheels
  [[ -f .gpu/env/env.sh ]] || die "carry .gpu/env (../shared/gpu/pack.sh here)"
  [[ -f $build/flags ]] || die "no $build/: run tools/gpu.sh host here and carry .gpu_build"
  set +eo pipefail  # env.sh is written for interactive shells
  source .gpu/env/env.sh || die "TensorFlow is not stashed on this machine (stash every .gpu/pN first)"
  set -eo pipefail
  cutlass_headers
  local t0 cuda_stamp link_stamp
  t0=$(date +%s)
  cuda_objects "$work/nvcc.log"
  cuda_stamp=$(cat build/gpu/cuda_obj/*.stamp | sha256sum | cut -c1-16)
  link_stamp=$(sources_stamp "$build/obj" -- "$cuda_stamp")
  if [[ "$(cat build/gpu/link_stamp 2>/dev/null)" != "$link_stamp" ]]; then
    link_library build/gpu
    echo "$link_stamp" > build/gpu/link_stamp
    say "library built in $(( $(date +%s) - t0 ))s"
  fi
  if [[ -n "${VARIANT_FLAGS:-}" ]]; then  # an A/B through TF: the default library's objects, FILES under FLAGS
    rm -rf build/gpu_variant && mkdir -p build/gpu_variant && cp -r build/gpu/cuda_obj build/gpu_variant/
    # shellcheck disable=SC2086  # VARIANT_FILES holds globs
    (cd cc/kernels/cuda && ls ${VARIANT_FILES:?the files VARIANT_FLAGS changes}) | sed 's|^|cc/kernels/cuda/|' |
      compile_cuda build/gpu_variant "$work/nvcc_variant.log" "$VARIANT_FLAGS"
    link_library build/gpu_variant
    say "variant library ($VARIANT_FLAGS) built in $(( $(date +%s) - t0 ))s"
  fi
  export TF_FLASH_LIBRARY=$root/build/gpu/_flash_attention_ops.so PYTHONUNBUFFERED=1
  if [[ -f $build/source_commit ]]; then export TF_FLASH_SOURCE_COMMIT; TF_FLASH_SOURCE_COMMIT=$(cat "$build/source_commit"); fi
  if [[ ${USE_VARIANT:-0} == 1 ]]; then
    TF_FLASH_LIBRARY=$root/build/gpu_variant/_flash_attention_ops.so
    [[ -f $TF_FLASH_LIBRARY ]] || die "USE_VARIANT=1: no variant library on this machine (VARIANT_FLAGS and VARIANT_FILES build it)"
  fi
  if ls .whl/*.whl > /dev/null 2>&1; then  # pip-downloaded here: the device has no network
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  export PYTHONPATH=$root:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  say "library: $TF_FLASH_LIBRARY" | tee "$work/library.txt"
  python3 -c "import tf_flash, tensorflow as tf; print(tf_flash.build_info(), tf.config.list_physical_devices('GPU'))"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$work/device.txt"
}

existing() {  # existing FILE...: those that exist (a group's files, while the test layout moves)
  local f
  for f; do if [[ -e $f ]]; then echo "$f"; else say "no $f: left out" >&2; fi; done
}
group_files() {  # group_files GROUP: the test files of a group of `test`
  case $1 in
    ops) existing tests/test_flash_attention.py tests/test_dropout.py tests/test_sparsity.py ;;
    family) existing tests/test_kernel_family.py ;;
    numerics) existing tests/test_robustness.py tests/test_determinism.py tests/test_softcap.py tests/test_validation.py \
                tests/test_float32_range.py ;;
    xla) existing tests/test_xla.py ;;
    layers) existing tests/test_layers.py tests/test_saving.py tests/test_keras_hook.py tests/test_keras_hub.py ;;
    other) local named f
           named=$(for g in ops family numerics xla layers; do group_files "$g" 2>/dev/null; done; echo tests/test_fp8.py)
           for f in tests/test_*.py; do grep -qx "$f" <<<"$named" || echo "$f"; done ;;
  esac
}
suite() {  # suite GROUP SECONDS CMD...: one group, its log in the work folder, its last line in the summary
  local group=$1 seconds=$2 rc=0; shift 2
  timeout "$(limit "$seconds")" "$@" > "$work/pytest_$group.log" 2>&1 || rc=$?
  grep -E "^(FAILED|ERROR)" "$work/pytest_$group.log" | head -n 10
  summary+=("$group (rc $rc): $(tail -n 1 "$work/pytest_$group.log")")
  (( rc == 0 || rc == 5 )) || failures=$(( failures + 1 ))  # 5: pytest found no GPU test there
}
test_groups() {  # test_groups GROUP...: the groups in turn, every one run; the status says whether all passed
  local groups=("$@") group files pytest=(python3 -m pytest -q -p no:cacheprovider)
  (( ${#groups[@]} )) || groups=(ops xla layers family numerics sanitize)
  summary=() failures=0
  for group in "${groups[@]}"; do
    case $group in
      ops|family|numerics|xla|layers|other)
        files=$(group_files "$group")
        if [[ -z $files ]]; then summary+=("$group: no test files"); continue; fi
        local seconds
        case $group in ops|other|family) seconds=420 ;; xla) seconds=540 ;; *) seconds=300 ;; esac
        # shellcheck disable=SC2086  # files are words
        suite "$group" "$seconds" "${pytest[@]}" $files -m gpu ;;
      fp8) suite fp8 420 "${pytest[@]}" tests/test_fp8.py -m gpu ;;
      segments) suite segments 300 "${pytest[@]}" tests/test_segments.py tests/test_layers_segments.py \
                  tests/test_kernel_family.py -m gpu -k "segment or Segment" ;;
      multi) nvidia-smi -L; suite multi 300 "${pytest[@]}" tests/test_saving.py -k mirrored -rs ;;
      sanitize) suite sanitize 200 compute-sanitizer --tool memcheck "${pytest[@]}" -x tests/test_flash_attention.py \
                  -m gpu -k "outputs_fully_written or empty or nothing_visible" ;;
      *) die "unknown test group $group" ;;
    esac
  done
  printf '%s\n' "${summary[@]}"
  (( failures == 0 ))
}
benchmark() {  # benchmark NAME SCRIPT ARGS...: a benchmark script, its files in the work folder's NAME/
  local name=$1 script=$2 rc=0; shift 2
  mkdir -p "$work/$name"
  # Results come back as files: the tool chooses the folder (the last --out-dir counts).
  timeout "$(limit 590)" python3 "$script" "$@" --out-dir "$work/$name" > "$work/$name.log" 2>&1 || rc=$?
  tail -n 60 "$work/$name.log"
  say "$name: rc $rc; its files: $(cd "$work/$name" && ls | tr '\n' ' ')"
  return "$rc"
}

# ---- there: the CUDA harnesses ----

harness_build() {  # harness_build fwd|bwd TREE DIR: TREE's harness into DIR, each object's compiler output in DIR/*.o.log
  local which=$1 tree=$2 dir=$3 gc flags per_object src i n stamp jobs=()
  local cu=$tree/cc/kernels/cuda
  cutlass_headers
  gc=$(gencode ${ARCHS:-90a})
  flags="-std=c++17 --expt-relaxed-constexpr -O3 -I$tree -I$CUTLASS_INCLUDE $gc ${EXTRA:-}"
  if [[ ${REDUCED:-0} == 1 ]]; then flags+=" -DTF_FLASH_CUDA_REDUCED"; fi
  stamp=$(harness_stamp "$which" "$tree")
  mkdir -p "$dir" && rm -f "$dir"/*.o "$dir"/*.o.log "$dir/stamp"
  if [[ $which == fwd ]]; then
    flags+=" -lineinfo"
    per_object="-Xptxas -warn-spills"
    if [[ ${PTXAS_VERBOSE:-0} == 1 ]]; then per_object+=" -Xptxas -v"; fi
    for src in "$cu"/flash_fwd_*.cu "$cu"/{cuda_entry,family,support,stage,float32_kernels,packed_mask,fp8_values}.cu \
               "$tree/tests/cuda_harness/fwd_harness.cu"; do jobs+=("$src|"); done
    if [[ ${VARIANTS:-1} == 1 ]]; then  # one object per tile variant, plus the name table
      n=$(grep -c '^  X(' "$tree/tests/cuda_harness/fwd_variants.cu")
      for ((i = 0; i < n; ++i)); do jobs+=("$tree/tests/cuda_harness/fwd_variants.cu|$i"); done
      jobs+=("$tree/tests/cuda_harness/fwd_variants.cu|registry")
    fi
  else
    flags+=" -Xcompiler -fopenmp"
    per_object="-Xptxas -v"  # for the spill report below
    for src in "$cu"/flash_bwd_*.cu "$cu"/{support,family,float32_kernels,packed_mask}.cu \
               "$tree/tests/cuda_harness/bwd_harness.cu"; do jobs+=("$src|"); done
  fi
  printf '%s\n' "${jobs[@]}" | HARNESS_FLAGS="$flags $per_object" HARNESS_DIR=$dir xargs -P "${JOBS:-$(nproc)}" -I{} sh -c '
    src=${1%|*}; v=${1#*|}; name=$(basename "$src" .cu); extra=""
    if [ "$v" = registry ]; then extra=-DTF_FLASH_VARIANT_REGISTRY; name=${name}_registry
    elif [ -n "$v" ]; then extra=-DTF_FLASH_VARIANT=$v; name=${name}_$v; fi
    nvcc $HARNESS_FLAGS $extra -c "$src" -o "$HARNESS_DIR/$name.o" > "$HARNESS_DIR/$name.o.log" 2>&1 ||
      { cat "$HARNESS_DIR/$name.o.log"; exit 1; }' _ {} || return 1
  if [[ $which == fwd ]]; then
    nvcc $gc "$dir"/*.o -o "$dir/fwd_harness" || return 1
    grep -h "spill" "$dir"/*.o.log | sed 's/.*function .\(_Z[^ ]*\)., \(.*\)/\2  \1/' | cut -c1-160 > "$dir/spills.txt" || true
  else
    nvcc $flags -o "$dir/bwd_harness" "$dir"/*.o -lgomp || return 1
    # Spills of the dK/dV kernels per (head dim, variant, arch).
    grep -h -A2 "Compiling entry function.*bwd_dkdv" "$dir"/*.o.log | grep -E "entry|spill" |
      sed -E "s/.*BwdTraitsILi([0-9]+)E.*N7cutlass[0-9]+([a-z0-9_]+)ELi([0-9])EEELb([01])ELb([01])E.*for '(sm_[0-9a]+)'.*/d\1 \2 stages=\3 masks=\4 dropout=\5 \6/" |
      paste - - | sort -u > "$dir/spills.txt" || true
  fi
  echo "$stamp" > "$dir/stamp"
  say "built $dir/${which}_harness"
}
ncu_profile() {  # ncu_profile NAME KERNEL SKIP BINARY ARGS...: one launch's sections and per-instruction samples
  local name=$1 kernel=$2 skip=$3 rc=0; shift 3
  timeout "$(limit 150)" ncu --clock-control none --kernel-name "regex:$kernel" --launch-skip "$skip" --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section SourceCounters \
    --section MemoryWorkloadAnalysis --section LaunchStats \
    --metrics regex:sm__pipe_tensor.*cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,sm__cycles_active.avg \
    --import-source yes -o "/tmp/ncu_$name" -f "$@" > "$work/ncu_${name}_run.log" 2>&1 || rc=$?
  if (( rc != 0 )); then say "ncu $name rc $rc"; tail -n 5 "$work/ncu_${name}_run.log"; return; fi
  ncu -i "/tmp/ncu_$name.ncu-rep" --page details > "$work/ncu_${name}_details.txt" 2>&1
  { echo "== $name"
    grep -E "Duration|Throughput|pipe_tensor|inst_executed|cycles_active|Issue|Warp Cycles Per|Executed Ipc|SM Busy|Registers|Local|L2 Hit|Grid Size|Block Size|Waves" \
      "$work/ncu_${name}_details.txt" | awk '{$1=$1; print}' | cut -c1-140; } >> "$work/ncu_summary.txt"
  ncu -i "/tmp/ncu_$name.ncu-rep" --page source --csv --print-source sass 2>/dev/null | gzip > "$work/ncu_${name}_sass.csv.gz"
  python3 tools/ncu_summary.py "$work/ncu_${name}_sass.csv.gz" | tee -a "$work/ncu_stalls.txt"
}
harness_stamp() {  # harness_stamp fwd|bwd TREE: what a harness build depends on
  sources_stamp "$2/cc/kernels/cuda" "$2/cc/kernels/flash" "$2/tests/cuda_harness" -- "$1" "${ARCHS:-90a}" \
    "${REDUCED:-0}" "${VARIANTS:-1}" "${PTXAS_VERBOSE:-0}" "${EXTRA:-}"
}
need() {  # need fwd|bwd: this tree's harness, built when a step needs it and the build on the machine is stale
  case $1 in
    fwd) [[ "$(cat "$dev/stamp" 2>/dev/null)" == "$(harness_stamp fwd "$root")" ]] || harness_step build ;;
    bwd) [[ "$(cat "$dev/bwd/stamp" 2>/dev/null)" == "$(harness_stamp bwd "$root")" ]] || harness_step bwd_build ;;
  esac
}
harness_step() {  # harness_step STEP: one step of `harness`, its logs in the work folder
  local step=$1 rc=0 tool cfg d s
  echo "=== $step ($(date -u +%H:%M:%S))"
  case $step in
    build) JOBS=${JOBS:-16} harness_build fwd "$root" "$dev" > "$work/build.log" 2>&1 ||
             { tail -n 30 "$work/build.log"; die "the forward harness failed to build"; }
           cat "$dev/spills.txt" ;;
    sass) for o in "$dev"/flash_fwd_sm90_bf16_hdim*.o; do
            echo "$(basename "$o"): $(cuobjdump -sass "$o" | grep -oE "HGMMA|USETMAXREG|UTMALDG|LDL|STL" | sort | uniq -c | tr '\n' ' ')"
          done ;;
    regs) grep -h -A1 "Compiling entry function" "$dev"/*.o.log | grep -o "_ZN8tf_flash[^']*\|Used [0-9]* registers" | paste - - |
            sed 's/_ZN8tf_flash4cuda16flash_fwd_kernelINS0_9FwdTraitsI//' | cut -c1-120 | sort -u ;;
    test) need fwd; timeout "$(limit 300)" "$dev/fwd_harness" test > "$work/test.log" 2>&1 || rc=$?
          grep -E "FAIL|unsupported|passed" "$work/test.log" | tail -n 15
          (( rc == 0 )) || echo "TEST FAILURES (rc $rc)" ;;
    bigoffset|fp32) need fwd; timeout "$(limit 300)" "$dev/fwd_harness" "$step" ;;
    bench) need fwd; timeout "$(limit 300)" "$dev/fwd_harness" bench ${BENCH_DIMS:-64 128 256} > "$work/bench.log" 2>&1
           cat "$work/bench.log" ;;
    bench80) need fwd; TF_FLASH_CUDA_FAMILY=sm80 timeout "$(limit 300)" "$dev/fwd_harness" bench ${BENCH_DIMS:-64 128 256} \
               > "$work/bench80.log" 2>&1; cat "$work/bench80.log" ;;
    tiles|feat) need fwd; "$dev/fwd_harness" "$step" 2>&1 | tee "$work/$step.log" ;;
    ncu) need fwd  # the Hopper forward, one launch after four, bf16, non-causal, at each d:seqlen
         for cfg in ${NCU_SHAPES:-128:4096 128:16384 64:4096}; do
           d=${cfg%:*} s=${cfg#*:}
           ncu_profile "d${d}_s$s" flash_fwd_kernel_sm90 4 "$dev/fwd_harness" one "$d" 0 "$s"
         done
         cat "$work/ncu_summary.txt" 2>/dev/null || true ;;
    sanitize|racecheck) need fwd; tool=$([[ $step == sanitize ]] && echo memcheck || echo racecheck)
                        timeout "$(limit 300)" compute-sanitizer --tool "$tool" "$dev/fwd_harness" test quick > "$work/$step.log" 2>&1
                        tail -n 3 "$work/$step.log" ;;
    torch) python3 tools/torch_peer.py ${BENCH_DIMS:-64 128} > "$work/torch.log" 2>&1; cat "$work/torch.log" ;;
    bwd_build) JOBS=${JOBS:-16} harness_build bwd "$root" "$dev/bwd" > "$work/bwd_build.log" 2>&1 ||
                 { tail -n 30 "$work/bwd_build.log"; die "the backward harness failed to build"; }
               cat "$dev/bwd/spills.txt" ;;
    bwd_test) need bwd; timeout "$(limit 300)" "$dev/bwd/bwd_harness" test > "$work/bwd_test.log" 2>&1 || rc=$?
              grep -E "FAIL|failed" "$work/bwd_test.log" | tail -n 15
              echo "on the Hopper kernel: $(grep -c ' sm90$' "$work/bwd_test.log")"
              (( rc == 0 )) || echo "BWD TEST FAILURES (rc $rc)" ;;
    bwd_bench) need bwd; timeout "$(limit 300)" "$dev/bwd/bwd_harness" bench ${BENCH_DIMS:-64 128} > "$work/bwd_bench.log" 2>&1
               cat "$work/bwd_bench.log" ;;
    bwd_bench80) need bwd; TF_FLASH_CUDA_FAMILY=sm80 timeout "$(limit 300)" "$dev/bwd/bwd_harness" bench ${BENCH_DIMS:-64 128} \
                   > "$work/bwd_bench80.log" 2>&1; cat "$work/bwd_bench80.log" ;;
    bwd_ncu) need bwd  # the Hopper dK/dV kernel, one launch after one
             # shellcheck disable=SC2086  # the shape is bench1's arguments
             ncu_profile bwd bwd_dkdv_kernel_sm90 1 "$dev/bwd/bwd_harness" bench1 ${BWD_NCU_SHAPE:-bf16 128 4 4096 16 0}
             cat "$work/ncu_summary.txt" 2>/dev/null || true ;;
    bwd_sanitize|bwd_racecheck)  # the Hopper backward on lengths off the tiles, plain and causal
      need bwd; tool=$([[ $step == bwd_sanitize ]] && echo memcheck || echo racecheck)
      for cfg in "128 1 333 2 0" "128 1 333 2 1" "64 2 200 3 1"; do
        # shellcheck disable=SC2086  # cfg is bench1's arguments
        timeout "$(limit 200)" compute-sanitizer --tool "$tool" "$dev/bwd/bwd_harness" bench1 bf16 $cfg 0 > "$work/$step.log" 2>&1
        echo "$cfg: $(tail -n 1 "$work/$step.log")"
      done ;;
    *) die "unknown harness step $step" ;;
  esac
}

ab() {  # the same-run A/B of two harness builds
  local base=$root tree dir family src p order log dims extra
  if [[ $# -gt 0 && -d $1 ]]; then base=$(cd "$1" && pwd); shift; fi
  dims=${*:-64 128}
  [[ $base != "$root" || -n ${VARIANT_FLAGS:-} ]] || die "ab needs a BASE tree (tools/gpu.sh baseline REV here) or VARIANT_FLAGS"
  local directions="fwd bwd"
  if [[ ${FWD_ONLY:-0} == 1 ]]; then directions=fwd; fi
  if [[ ${BWD_ONLY:-0} == 1 ]]; then directions=bwd; fi
  say "base $base${VARIANT_FLAGS:+ against this tree with $VARIANT_FLAGS}; head dims $dims; $directions"
  cutlass_headers  # once, before the builds that share it start
  if [[ ${SKIP_BUILD:-0} != 1 ]]; then  # both trees, both directions, all at once
    for tree in base new; do
      src=$root; [[ $tree == base ]] && src=$base
      for dir in $directions; do
        extra=""; [[ $tree == base ]] || extra=${VARIANT_FLAGS:-}
        (ARCHS=${ARCHS:-90a} REDUCED=${REDUCED:-1} VARIANTS=0 JOBS=8 EXTRA=$extra \
           harness_build "$dir" "$src" "/tmp/cmp_$tree/$dir" > "$work/build_${dir}_$tree.log" 2>&1 ||
           echo "ab: the $dir build of $tree failed (build_${dir}_$tree.log)") &
      done
    done
    wait
    say "built in $(( $(date +%s) - start ))s"
  fi
  if [[ ${AB_TESTS:-0} == 1 ]]; then  # the new side's tests before its timings
    for dir in $directions; do
      (timeout "$(limit 300)" "/tmp/cmp_new/$dir/${dir}_harness" test > "$work/test_${dir}_new.log" 2>&1
       echo "new $dir tests rc $?: $(tail -n 1 "$work/test_${dir}_new.log")") &
    done
    wait
    grep -hE "FAIL|NOT REP" "$work"/test_*_new.log | head -n 8 || true
  fi
  # Base first in odd passes, new first in even ones: the order alone moves a result by about 1%.
  for ((p = 1; p <= ${PASSES:-2}; ++p)); do
    order="base new"; (( p % 2 == 0 )) && order="new base"
    for tree in $order; do
      for dir in $directions; do
        for family in ${FAMILIES:-default}; do
          log=$work/bench_${dir}_${family}_${tree}_p$p.log
          # shellcheck disable=SC2046,SC2086  # the family's variable only when it is not the default; dims are words
          env $([[ $family == default ]] || echo "TF_FLASH_CUDA_FAMILY=$family") \
            timeout "$(limit 300)" "/tmp/cmp_$tree/$dir/${dir}_harness" bench $dims > "$log" 2>&1 || echo "ab: $log failed"
        done
      done
    done
  done
  for dir in $directions; do
    for family in ${FAMILIES:-default}; do
      python3 tools/ab_summary.py --shapes --new "$work"/bench_${dir}_${family}_new_p*.log \
        --base "$work"/bench_${dir}_${family}_base_p*.log > "$work/shapes_${dir}_$family.txt" || true
      echo "=== $dir, family $family: TFLOP/s new / base, median over passes"
      python3 tools/ab_summary.py --new "$work"/bench_${dir}_${family}_new_p*.log \
        --base "$work"/bench_${dir}_${family}_base_p*.log | tee -a "$work/summary.txt"
    done
  done
}

sm90_tiles() {  # each "kBlockN,consumer warpgroups" variant recompiles only the two Hopper objects of head dim D
  local d=${1:?usage: tools/gpu.sh sm90-tiles D "N,WG ..."} variants=${2:?usage: tools/gpu.sh sm90-tiles D "N,WG ..."}
  local flags v n wg vdir objs line
  cutlass_headers
  need fwd
  flags="-std=c++17 --expt-relaxed-constexpr -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -I$CUTLASS_INCLUDE"
  for v in $variants; do
    n=${v%,*} wg=${v#*,} vdir=/tmp/sm90_variant_${n}_$wg
    rm -rf "$vdir" && mkdir -p "$vdir/obj" && cp -r "$root/cc" "$vdir/"
    # The long tile shape of head dim d (sm90_tile_size.h's policy; the banded one keeps its 128 rows for the
    # tile table) becomes the variant.
    line="  if (head_dim == $d \\&\\& shape == Sm90ForwardShape::kLong) return {$n, 2, $wg};  // sm90-tiles variant"
    sed -i "/^constexpr Sm90ForwardTiles sm90_forward_tiles(/a\\$line" "$vdir/cc/kernels/cuda/sm90_tile_size.h"
    grep -qF "return {$n, 2, $wg};  // sm90-tiles variant" "$vdir/cc/kernels/cuda/sm90_tile_size.h" ||
      { echo "variant $v: edit failed"; continue; }
    ( for dt in bf16 fp16; do
        # shellcheck disable=SC2086
        nvcc $flags -I"$vdir" -Xptxas -warn-spills -c "$vdir/cc/kernels/cuda/flash_fwd_sm90_${dt}_hdim$d.cu" \
          -o "$vdir/obj/flash_fwd_sm90_${dt}_hdim$d.o" 2>&1 | grep -o "[0-9]* bytes spill stores" | sort -u | sed "s/^/$v $dt: /" &
      done; wait
      objs=$(ls "$dev"/*.o | grep -v "flash_fwd_sm90_\(bf16\|fp16\)_hdim$d.o")  # the fp8 objects stay
      # shellcheck disable=SC2086
      nvcc -gencode=arch=compute_90a,code=sm_90a $objs "$vdir"/obj/*.o -o "$vdir/fwd_harness" ) &
  done
  wait
  for v in $variants; do
    n=${v%,*} wg=${v#*,} vdir=/tmp/sm90_variant_${n}_$wg
    [[ -x $vdir/fwd_harness ]] || { echo "variant $v: no binary"; continue; }
    echo "=== kBlockN $n, $wg consumer warpgroups"
    timeout "$(limit 120)" "$vdir/fwd_harness" bench "$d" | grep -v "^device\|^dtype" || true
    timeout "$(limit "${TEST_TIMEOUT:-150}")" "$vdir/fwd_harness" test > "$work/variant_${n}_${wg}_test.log" 2>&1
    echo "test rc $?: $(tail -n 1 "$work/variant_${n}_${wg}_test.log")"
    grep FAIL "$work/variant_${n}_${wg}_test.log" | head -n 5 || true
  done
}

# A device subcommand runs every step, each leaving its log, as long as its set-up worked: past the set-up,
# errors are counted and reported, not fatal.
command=${1:-help}
shift || true
case $command in
  host) host ;;
  baseline) baseline "$@" ;;
  lib) device_start lib; tf_env ;;
  test) device_start test; tf_env; set +e; test_groups "$@" ;;
  bench)
    device_start bench; tf_env; set +e
    if [[ $# -eq 0 ]]; then set -- --impls tf_flash --dtypes bf16 --dims 64 128 256 --skip-memory --skip-extras \
      --calls-per-function 10; fi
    # bench_gpu.py starts no configuration past --time-limit: what is left, less a configuration's worth.
    if ! has_arg --time-limit "$@"; then set -- "$@" --time-limit $(( $(limit 600) > 140 ? $(limit 600) - 80 : 60 )); fi
    benchmark bench_gpu benchmarks/bench_gpu.py "$@" ;;
  model)
    device_start model; tf_env; set +e
    # bench_model.py starts no (mode, length) past --time-limit; one takes 1-2 minutes under XLA.
    if ! has_arg --time-limit "$@"; then set -- "$@" --time-limit $(( $(limit 600) > 240 ? $(limit 600) - 120 : 120 )); fi
    benchmark bench_model benchmarks/bench_model.py --xla-autotune-cache /tmp/xla_cache "$@" ;;
  cuda-import) cuda_import "$@" ;;
  cuda-here)
    [[ -f $build/flags ]] || die "no $build/: run tools/gpu.sh host first"
    command -v nvcc >/dev/null || die "cuda-here needs nvcc"
    cutlass_headers
    say "$(nvcc --version | tail -n 2 | head -n 1)"
    t0=$(date +%s)
    cuda_objects build/nvcc_here.log
    mkdir -p .gpu_cuda
    tar -cf - -C build gpu/cuda_obj | xz -T0 -6 > .gpu_cuda/cuda_obj.tar.xz
    say ".gpu_cuda/cuda_obj.tar.xz: $(du -h .gpu_cuda/cuda_obj.tar.xz | cut -f1), $(( $(date +%s) - t0 ))s; carry .gpu_cuda" ;;
  cuda-export)
    device_start cuda_export; tf_env
    trap 'say "$(( $(date +%s) - start ))s in all"' EXIT  # the parts are the call's files: no log archive
    tar -cf - -C build gpu/cuda_obj | xz -T0 -6 | split -b 15M -d - "$out/cuda_obj.tar.xz."
    ls -l "$out"/cuda_obj.tar.xz.* ;;
  run)
    [[ $# -gt 0 ]] || die "usage: tools/gpu.sh run CMD..."
    device_start run; tf_env; set +e
    timeout "$(limit 600)" "$@" ;;
  harness)
    device_start harness; set +e
    for step in ${*:-build test bigoffset bench tiles sanitize}; do harness_step "$step"; done ;;
  ab) device_start ab; set +e; ab "$@" ;;
  sm90-tiles) device_start sm90_tiles; set +e; sm90_tiles "$@" ;;
  help|-h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' ;;
  *) die "unknown subcommand $command (tools/gpu.sh help)" ;;
esac
