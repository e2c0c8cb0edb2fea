#!/usr/bin/env python
"""CPU benchmark of tf_flash (method: docs/performance.md).

float32, b=1, h=8, d=64, s in 512..8192 (and 16k..64k for tf_flash only with --long), causal and not:
forward and forward+backward time and GFLOP/s (fwd = 4 b s^2 h d, halved when causal; fwd+bwd = 3.5 fwd)
next to TF's float32 matmul rate (2048^3) measured in the same run, TF standard attention (einsum,
softmax, einsum) with and without XLA, and peak RSS. Plus the block-sparse density sweep at s=8192 and
the dropout overhead (p=0.1 vs 0).

Every configuration runs in its own subprocess, so that each peak RSS (VmHWM; getrusage's ru_maxrss
where /proc is missing) belongs to that configuration alone and a configuration that runs out of memory
does not end the run. With --torch-python, torch's CPU scaled_dot_product_attention (the CPU peer)
runs in processes of that interpreter, e.g. a venv with
`pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl numpy`.

Output: results/cpu.json and results/cpu.png (plot.py: GFLOP/s against sequence length beside TF's
attention, peak memory, block-sparse speedups), rewritten after every configuration, so an interrupted run
keeps what it measured; the run's log in results/cpu.log.

    python benchmarks/bench_cpu.py            # full run (~30-40 min on 2 cores)
    python benchmarks/bench_cpu.py --long     # + tf_flash at 16k, 32k, 64k (~30 min more; shorten with
                                              #   --long-seqlens 16384 32768 or --long-modes fwd)
    python benchmarks/bench_cpu.py --quick    # smoke run (a few minutes), results/quick/ (git-ignored)
    python benchmarks/bench_cpu.py --isa-compare   # the CPU kernel's AVX-512 and AVX2 paths on float32, and
                                              #   bfloat16 inputs on the AVX512_BF16 path (vdpbf16ps) and on
                                              #   the AVX-512 one (forced by TF_FLASH_CPU_ISA per process),
                                              #   beside TF's float32 attention and the machine's peaks
                                              #   (float32 FMAs, vdpbf16ps), non-causal: B1 H8 D64 at S
                                              #   2048/4096/8192 and the example's B16 H2 S2048 D32; bfloat16 on
                                              #   the AMX path too (the default where the CPU has
                                              #   AMX); with --torch-python, torch's SDPA beside them
                                              #   (~10 min on 16 cores): results/cpu_isa.json, .png, .log
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import plot  # noqa: E402

BATCH, HEADS, DIM = 1, 8, 64
IMPLS = ["tf_flash", "tf_standard", "tf_standard_xla"]


# ---------------------------------------------------------------------------------------------------------
# Worker: one configuration per process
# ---------------------------------------------------------------------------------------------------------

def _rss_mb():
    """Peak RSS of this process. VmHWM is the high-water mark of this process's own address space; the
    getrusage ru_maxrss fallback would also count the parent's RSS at spawn (Linux keeps it across exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except (OSError, ValueError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _current_rss_mb():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return None


def _worker_matmul(task):
    import tensorflow as tf
    n = task.get("n", 2048)
    a = tf.random.normal([n, n])
    b = tf.random.normal([n, n])
    fn = tf.function(lambda a, b: tf.matmul(a, b))
    stats = common.time_calls(lambda: fn(a, b)[0, 0].numpy(), warmup=3, repeats=task.get("repeats", 20))
    stats["gflops"] = 2.0 * n ** 3 / stats["median_s"] / 1e9
    return stats


