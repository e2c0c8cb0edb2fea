"""The bench tables of round.sh's fwd_harness runs: best TFLOP/s per (dtype, d, causal, seqlen) and kind.

load(out, kinds) reads out/bench_<kind>_<run>.txt for runs 1 and 2 and returns
{(dtype, d, causal, seqlen): {kind: max TFLOP/s}}; remove(out) deletes those files once summarized."""
import collections
import glob
import os


def load(out, kinds, runs=(1, 2)):
    rows = collections.defaultdict(dict)
    for kind in kinds:
        for run in runs:
            for line in open(f"{out}/bench_{kind}_{run}.txt"):
                f = line.split()
                if len(f) >= 9 and f[0] in ("bf16", "fp16"):
                    key = (f[0], int(f[1]), int(f[2]), int(f[4]))
                    rows[key][kind] = max(rows[key].get(kind, 0.0), float(f[8]))
    return rows


def remove(out):
    for path in glob.glob(f"{out}/bench_*.txt"):
        os.remove(path)
