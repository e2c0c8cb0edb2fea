"""Where a forward+backward's GPU time goes, per kernel, by input dtype: one step of
tf_flash.flash_attention (b x s, 12 heads of 64) between cudaProfilerStart/Stop, for
`ncu --profile-from-start off --metrics gpu__time_duration.sum --csv` (no nsys on the lent machine).
Usage: ncu ... python3 kernel_times.py float32 1024 16 [chained]; summarize with kernel_times.py --summary f.csv.
`chained`: profile fwd_bwd_by_dtype.py's whole timed function (10 steps chained through q) instead of one
step, so that the kernels' sum can be set against that script's wall time."""
import csv
import ctypes
import sys


def summary(path):
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    head = rows[0]
    col = {name: head.index(name) for name in ("Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
    to_us = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    total, by_name = 0.0, {}
    for r in rows[1:]:
        if r[col["Metric Name"]] != "gpu__time_duration.sum":
            continue
        us = float(r[col["Metric Value"]].replace(",", "")) * to_us[r[col["Metric Unit"]]]
        n, t = by_name.get(r[col["Kernel Name"]][:100], (0, 0.0))
        by_name[r[col["Kernel Name"]][:100]] = (n + 1, t + us)
        total += us
    for key, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"{us:10.1f} us {n:3d}x  {key}")
    print(f"{total:10.1f} us total")


if sys.argv[1] == "--summary":
    summary(sys.argv[2])
    sys.exit()

import tensorflow as tf  # noqa: E402

from fwd_bwd_by_dtype import chained, inputs, step  # noqa: E402  (this folder: run as a script)

q, k, v = inputs(getattr(tf, sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
run = chained if sys.argv[4:] == ["chained"] else tf.function(step)
for _ in range(2):
    run(q, k, v)[0].numpy()
cudart = ctypes.CDLL("libcudart.so.12")
cudart.cudaProfilerStart()
run(q, k, v)[0].numpy()
cudart.cudaProfilerStop()
