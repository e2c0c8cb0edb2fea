"""Cost of the deterministic GPU backward (issue 16: target <= 15% on forward+backward at s >= 4k).

    python benchmarks/bench_determinism.py [--seqlens 4096 8192 16384] [--batch 2] [--heads 16] [--dim 128]
                                           [--dropout 0.1]

Times forward+backward (bf16, tf.function) with deterministic=False (dQ by float atomics) and True (per-CTA
dQ accumulators summed in a fixed order), checks that two deterministic runs are bit-identical, and
prints one line per shape: milliseconds of each, the overhead and the backward kernel family that ran
(TF_FLASH_CUDA_FAMILY=sm80 holds every GPU on the sm_80 family).
"""
import argparse
import time

import numpy as np
import tensorflow as tf

import tf_flash


def _step(deterministic, causal, dropout):
    @tf.function
    def step(q, k, v, dout):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = tf_flash.flash_attention(q, k, v, causal=causal, deterministic=deterministic,
                                           dropout_rate=dropout, seed=[1, 2] if dropout else None)
        return tape.gradient(out, [q, k, v], output_gradients=dout)
    return step


def _median_ms(step, args, repeats):
    for _ in range(3):
        step(*args)[0].numpy()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(*args)[0].numpy()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dropout", type=float, default=0.0)
    args = parser.parse_args()
    if not tf.config.list_physical_devices("GPU"):
        raise SystemExit("bench_determinism: needs a GPU")
    for causal in (False, True):
        for s in args.seqlens:
            shape = (args.batch, s, args.heads, args.dim)
            inputs = [tf.random.stateless_normal(shape, seed=[i, 0], dtype=tf.bfloat16) for i in range(4)]
            fast = _median_ms(_step(False, causal, args.dropout), inputs, args.repeats)
            det_step = _step(True, causal, args.dropout)
            before = tf_flash.cuda_kernel_counts()
            det = _median_ms(det_step, inputs, args.repeats)
            family = "sm90" if tf_flash.cuda_kernel_counts()["backward_sm90"] > before["backward_sm90"] else "sm80"
            first, second = det_step(*inputs), det_step(*inputs)
            identical = all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(first, second))
            print(f"b{args.batch} s{s} h{args.heads} d{args.dim} causal={causal} dropout={args.dropout}: "
                  f"atomics {fast:.2f} ms, deterministic {det:.2f} ms ({100 * (det / fast - 1):+.1f}%), "
                  f"bit-identical={identical}, deterministic backward {family}", flush=True)


if __name__ == "__main__":
    main()