def _worker_attention(task):
    import numpy as np
    import tensorflow as tf
    seqlen, causal, impl = task["seqlen"], task["causal"], task["impl"]
    extra = dict(task.get("extra") or {})
    if "block_mask" in extra:
        from tf_flash import sparsity
        spec = extra.pop("block_mask")
        builder = getattr(sparsity, spec["builder"])
        mask, dens = builder(seqlen, seqlen, spec.get("block_size", 128), **spec.get("kwargs", {}))
        extra["block_mask"] = mask
        extra["block_size"] = spec.get("block_size", 128)
    batch, heads, dim = task.get("batch", BATCH), task.get("heads", HEADS), task.get("dim", DIM)
    rng = np.random.default_rng(0)
    shape = (batch, seqlen, heads, dim)
    dtype = tf.as_dtype(task.get("dtype", "float32"))
    q, k, v, dout = (tf.cast(rng.standard_normal(shape, dtype=np.float32), dtype) for _ in range(4))
    fwd, fwd_bwd = common.make_fns(impl, causal, extra)
    result = {"rss_base_mb": _rss_mb(), "rss_base_current_mb": _current_rss_mb()}
    if impl == "tf_flash":
        import tf_flash
        result["cpu_isa"] = tf_flash.build_info().get("cpu_isa")  # the path that ran (TF_FLASH_CPU_ISA)
    for mode in task["modes"]:
        fn = fwd if mode == "fwd" else fwd_bwd
        t0 = time.perf_counter()
        fn.get_concrete_function(q, k, v, dout)  # trace (and compile under XLA) outside the timing

        def call():
            out = fn(q, k, v, dout)
            (out if mode == "fwd" else out[0])[0, 0, 0, 0].numpy()

        first0 = time.perf_counter()
        call()  # first call: may still build kernels; also sizes the repeat count
        first = time.perf_counter() - first0
        warmup = task.get("warmup", 2 if first < 2.0 else 1)
        stats = common.time_calls(call, warmup=max(0, warmup - 1), repeats=task.get("repeats", 20),
                                  budget_s=task.get("budget_s", 30.0), min_repeats=task.get("min_repeats", 3))
        stats["first_call_s"] = first
        stats["setup_s"] = first0 - t0
        flops = common.attention_flops(batch, seqlen, heads, dim, causal, mode)
        stats["gflops"] = flops / stats["median_s"] / 1e9
        stats["peak_rss_mb"] = _rss_mb()
        result[mode] = stats
    return result


# The float32 FMA peak: every core runs 12 independent chains of vector FMAs (more than latency x ports on
# current x86 cores), 16 lanes (zmm) or 8 (ymm); flops = 2 x lanes per FMA, wall time over all threads. The
# avx512_bf16 peak: the same with vdpbf16ps, 4 flops per float32 lane (two products, two additions).
_FMA_PEAK_SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static long iters;
static int wide;  /* 0: ymm FMAs, 1: zmm FMAs, 2: zmm vdpbf16ps */
static volatile float sink[1024];  /* read by nothing: volatile keeps the loops */
static void* run(void* arg) {
  long id = (long)arg;
  float total = 0.f;
#ifdef __AVX512BF16__
  if (wide == 2) {
    __m512 a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(0.001f * (float)(i + id));
    const __m512bh m = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f));
    for (long n = 0; n < iters; ++n) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbf16_ps(a[i], m, m);
    }
    for (int i = 0; i < 12; ++i) total += _mm512_reduce_add_ps(a[i]);
  } else
