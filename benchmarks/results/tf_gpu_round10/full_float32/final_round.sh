#!/usr/bin/env bash
# Round 10's last device command: build, the float32 suites with TF32 off, memcheck and racecheck on a few
# full-float32 cases, ncu kernel times at head dims 64 and 128. Run from the repository root on the device.
bash scripts/gpu_round.sh device none 2>&1 | tail -2
source .gpu/env/env.sh >/dev/null 2>&1
export TF_FLASH_LIBRARY=$PWD/build/gpu/_flash_attention_ops.so PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 TF_FLASH_TEST_TF32=0
(timeout 150 python3 -m pytest -q tests/test_flash_attention.py tests/test_dropout.py tests/test_sparsity.py \
   tests/test_robustness.py tests/test_softcap.py tests/test_xla.py -m gpu -k "float32 or f32" -p no:cacheprovider
 timeout 120 python3 -m pytest -q tests/test_float32_range.py tests/test_determinism.py tests/test_layers.py -m gpu \
   -p no:cacheprovider) > $OUT/pytest_tf32_off.log 2>&1
grep -E "passed|failed" $OUT/pytest_tf32_off.log; grep FAILED $OUT/pytest_tf32_off.log | head -5
for tool in memcheck racecheck; do
  timeout 100 compute-sanitizer --tool $tool python3 -m pytest -q -x tests/test_flash_attention.py tests/test_softcap.py \
    -m gpu -k "(float32 or f32) and (nothing_visible or (softcap_matches and eager and mask))" -p no:cacheprovider \
    > $OUT/sanitize_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E "ERROR SUMMARY|passed|failed|Hazard" $OUT/sanitize_$tool.log | sort | uniq -c | head -5
done
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for d in 64 128; do
  timeout 80 $NCU --profile-from-start off --metrics gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active \
    python3 benchmarks/results/tf_gpu_round10/full_float32/kernel_step.py $d 2>&1 | grep -E "float32_kernel<|duration|warps_active|pipe_fma" \
    | grep -A3 "float32_kernel<" | cut -c1-120
done 2>&1 | tee $OUT/ncu_float32.txt
