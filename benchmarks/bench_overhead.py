"""Where the time of one attention call goes at small shapes (GPU; method: docs/performance.md).

    python benchmarks/bench_overhead.py [--shapes 16x1024 32x512] [--heads 16] [--dim 128] [--calls 10]
                                        [--dtype bfloat16|float16|float32] [--json results/overhead.json]

Times the same attention (bf16 by default, [B, S, H, D]) reached in ways that differ only in what surrounds the
kernel, and prints milliseconds per attention and TFLOP/s for each:
  floor        a tf.function holding one elementwise GPU op on q: TF's own cost of a function call
  fn_1         a tf.function holding one tf_flash.flash_attention (bench_gpu.py's default)
  fn_N         a tf.function holding N chained attentions (out feeds the next query): the op's cost
               inside a graph, the function-call cost spread over N (bench_gpu.py --calls-per-function N)
  xla_N        the same N chain under jit_compile=True (the XLA custom call)
  eager        tf_flash.flash_attention called eagerly (Python argument checks on every call)
  (and for forward+backward, the gradients for a given dO: fn_1, fn_N and xla_N; the functions are
  bench_gpu.py's, benchmarks/common.py make_fns)
The kernel's own time (CUDA events, no TF) is what tests/cuda_harness/fwd_harness.cu `bench` prints.
Output: results/overhead.json and results/overhead.png (plot.py: ms per attention for each way of calling it).
"""
import argparse
import os
import sys
import time

import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import plot  # noqa: E402
import tf_flash  # noqa: E402  (after common, which puts the checkout's tf_flash first on the path)


def _per_call_ms(call, fetch, calls_per_sample, samples=15, warmup=3):
    for _ in range(warmup):
        fetch(call())
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        result = None
        for _ in range(calls_per_sample):
            result = call()
        fetch(result)
        times.append((time.perf_counter() - t0) / calls_per_sample)
    return 1e3 * sorted(times)[len(times) // 2]


def measure(batch, seqlen, heads, dim, causal, calls, dtype=tf.bfloat16):
    shape = [batch, seqlen, heads, dim]
    q, k, v, dout = (tf.cast(tf.random.normal(shape, seed=i), dtype) for i in range(4))
    rows = []

    def add(name, fn, per_call_attentions, backward):
        fetch = lambda r: (r[0] if backward else r)[0, 0, 0, 0].numpy()  # noqa: E731  (waits for the GPU)
        ms = _per_call_ms(lambda: fn(q, k, v, dout), fetch, calls_per_sample=10) / per_call_attentions
        flops = 0 if name == "floor" else common.attention_flops(batch, seqlen, heads, dim, causal,
                                                                 "fwd_bwd" if backward else "fwd")
        rows.append({"form": name, "backward": backward, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12})

    add("floor", tf.function(lambda q, k, v, dout: q * 2), 1, False)
    # bench_gpu.py's functions (benchmarks/common.py): a chain of attentions, each output the next query.
    for chain, form, jit in ((1, "fn_1", False), (calls, f"fn_{calls}", False), (calls, f"xla_{calls}", True)):
        fwd, fwd_bwd = common.make_fns("tf_flash", causal, chain=chain, jit_compile=jit)
        add(form, fwd, chain, False)
        add(form, fwd_bwd, chain, True)
    add("eager", lambda q, k, v, dout: tf_flash.flash_attention(q, k, v, causal=causal), 1, False)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["16x1024", "32x512", "4x4096"], help="BATCHxSEQLEN")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--calls", type=int, default=10, help="attentions chained in one function (fn_N, xla_N)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="of q, k, v (float32: the staging to float16 operands is part of each call)")
    common.add_json_argument(p, "overhead")
    args = p.parse_args()
    common.require_gpu("bench_overhead.py")
    results = []
    print(f"{args.dtype}, heads {args.heads}, head dim {args.dim}; ms per attention (TFLOP/s)")
    forms = ["floor", "fn_1", f"fn_{args.calls}", f"xla_{args.calls}", "eager"]
    print(f"{'shape':>10} {'causal':>6} {'pass':>8} " + " ".join(f"{f:>16}" for f in forms))
    for shape in args.shapes:
        batch, seqlen = (int(x) for x in shape.split("x"))
        for causal in (False, True):
            rows = measure(batch, seqlen, args.heads, args.dim, causal, args.calls, tf.as_dtype(args.dtype))
            for row in rows:
                row.update(batch=batch, seqlen=seqlen, causal=causal, dtype=args.dtype)
            results += rows
            for backward in (False, True):
                cells = []
                for form in forms:
                    match = [r for r in rows if r["form"] == form and r["backward"] == backward]
                    if not match:
                        cells.append("-")
                    elif form == "floor":
                        cells.append(f"{match[0]['ms']:.3f}")
                    else:
                        cells.append(f"{match[0]['ms']:.3f} ({match[0]['tflops']:.0f})")
                print(f"{shape:>10} {str(causal):>6} {'fwd+bwd' if backward else 'fwd':>8} " +
                      " ".join(f"{c:>16}" for c in cells), flush=True)
    plot.save({"benchmark": "overhead", "info": common.machine_info(gpu=True), "command": common.command_line(),
               "heads": args.heads, "dim": args.dim, "calls": args.calls, "rows": results}, args.json)
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
