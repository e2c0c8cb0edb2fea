"""Forward+backward time of float32 attention by TF's TF32 switch, against float16 and against dense
attention (the softmax(Q K^T) V that Keras' MultiHeadAttention computes, in TF ops), at the model's head
shape (b x s, 12 heads of 64): 10 steps chained in one tf.function, each one's dQ feeding the next query,
synchronized on a scalar (round 9's timing also copied the whole dQ to the host: 2x the bytes in float32,
trace_gaps.py), median of 15 samples. Usage: full_float32.py [s:b ...] (default 1024:16 4096:4)."""
import sys
import time

import numpy as np
import tensorflow as tf

import tf_flash


def flash(q, k, v):
    return tf_flash.flash_attention(q, k, v)


def dense(q, k, v):
    scores = tf.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5)
    return tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(scores, axis=-1), v)


def make_chained(attention):
    @tf.function
    def chained(q, k, v):
        for _ in range(10):
            with tf.GradientTape() as t:
                t.watch([q, k, v])
                loss = tf.reduce_sum(tf.cast(attention(q, k, v), tf.float32))
            g = t.gradient(loss, [q, k, v])
            q = q + 0 * g[0]
        return tf.reduce_sum(tf.cast(g[0], tf.float32))  # a scalar: the timing ends on the GPU's work
    return chained


def time_ms(fn, *args):
    fn(*args).numpy()
    ts = []
    for _ in range(15):
        t0 = time.perf_counter()
        fn(*args).numpy()
        ts.append((time.perf_counter() - t0) / 10)
    return np.median(ts) * 1e3, np.percentile(ts, 10) * 1e3, np.percentile(ts, 90) * 1e3


def main():
    shapes = [tuple(int(x) for x in arg.split(":")) for arg in sys.argv[1:]] or [(1024, 16), (4096, 4)]
    cases = [("flash", "float16", True), ("flash", "float32", True), ("flash", "float32", False),
             ("dense", "float32", True), ("dense", "float32", False)]
    for s, b in shapes:
        for name, dtype, tf32 in cases:
            tf.config.experimental.enable_tensor_float_32_execution(tf32)
            q, k, v = [tf.cast(tf.random.normal((b, s, 12, 64)), dtype) for _ in range(3)]
            try:
                med, p10, p90 = time_ms(make_chained(flash if name == "flash" else dense), q, k, v)
                result = f"{med:8.3f} ms (p10-p90 {p10:.3f}-{p90:.3f})"
            except tf.errors.ResourceExhaustedError:
                result = "out of memory"
            flops = 4 * b * s * s * 12 * 64 * 3.5  # forward 2 GEMMs + backward 5, non-causal
            rate = f"  {flops / (med * 1e-3) / 1e12:6.1f} TFLOP/s" if "ms" in result else ""
            print(f"s={s} b={b} h12 d64 {name:5s} {dtype:8s} TF32 {'on ' if tf32 else 'off'} fwd+bwd {result}{rate}",
                  flush=True)


if __name__ == "__main__":
    main()
