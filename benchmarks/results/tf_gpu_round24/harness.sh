#!/usr/bin/env bash
# Round 24 in the CUDA harness, prepared in session 23 and NOT RUN yet (one device command, no TensorFlow; about
# 7 minutes). Two A/B switches of the Hopper forward against the default build (round 23's: the exponent's FMA under a
# warp vote in the plain variant):
#   lazy  TF_FLASH_SM90_LAZY_RESCALE=1: a row's reference max moves only when a tile raises it by more than 2^8, and O
#         is rescaled only in a warp where one did (FlashAttention-4's conditional rescaling). O's rescale is one FMUL
#         per element of O per key tile: 0.5 / 1 / 4 per score at d64 / d128 / d256, beside ~4.5 other softmax
#         instructions. ptxas here (bf16): spills as the default's but d128 plain 44 -> 84 bytes, d64 232 -> 228.
#   all   TF_FLASH_SM90_EXPONENT_VOTE_ALL=1: the vote in every variant (dropout, soft-capping, block masks,
#         attn_mask). ptxas: as the default but d128 general + attn_mask 44 -> 100 bytes; round 9's d64 general
#         spills do not reproduce (124 bytes, as the default).
# The forward tests on all three builds (new: huge-logit cases at d256, huge-dropout and huge-doc-mask at every head
# dim), then `bench 64 128 256` base / lazy and `feat` (d128: dropout, masks, documents) base / all, each interleaved
# three times.
#   OUT=... bash harness.sh   (carry .gpu_build)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
source benchmarks/results/round_lib.sh
start=$(date +%s)
build_fwd build/fwd_base || exit 1
sm90="$(cd cc/kernels/cuda && ls flash_fwd_sm90_*.cu)"
variant_fwd build/fwd_base build/fwd_lazy "-DTF_FLASH_SM90_LAZY_RESCALE=1" "$sm90" &
variant_fwd build/fwd_base build/fwd_all "-DTF_FLASH_SM90_EXPONENT_VOTE_ALL=1" "$sm90" &
wait
for v in lazy all; do echo "== $v"; grep -h "spill" "$OUT/fwd_${v}_build.log" | sed 's/.*FwdTraitsSm90//' | cut -c1-110; done
echo "built in $(( $(date +%s) - start ))s"
for v in base lazy all; do
  (timeout 240 build/fwd_$v/fwd_harness test > "$OUT/test_$v.log" 2>&1; echo "$v tests rc $?: $(tail -n 1 "$OUT/test_$v.log")") &
done
wait
grep -h FAIL "$OUT"/test_*.log | head -8; grep -h "^huge" "$OUT/test_base.log" | grep -E " 256 |dropout|doc" | head -24
echo "[$(( $(date +%s) - start ))s]"
for r in 1 2 3; do
  for v in base lazy; do
    timeout 60 build/fwd_$v/fwd_harness bench 64 128 256 > "$OUT/fwdbench_${v}_$r.txt" 2>&1 || echo "bench $v failed"
  done
  for v in base all; do timeout 60 build/fwd_$v/fwd_harness feat > "$OUT/feat_${v}_$r.txt" 2>&1 || echo "feat $v failed"; done
done
fwd_summary "base lazy" "rescale at every tile | lazy rescaling"
python3 - "$OUT" <<'PY' | tee "$OUT/summary_feat.txt"
import collections, glob, re, sys
rows = collections.defaultdict(dict)
for path in sorted(glob.glob(f"{sys.argv[1]}/feat_*_*.txt")):
    kind = re.match(r".*feat_([a-z]+)_\d\.txt", path).group(1)
    for line in open(path):
        f = line.split()
        if len(f) > 4 and re.fullmatch(r"[\d.]+", f[-1]) and f[-4].isdigit():
            key = (" ".join(f[:-4]), int(f[-4]), int(f[-3]))
            rows[key][kind] = max(rows[key].get(kind, 0.0), float(f[-1]))
print("feature (bf16 d128 h16) batch seqlen | TFLOP/s* max of runs: vote in the plain variant | in all | all / plain")
for key, v in rows.items():
    print(*key, "|", f"{v.get('base', 0):.0f} | {v.get('all', 0):.0f} | {v.get('all', 0) / (v.get('base') or 1):.3f}")
PY
rm -f "$OUT"/feat_*_*.txt
echo "total $(( $(date +%s) - start ))s"
