"""Cost of the deterministic GPU backward (method: docs/performance.md).

    python benchmarks/bench_determinism.py [--seqlens 4096 8192 16384] [--batch 2] [--heads 16] [--dim 128]
                                           [--dropout 0.1] [--json results/determinism.json]

Times forward+backward (bf16, tf.function) with deterministic=False (dQ by float atomics) and True (per-CTA
dQ accumulators summed in a fixed order), checks that two deterministic runs are bit-identical, and
prints one line per shape: milliseconds of each, the overhead and the backward kernel family that ran
(TF_FLASH_CUDA_FAMILY=sm80 holds every GPU on the sm_80 family). Output: results/determinism.json and
results/determinism.png (plot.py).
"""
import argparse
import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import plot  # noqa: E402
import tf_flash  # noqa: E402  (after common, which puts the checkout's tf_flash first on the path)


def _step(deterministic, causal, dropout):
    @tf.function
    def step(q, k, v, dout):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = tf_flash.flash_attention(q, k, v, causal=causal, deterministic=deterministic,
                                           dropout_rate=dropout, seed=[1, 2] if dropout else None)
        return tape.gradient(out, [q, k, v], output_gradients=dout)
    return step


def _median_ms(step, inputs, repeats):
    stats = common.time_calls(lambda: step(*inputs)[0].numpy(), warmup=3, repeats=repeats)
    return 1e3 * stats["median_s"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dropout", type=float, default=0.0)
    common.add_json_argument(parser, "determinism")
    args = parser.parse_args()
    common.require_gpu("bench_determinism.py")
    rows = []
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
            rows.append({"batch": args.batch, "seqlen": s, "heads": args.heads, "dim": args.dim, "causal": causal,
                         "dropout": args.dropout, "atomics_ms": fast, "deterministic_ms": det,
                         "bit_identical": identical, "family": family})
    plot.save({"benchmark": "determinism", "info": common.machine_info(gpu=True), "command": common.command_line(),
               "rows": rows}, args.json)
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
