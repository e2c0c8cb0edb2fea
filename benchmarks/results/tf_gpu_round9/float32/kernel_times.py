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
import tf_flash  # noqa: E402

dt, s, b = getattr(tf, sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
q, k, v = (tf.cast(tf.random.normal((b, s, 12, 64)), dt) for _ in range(3))


@tf.function
def step(q, k, v):
    with tf.GradientTape() as t:
        t.watch([q, k, v])
        o = tf_flash.flash_attention(q, k, v)
        loss = tf.reduce_sum(tf.cast(o, tf.float32))
    return t.gradient(loss, [q, k, v])


@tf.function
def chained(q, k, v):  # as fwd_bwd_by_dtype.py times it
    for _ in range(10):
        g = step(q, k, v)
        q = q + 0 * g[0]
    return g


run = chained if sys.argv[4:] == ["chained"] else step
for _ in range(2):
    run(q, k, v)[0].numpy()
cudart = ctypes.CDLL("libcudart.so.12")
cudart.cudaProfilerStart()
run(q, k, v)[0].numpy()
cudart.cudaProfilerStop()
