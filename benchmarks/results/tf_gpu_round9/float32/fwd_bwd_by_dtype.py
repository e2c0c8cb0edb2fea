"""The timing behind fwd_bwd_by_dtype*.txt: forward+backward of tf_flash.flash_attention at the model's
shape (b x s, 12 heads of 64), 10 chained in one tf.function, median of 15 samples, per input dtype.
Round 9 adds a tiny shape (1 x 128), where the kernels take microseconds: what remains is per-call cost.
Usage: fwd_bwd_by_dtype.py [s:b ...] (default 1024:16 4096:4). kernel_times.py profiles the same `step`
and `chained`."""
import sys
import time

import numpy as np
import tensorflow as tf

import tf_flash


def inputs(dtype, s, b):
    return [tf.cast(tf.random.normal((b, s, 12, 64)), dtype) for _ in range(3)]


def step(q, k, v):
    with tf.GradientTape() as t:
        t.watch([q, k, v])
        o = tf_flash.flash_attention(q, k, v)
        loss = tf.reduce_sum(tf.cast(o, tf.float32))
    return t.gradient(loss, [q, k, v])


@tf.function
def chained(q, k, v):  # what is timed: 10 steps, each one's dQ feeding the next query
    for _ in range(10):
        g = step(q, k, v)
        q = q + 0 * g[0]
    return g


def main():
    shapes = [tuple(int(x) for x in arg.split(":")) for arg in sys.argv[1:]] or [(1024, 16), (4096, 4)]
    for s, b in shapes:
        for dt in (tf.float32, tf.float16, tf.bfloat16):
            q, k, v = inputs(dt, s, b)
            chained(q, k, v)[0].numpy()
            ts = []
            for _ in range(15):
                t0 = time.perf_counter()
                chained(q, k, v)[0].numpy()
                ts.append((time.perf_counter() - t0) / 10)
            print(f"s={s} b={b} h12 d64 {dt.name:9s} fwd+bwd {np.median(ts) * 1e3:.3f} ms "
                  f"(p10-p90 {np.percentile(ts, 10) * 1e3:.3f}-{np.percentile(ts, 90) * 1e3:.3f})")


if __name__ == "__main__":
    main()