#endif
  if (wide) {
    __m512 a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(0.001f * (float)(i + id));
    const __m512 m = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1e-4f);
    for (long n = 0; n < iters; ++n) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], m, c);
    }
    for (int i = 0; i < 12; ++i) total += _mm512_reduce_add_ps(a[i]);
  } else {
    __m256 a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(0.001f * (float)(i + id));
    const __m256 m = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(1e-4f);
    for (long n = 0; n < iters; ++n) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], m, c);
    }
    float out[8];
    for (int i = 0; i < 12; ++i) { _mm256_storeu_ps(out, a[i]); total += out[0] + out[7]; }
  }
  sink[id % 1024] = total;
  return NULL;
}
int main(int argc, char** argv) {
  int threads = atoi(argv[1]);
  wide = strcmp(argv[2], "avx512_bf16") == 0 ? 2 : strcmp(argv[2], "avx512") == 0;
  iters = atol(argv[3]);
  pthread_t t[1024];
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long i = 0; i < threads; ++i) pthread_create(&t[i], NULL, run, (void*)i);
  for (int i = 0; i < threads; ++i) pthread_join(t[i], NULL);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
  printf("%.6f %.3f\n", s, (wide == 2 ? 4.0 : 2.0) * (wide ? 16 : 8) * 12.0 * iters * threads / s / 1e9);
  return 0;
}
"""


def _worker_fma_peak(task):
    """The float32 FMA peak of all cores at task["isa"]'s width, from the C loop above built with the host's
    g++ (best of three runs)."""
    import shutil
    compiler = shutil.which("g++") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no host compiler for the FMA loop")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "fma.c"), os.path.join(tmp, "fma")
        with open(src, "w") as f:
            f.write(_FMA_PEAK_SOURCE)
        bf16 = ["-mavx512bw", "-mavx512vl", "-mavx512bf16"] if task["isa"] == "avx512_bf16" else []
        subprocess.run([compiler, "-x", "c", "-O3", "-mavx2", "-mfma", "-mavx512f", *bf16, src, "-o", exe,
                        "-pthread"], check=True, capture_output=True)
        threads = os.cpu_count()
        runs = [subprocess.run([exe, str(threads), task["isa"], str(task.get("iters", 200_000_000))], check=True,
                               capture_output=True, text=True).stdout.split() for _ in range(3)]
    best = max(float(r[1]) for r in runs)
    return {"gflops": best, "threads": threads, "runs_s": [float(r[0]) for r in runs]}


def _worker_torch(task):
    """torch's CPU scaled_dot_product_attention (its flash kernel), the CPU peer."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(os.cpu_count())
    if task.get("kind") == "torch_matmul":
        a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
        stats = common.time_calls(lambda: torch.mm(a, b), warmup=3, repeats=task.get("repeats", 20))
        stats["gflops"] = 2.0 * 2048 ** 3 / stats["median_s"] / 1e9
        stats["torch"] = torch.__version__
        return stats
    seqlen, causal = task["seqlen"], task["causal"]
    batch, heads, dim = task.get("batch", BATCH), task.get("heads", HEADS), task.get("dim", DIM)
    gen = torch.Generator().manual_seed(0)
    shape = (batch, heads, seqlen, dim)  # SDPA layout [B, H, S, D]
    q, k, v, dout = (torch.randn(shape, generator=gen) for _ in range(4))
    result = {"rss_base_mb": _rss_mb(), "rss_base_current_mb": _current_rss_mb(), "torch": torch.__version__}
    for x in (q, k, v):
        x.requires_grad_(True)

    def fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(dout)

    for mode in task["modes"]:
        fn = fwd if mode == "fwd" else fwd_bwd
        first0 = time.perf_counter()
        fn()
        first = time.perf_counter() - first0
        warmup = task.get("warmup", 2 if first < 2.0 else 1)
        stats = common.time_calls(fn, warmup=max(0, warmup - 1), repeats=task.get("repeats", 20),
                                  budget_s=task.get("budget_s", 30.0), min_repeats=task.get("min_repeats", 3))
        stats["first_call_s"] = first
        stats["gflops"] = common.attention_flops(batch, seqlen, heads, dim, causal, mode) / stats["median_s"] / 1e9
        stats["peak_rss_mb"] = _rss_mb()
        result[mode] = stats
    return result


def worker_main(task_json):
    task = json.loads(task_json)
    try:
        if task.get("impl") == "torch_sdpa" or task["kind"] == "torch_matmul":
            result = _worker_torch(task)
        elif task["kind"] == "fma_peak":
            result = _worker_fma_peak(task)
        elif task["kind"] == "matmul":
            result = _worker_matmul(task)
        else:
            result = _worker_attention(task)
        result["ok"] = True
    except Exception as err:  # noqa: BLE001 - report, the parent goes on
        result = {"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------------------
# Parent: run the tasks, write the results
# ---------------------------------------------------------------------------------------------------------

def run_task(task, timeout_s, log):
    label = task["label"]
    t0 = time.perf_counter()
    try:
        python = task.get("python") or sys.executable
        env = common.torch_env() if task.get("python") else dict(os.environ)  # torch's: without TF's paths
        proc = subprocess.run([python, os.path.abspath(__file__), "--worker", json.dumps(task)],
                              capture_output=True, text=True, timeout=timeout_s, env=dict(env, **task.get("env", {})))
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if lines:
            result = json.loads(lines[-1][len("RESULT "):])
        else:
            why = "killed (out of memory?)" if proc.returncode in (-9, 137) else f"exit {proc.returncode}"
            tail = proc.stderr.strip().splitlines()[-1:] if proc.stderr else []
            result = {"ok": False, "error": f"{why} {' '.join(tail)[:300]}"}
    except subprocess.TimeoutExpired:
        result = {"ok": False, "error": f"timeout after {timeout_s}s"}
    result["wall_s"] = time.perf_counter() - t0
    summary = result.get("error") if not result.get("ok") else " ".join(
        f"{m}={result[m]['median_s'] * 1e3:.1f}ms/{result[m].get('gflops', 0):.1f}GF/s"
        for m in ("fwd", "fwd_bwd") if m in result) or f"{result.get('gflops', 0):.1f} GF/s"
    log(f"[{result['wall_s']:6.1f}s] {label}: {summary}")
    return dict(task, result=result)


def build_tasks(args):
    tasks = [{"kind": "matmul", "label": "matmul 2048^3 (start)", "section": "matmul", "n": 2048,
              "repeats": 5 if args.quick else 20}]
    seqlens = args.seqlens
    for impl in args.impls:
        for causal in (False, True):
            for s in seqlens:
                tasks.append({"kind": "attention", "section": "main", "impl": impl, "seqlen": s, "causal": causal,
                              "modes": ["fwd", "fwd_bwd"], "budget_s": args.budget,
                              "label": f"{impl} s={s} causal={causal}"})
    if args.torch_python:
        tasks.append({"kind": "torch_matmul", "label": "torch matmul 2048^3", "section": "torch_matmul",
                      "python": args.torch_python, "repeats": 5 if args.quick else 20})
        for causal in (False, True):
            for s in seqlens:
                tasks.append({"kind": "attention", "section": "main", "impl": "torch_sdpa", "seqlen": s,
                              "causal": causal, "modes": ["fwd", "fwd_bwd"], "budget_s": args.budget,
                              "python": args.torch_python, "label": f"torch_sdpa s={s} causal={causal}"})
    if args.long and "tf_flash" in args.impls:
        for causal in (False, True):
            for s in args.long_seqlens:
                tasks.append({"kind": "attention", "section": "main", "impl": "tf_flash", "seqlen": s,
                              "causal": causal, "modes": args.long_modes, "budget_s": args.budget, "warmup": 1,
                              "min_repeats": 1, "label": f"tf_flash s={s} causal={causal} (long)"})
    if "tf_flash" in args.impls and not args.skip_sparse:
        s = args.sparse_seqlen
        sparse = [("none", None, 1.0)]
        sparse.append(("dense mask", {"builder": "dense"}, 1.0))
        for inv in (2, 4, 8, 16):
            sparse.append((f"random 1/{inv}", {"builder": "random_blocks",
                                               "kwargs": {"density": 1.0 / inv, "seed": 0}}, 1.0 / inv))
        sparse.append(("butterfly", {"builder": "butterfly"}, None))
        sparse.append(("local window=2", {"builder": "local", "kwargs": {"window": 2}}, None))
        for name, spec, _ in sparse:
            extra = {} if spec is None else {"block_mask": dict(spec, block_size=args.block_size)}
            tasks.append({"kind": "attention", "section": "sparse", "impl": "tf_flash", "seqlen": s, "causal": False,
                          "modes": ["fwd", "fwd_bwd"], "budget_s": args.budget, "extra": extra, "pattern": name,
                          "label": f"tf_flash sparse {name} s={s}"})
    if "tf_flash" in args.impls and not args.skip_dropout:
        for s in args.dropout_seqlens:
            for rate in (0.0, 0.1):
                extra = {"dropout_rate": rate, "seed": 1} if rate else {}
                tasks.append({"kind": "attention", "section": "dropout", "impl": "tf_flash", "seqlen": s,
                              "causal": False, "modes": ["fwd", "fwd_bwd"], "budget_s": args.budget, "extra": extra,
                              "rate": rate, "label": f"tf_flash dropout p={rate} s={s}"})
    tasks.append({"kind": "matmul", "label": "matmul 2048^3 (end)", "section": "matmul", "n": 2048,
                  "repeats": 5 if args.quick else 20})
    return tasks


# --isa-compare: (batch, seqlen, heads, dim), non-causal; the last is the example's shape.
ISA_SHAPES = [(1, 2048, 8, 64), (1, 4096, 8, 64), (1, 8192, 8, 64), (16, 2048, 2, 32)]
# The CPU kernel's runs, each path forced per process by TF_FLASH_CPU_ISA (a path the CPU lacks runs the
# default path instead, and the result says which ran): (path, input dtype). bfloat16 on avx512_bf16 is the
# vdpbf16ps path the issue measures against float32 on avx512; bfloat16 on avx512 multiplies the same inputs
# in float32; avx512_amx (the default where the CPU has AMX) runs the bfloat16 products on AMX tiles.
ISA_RUNS = [("avx512", "float32"), ("avx2", "float32"), ("avx512_bf16", "bfloat16"), ("avx512", "bfloat16"),
            ("avx512_amx", "bfloat16")]
# The peaks: float32 FMAs at 8 and 16 lanes, vdpbf16ps where the CPU has AVX512_BF16.
ISA_PEAKS = ["avx512", "avx2", "avx512_bf16"]


def build_isa_tasks(args):
    runs = args.isa_runs or ISA_RUNS
    peaks = [isa for isa in ISA_PEAKS if args.isa_runs is None or any(isa == run[0] for run in runs)]
    tasks = [{"kind": "fma_peak", "section": "peak", "isa": isa,
              "label": f"{isa} {'vdpbf16ps' if isa == 'avx512_bf16' else 'float32 FMA'} peak"} for isa in peaks]
    tasks.append({"kind": "matmul", "label": "TF matmul 2048^3", "section": "matmul", "n": 2048, "repeats": 10})
    for batch, seqlen, heads, dim in args.isa_shapes:
        shape = {"batch": batch, "seqlen": seqlen, "heads": heads, "dim": dim, "causal": False,
                 "modes": ["fwd", "fwd_bwd"], "budget_s": args.budget, "min_repeats": 3}
        name = f"b{batch} s{seqlen} h{heads} d{dim}"
        for isa, dtype in runs:
            tasks.append(dict(shape, kind="attention", section="isa", impl="tf_flash", isa=isa, dtype=dtype,
                              env={"TF_FLASH_CPU_ISA": isa}, label=f"tf_flash {isa} {dtype} {name}"))
        tasks.append(dict(shape, kind="attention", section="isa", impl="tf_standard", label=f"tf_standard {name}"))
        if args.torch_python:
            tasks.append(dict(shape, kind="attention", section="isa", impl="torch_sdpa", python=args.torch_python,
                              label=f"torch_sdpa {name}"))
    if args.torch_python:
        tasks.append({"kind": "torch_matmul", "label": "torch matmul 2048^3", "section": "torch_matmul",
                      "python": args.torch_python, "repeats": 10})
    return tasks


def write_results(entries, info, args, command):
    """results/<tag>.json and .png (plot.py). Returns the tables for the terminal."""
    payload = {"benchmark": "cpu", "info": info, "command": command, "args": vars(args),
               "shape": {"batch": BATCH, "heads": HEADS, "dim": DIM}, "entries": entries}
    plot.save(payload, os.path.join(args.out_dir, f"{args.tag}.json"))
    return plot.tables(payload)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke run: small sizes, short budgets")
    parser.add_argument("--long", action="store_true", help="also tf_flash at --long-seqlens (16k..64k)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=None)
    parser.add_argument("--long-seqlens", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--long-modes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
    parser.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS)
    parser.add_argument("--budget", type=float, default=None, help="seconds of timed calls per config and mode")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per configuration process")
    parser.add_argument("--sparse-seqlen", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--dropout-seqlens", type=int, nargs="+", default=None)
    parser.add_argument("--skip-sparse", action="store_true")
    parser.add_argument("--skip-dropout", action="store_true")
    parser.add_argument("--torch-python", default=None,
                        help="python of a venv with torch (CPU build): adds torch's scaled_dot_product_attention "
                             "as the CPU peer, run in its own processes")
    parser.add_argument("--out-dir", default=None, help="default results/ (results/quick/ with --quick, git-ignored)")
    parser.add_argument("--tag", default=None, help="file stem (default cpu, or cpu_isa with --isa-compare)")
    parser.add_argument("--isa-shapes", nargs="+", default=ISA_SHAPES,
                        type=lambda text: tuple(int(x) for x in text.split(",")),
                        help="--isa-compare's shapes, each B,S,H,D (default: ISA_SHAPES)")
    parser.add_argument("--isa-runs", nargs="+", default=None,
                        type=lambda text: tuple(text.split(":")), metavar="PATH:DTYPE",
                        help="--isa-compare's kernel runs, e.g. avx2:float32 on a CPU without AVX-512 "
                             "(default: ISA_RUNS; when given, only those paths' peaks)")
    parser.add_argument("--isa-compare", action="store_true",
                        help="only the CPU kernel's paths at ISA_SHAPES (float32 on AVX-512 and AVX2, bfloat16 on "
                             "AVX512_BF16, AVX-512 and AMX), TF's attention, torch's with --torch-python, and the peaks "
                             "(~10 min on 16 cores)")
    args = parser.parse_args()
    args.out_dir = common.output_dir(args.out_dir, args.quick)
    if args.worker:
        worker_main(args.worker)
        return
    if args.isa_compare:
        isa_compare(args)
        return
    args.tag = args.tag or "cpu"
    if args.seqlens is None:
        args.seqlens = [512, 1024] if args.quick else [512, 1024, 2048, 4096, 8192]
    if args.budget is None:
        args.budget = 2.0 if args.quick else 15.0
    if args.sparse_seqlen is None:
        args.sparse_seqlen = 2048 if args.quick else 8192
    if args.dropout_seqlens is None:
        args.dropout_seqlens = [1024] if args.quick else [2048, 8192]
    if args.quick:
        args.long_seqlens = [2048]
    info = common.machine_info()
    command = common.command_line()
    log = common.RunLog(os.path.join(args.out_dir, f"{args.tag}.log"))
    log(f"tf_flash CPU benchmark, {info['date_utc']}, {info['cpu']} x{info['cpu_count']}, "
        f"TF {info.get('tensorflow')}, tf_flash {info.get('tf_flash')}")
    entries = []
    for task in build_tasks(args):
        entries.append(run_task(task, args.timeout, log))
        text = write_results(entries, info, args, command)  # a run stopped midway keeps what it measured
    log("")
    log(text)
    log.close()


def isa_compare(args):
    """--isa-compare: its own result, cpu_isa.json and .png (plot.py), not the main benchmark's."""
    args.tag = args.tag or "cpu_isa"
    # A CPU benchmark also on a GPU host: its workers see no GPU, so every op runs on the CPU.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.budget is None:
        args.budget = 4.0
    info = common.machine_info()
    log = common.RunLog(os.path.join(args.out_dir, f"{args.tag}.log"))
    log(f"tf_flash CPU paths, {info['date_utc']}, {info['cpu']} x{info['cpu_count']}, TF {info.get('tensorflow')}")
    entries = []
    for task in build_isa_tasks(args):
        entries.append(run_task(task, min(args.timeout, 300), log))
        payload = {"benchmark": "cpu_isa", "info": info, "command": common.command_line(), "args": vars(args),
                   "entries": entries}
        plot.save(payload, os.path.join(args.out_dir, f"{args.tag}.json"))  # rewritten after every task
    log("")
    log(plot.tables(payload))
    log.close()


if __name__ == "__main__":
    main()
