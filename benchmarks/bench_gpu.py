#!/usr/bin/env python
"""GPU benchmark of tf_flash (method: docs/performance.md), for the lent H100/H200.

Grid (FA2 paper): hidden 2048, head dim d in {64, 128} (+256 with --dims), heads = 2048/d,
(batch, seqlen) in (32,512) (16,1k) (8,2k) (4,4k) (2,8k) (1,16k); causal and not; bf16 and fp16
(fp32 with --fp32; fp8 with --dtypes ... fp8: float8_e4m3fn inputs with descales of 1 and a bfloat16
output, tf_flash's Hopper forward only, the forward row only); inputs N(0,1), layout [B, S, H, D]. FLOPs:
fwd = 4 b s^2 h d (halved when causal), fwd+bwd = 3.5 fwd.

Implementations, all in the same run: tf_flash; TF standard attention (einsum, softmax, einsum) with and
without jit_compile=True; the attention of keras.layers.MultiHeadAttention (keras.ops.dot_product_attention);
with --torch, torch SDPA with the flash and cuDNN backends in a separate process. Also a tf_flash
block-sparse density sweep and the dropout overhead at b2 s8192 h16 d128 (--skip-extras to leave out).

Timing: per configuration, >= 3 warm-up calls after the first (tracing/compilation) call, then >= 20
timed samples; a sample runs k back-to-back calls (k sized so a sample lasts >= ~25 ms, so Python
dispatch overlaps the GPU work as in a training loop) and ends by fetching one element of the last
result (synchronizes the stream). Reported: median per-call time and spread (min, q1, q3, max).
Memory: peak of tf.config.experimental.get_memory_info after reset_memory_stats, one fwd+bwd, for
s = 1k .. 64k at b=1, h=16, d=128 and the FA1 configuration (b=16, h=8, d=64); torch:
max_memory_allocated.

Robustness: each implementation runs in a worker process that appends one JSON line per finished
configuration; out-of-memory and other errors are recorded and the worker goes on; if the worker dies
(TF's standard attention aborts at b*h*s^2 >= 2^31) the parent records the crash and starts a new worker
for the remaining configurations.

Output: results/gpu_<dtype>.json and .png for each dtype measured (plot.py; the figure: TFLOP/s against
sequence length per head dim, forward and forward+backward, causal and not), rewritten every 30 s while
the run goes on; the workers' output in results/gpu.log.

    python benchmarks/bench_gpu.py --torch               # full grid
    python benchmarks/bench_gpu.py --quick --torch       # smoke run: results/quick/ (git-ignored)
    python benchmarks/bench_gpu.py --merge A.json B.json # one result from runs split by --impls / --torch-only
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import plot  # noqa: E402

FA2_GRID = [(32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)]
TF_IMPLS = ["tf_flash", "tf_standard", "tf_standard_xla", "keras_mha"]
TORCH_IMPLS = ["torch_flash", "torch_cudnn"]
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn"}


# ---------------------------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------------------------

def _tf_run_config(cfg, args):
    import tensorflow as tf
    dtype = tf.as_dtype(DTYPE_NAMES[cfg["dtype"]])
    shape = [cfg["batch"], cfg["seqlen"], cfg["heads"], cfg["dim"]]
    # Cast where the attention runs. fp8: N(0, 1) fits e4m3 with descales of 1, and TF has no GPU Identity (nor
    # Reshape) for float8_e4m3fn, so tf.identity of a cast elsewhere would leave host tensors, copied every call.
    with tf.device(args.device):
        q, k, v, dout = (tf.cast(tf.random.normal(shape, seed=i), dtype) for i in range(4))
    if cfg["impl"] == "tf_flash" and args.device.startswith("GPU"):
        import tf_flash
        if tf_flash.build_info().get("cuda") != "1":  # else TF would quietly run the CPU kernel
            raise RuntimeError(f"tf_flash was built without CUDA: {tf_flash.build_info()}")
    extra = dict(cfg.get("extra") or {})
    if "block_mask" in extra:
        from tf_flash import sparsity
        spec = extra.pop("block_mask")
        extra["block_mask"], _ = getattr(sparsity, spec["builder"])(
            cfg["seqlen"], cfg["seqlen"], spec["block_size"], **spec.get("kwargs", {}))
        extra["block_size"] = spec["block_size"]
    chain = 1 if cfg["kind"] == "memory" else args.calls_per_function
    fwd, fwd_bwd = common.make_fns(cfg["impl"], cfg["causal"], extra, chain=chain)
    result = {}
    if cfg["kind"] == "memory":
        tf.config.experimental.reset_memory_stats(args.device)
        base = tf.config.experimental.get_memory_info(args.device)["current"]
        with tf.device(args.device):
            grads = fwd_bwd(q, k, v, dout)
            grads[0][0, 0, 0, 0].numpy()
        info = tf.config.experimental.get_memory_info(args.device)
        del grads
        return {"peak_mb": info["peak"] / 2**20, "inputs_mb": base / 2**20,
                "extra_mb": (info["peak"] - base) / 2**20}
    counts = None
    if cfg["impl"] == "tf_flash":  # which CUDA kernel family ran (all zeros on the CPU)
        from tf_flash import cuda_kernel_counts as counts
    for mode in cfg["modes"]:
        fn = fwd if mode == "fwd" else fwd_bwd
        try:
            before = counts() if counts else None
            with tf.device(args.device):
                t0 = time.perf_counter()
                first = fn(q, k, v, dout)
                (first if mode == "fwd" else first[0])[0, 0, 0, 0].numpy()
                compile_s = time.perf_counter() - t0
                del first
                stats = common.sample_calls(
                    lambda: fn(q, k, v, dout),
                    lambda r: (r if mode == "fwd" else r[0])[0, 0, 0, 0].numpy(),
                    args.warmup, args.repeats)
            stats["first_call_s"] = compile_s
            for key in ("median_s", "min_s", "max_s", "q1_s", "q3_s"):  # per attention
                stats[key] /= chain
            stats["attentions_per_call"] = chain
            if before is not None:
                after = counts()
                stats["kernels"] = ",".join(k for k in after if after[k] > before[k])
            stats["tflops"] = common.attention_flops(cfg["batch"], cfg["seqlen"], cfg["heads"], cfg["dim"],
                                                     cfg["causal"], mode) / stats["median_s"] / 1e12
            result[mode] = stats
        except Exception as err:  # noqa: BLE001 - OOM and friends: record and go on
            result[mode] = {"error": common.error_text(err)}
    return result


def _torch_run_config(cfg, args):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"torch_flash": SDPBackend.FLASH_ATTENTION, "torch_cudnn": SDPBackend.CUDNN_ATTENTION}[cfg["impl"]]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg["dtype"]]
    shape = (cfg["batch"], cfg["heads"], cfg["seqlen"], cfg["dim"])  # torch SDPA layout [B, H, S, D]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    F = torch.nn.functional

    def fwd():
        with torch.no_grad(), sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=cfg["causal"])

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=cfg["causal"])
        out.backward(dout)
        return q.grad

    def fetch(r):
        torch.cuda.synchronize()

    if cfg["kind"] == "memory":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return {"peak_mb": peak / 2**20, "inputs_mb": base / 2**20, "extra_mb": (peak - base) / 2**20}
    result = {}
    for mode in cfg["modes"]:
        fn = fwd if mode == "fwd" else fwd_bwd
        try:
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            stats = common.sample_calls(fn, fetch, args.warmup, args.repeats)
            stats["first_call_s"] = first
            stats["tflops"] = common.attention_flops(cfg["batch"], cfg["seqlen"], cfg["heads"], cfg["dim"],
                                                     cfg["causal"], mode) / stats["median_s"] / 1e12
            result[mode] = stats
        except Exception as err:  # noqa: BLE001
            result[mode] = {"error": common.error_text(err)}
        finally:
            torch.cuda.empty_cache()
    return result


def worker_main(args):
    with open(args.worker) as f:
        configs = json.load(f)
    is_torch = configs and configs[0]["impl"].startswith("torch")
    if not is_torch:
        import tensorflow as tf
        for gpu in tf.config.list_physical_devices("GPU"):
            tf.config.experimental.set_memory_growth(gpu, True)
        if args.device.startswith("GPU") and not tf.config.list_physical_devices("GPU"):
            raise SystemExit("no GPU visible to TensorFlow")
    run = _torch_run_config if is_torch else _tf_run_config
    with open(args.results, "a") as out:
        if is_torch:  # the peer's versions, as this process sees them
            import torch
            out.write(json.dumps({"torch": f"{torch.__version__}, CUDA {torch.version.cuda}, "
                                           f"cuDNN {torch.backends.cudnn.version()}"}) + "\n")
        for cfg in configs:
            if args.deadline and time.time() > args.deadline:
                out.write(json.dumps({"id": cfg["id"], "result": {"error": "skipped: --time-limit"}}) + "\n")
                out.flush()
                continue
            out.write(json.dumps({"start": cfg["id"]}) + "\n")
            out.flush()
            try:
                result = run(cfg, args)
            except Exception as err:  # noqa: BLE001
                result = {"error": common.error_text(err)}
            out.write(json.dumps({"id": cfg["id"], "result": result}) + "\n")
            out.flush()
            if not is_torch:
                import gc
                gc.collect()
            else:
                import torch
                torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------------------

def build_configs(args):
    configs = []
    impls = list(args.impls) + (TORCH_IMPLS if args.torch else [])
    for impl in impls:
        for dtype in args.dtypes:
            if dtype == "fp8" and impl != "tf_flash":
                continue  # the others have no fp8 attention in TF
            for dim in args.dims:
                for causal in (False, True):
                    for batch, seqlen in args.grid:
                        configs.append({"kind": "speed", "impl": impl, "dtype": dtype, "batch": batch,
                                        "seqlen": seqlen, "heads": args.hidden // dim, "dim": dim, "causal": causal,
                                        "modes": ["fwd"] if dtype == "fp8" else ["fwd", "fwd_bwd"]})
        if not args.skip_memory:
            mem_dtype = next((d for d in args.dtypes if d != "fp8"), None)  # fwd+bwd: not fp8
            if mem_dtype is None:
                continue
            for seqlen in args.mem_seqlens:
                configs.append({"kind": "memory", "impl": impl, "dtype": mem_dtype, "batch": 1, "seqlen": seqlen,
                                "heads": 16, "dim": 128, "causal": False, "modes": ["fwd_bwd"],
                                "mem_set": "b1 h16 d128"})
            for seqlen in args.fa1_seqlens:
                configs.append({"kind": "memory", "impl": impl, "dtype": mem_dtype, "batch": 16, "seqlen": seqlen,
                                "heads": 8, "dim": 64, "causal": False, "modes": ["fwd_bwd"],
                                "mem_set": "FA1 b16 h8 d64"})
    if "tf_flash" in args.impls and not args.skip_extras:
        # Block-sparse density sweep (paper Fig. 2 right) and dropout overhead, tf_flash only.
        dtype0, (batch, seqlen) = next((d for d in args.dtypes if d != "fp8"), "bf16"), args.extras_shape
        base = {"kind": "speed", "impl": "tf_flash", "dtype": dtype0, "batch": batch, "seqlen": seqlen,
                "heads": args.hidden // 128, "dim": 128, "causal": False, "modes": ["fwd", "fwd_bwd"]}
        patterns = [("none", None), ("dense mask", {"builder": "dense"})]
        patterns += [(f"random 1/{n}", {"builder": "random_blocks", "kwargs": {"density": 1.0 / n, "seed": 0}})
                     for n in (2, 4, 8, 16)]
        patterns += [("butterfly", {"builder": "butterfly"})]
        for name, spec in patterns:
            extra = {} if spec is None else {"block_mask": dict(spec, block_size=args.block_size)}
            configs.append(dict(base, extra=extra, extras="sparse", pattern=name))
        for rate in (0.0, 0.1):
            configs.append(dict(base, extra={"dropout_rate": rate, "seed": 1} if rate else {}, extras="dropout",
                                pattern=f"dropout {rate}"))
    for i, cfg in enumerate(configs):
        cfg["id"] = i
    return configs


def run_group(configs, args, info, log, on_progress=None):
    """Runs configs (one implementation) in worker processes, restarting after a crash. Returns {id: result};
    a torch worker's versions go to info["torch"]. on_progress(results) is called now and then while results
    come in (to keep the result files current)."""
    results, remaining = {}, list(configs)
    last_progress = time.perf_counter()
    while remaining:
        if args.deadline and time.time() > args.deadline:
            for c in remaining:
                results[c["id"]] = {"error": "skipped: --time-limit"}
            break
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(remaining, f)
            cfg_path = f.name
        res_path = cfg_path + ".results"
        open(res_path, "w").close()
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", cfg_path, "--results", res_path,
               "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--device", args.device,
               "--deadline", str(args.deadline or 0), "--calls-per-function", str(args.calls_per_function)]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen, started, last_line = 0, None, ""
        deadline = t0 + args.group_timeout
        while True:
            try:
                output, _ = proc.communicate(timeout=5)
                lines = (output or "").strip().splitlines() or [""]
                telling = [l for l in lines if any(w in l for w in ("Check failed", "rror", "Abort", "Killed",
                                                                    "Segmentation", "out of memory"))]
                last_line = (telling or lines)[-1]
                break
            except subprocess.TimeoutExpired:
                pass
            seen = _drain(res_path, seen, results, info, log, configs)
            if on_progress and time.perf_counter() - last_progress > 30:
                on_progress(results)
                last_progress = time.perf_counter()
            if time.perf_counter() > deadline:
                proc.kill()
                proc.communicate()
                last_line = f"group timeout after {args.group_timeout}s"
                break
        _drain(res_path, seen, results, info, log, configs)
        with open(res_path) as f:
            for line in f:
                rec = json.loads(line)
                if "start" in rec:
                    started = rec["start"]
                elif rec.get("id") == started:
                    started = None
        before = len(remaining)
        remaining = [c for c in remaining if c["id"] not in results]
        if remaining:
            victim = started if started is not None else remaining[0]["id"]
            why = f"worker died (exit {proc.returncode}): {last_line[:200]}"
            results[victim] = {"error": why, "crashed": True}
            log(f"  crash on config {victim}: {why}")
            remaining = [c for c in remaining if c["id"] != victim]
            if len(remaining) == before:  # no progress at all: give up on this group
                for c in remaining:
                    results[c["id"]] = {"error": "skipped: " + why}
                remaining = []
        for path in (cfg_path, res_path):
            try:
                os.unlink(path)
            except OSError:
                pass
    return results


def _drain(res_path, seen, results, info, log, configs):
    by_id = {c["id"]: c for c in configs}
    with open(res_path) as f:
        lines = f.readlines()
    for line in lines[seen:]:
        if not line.endswith("\n"):
            break
        seen += 1
        rec = json.loads(line)
        if "torch" in rec:
            info["torch"] = rec["torch"]
        elif "id" in rec:
            results[rec["id"]] = rec["result"]
            log("  " + _describe(by_id[rec["id"]], rec["result"]))
    return seen


def _describe(cfg, result):
    head = (f"{cfg['impl']:16s} {cfg['dtype']} b{cfg['batch']} s{cfg['seqlen']} h{cfg['heads']} d{cfg['dim']} "
            f"{'causal' if cfg['causal'] else 'full  '}") + (f" [{cfg['pattern']}]" if "pattern" in cfg else "")
    if cfg["kind"] == "memory":
        peak = f"peak {result['peak_mb']:.0f} MB" if "peak_mb" in result else result.get("error", "?")
        return f"{head} memory: {peak}"
    parts = []
    for mode in cfg["modes"]:
        r = result.get(mode, result)
        parts.append(f"{mode} " + (f"{r['median_s'] * 1e3:.3f} ms {r['tflops']:.1f} TF/s" if "median_s" in r
                                   else r.get("error", "?")))
    return head + " " + " | ".join(parts)


def write_results(entries, info, run_args, command, out_dir, stem):
    """One result per dtype: out_dir/<stem>_<dtype>.json and .png (plot.py). Returns the tables for the terminal."""
    text = []
    for dtype in dict.fromkeys(e["dtype"] for e in entries):
        payload = {"benchmark": "gpu", "info": info, "command": command, "args": run_args,
                   "entries": [e for e in entries if e["dtype"] == dtype]}
        plot.save(payload, os.path.join(out_dir, f"{stem}_{dtype}.json"))
        text.append(plot.tables(payload))
    return "\n".join(text)


def merge_main(args):
    """One result from several result files (e.g. runs split by --impls to fit the lent machine's limits)."""
    payloads = [plot.load(path) for path in args.merge]
    entries = [e for p in payloads for e in p["entries"]]
    info = dict(payloads[0]["info"], merged_from=[os.path.basename(p) for p in args.merge],
                dates=sorted({p["info"].get("date_utc") for p in payloads}))
    torch = [p["info"]["torch"] for p in payloads if p["info"].get("torch")]
    if torch:
        info["torch"] = torch[0]
    command = " + ".join(p["command"] for p in payloads) + " (merged)"
    print(write_results(entries, info, payloads[0]["args"], command, args.out_dir, args.tag or "gpu"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke run: two shapes, d128, bf16, few repeats")
    parser.add_argument("--torch", action="store_true", help="also torch SDPA (flash, cuDNN) in a separate process")
    parser.add_argument("--impls", nargs="+", default=TF_IMPLS, choices=TF_IMPLS)
    parser.add_argument("--dtypes", nargs="+", default=None, choices=list(DTYPE_NAMES))
    parser.add_argument("--fp32", action="store_true", help="add float32 (reported separately)")
    parser.add_argument("--dims", type=int, nargs="+", default=None)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--grid", default=None, help="batch:seqlen,... (default the FA2 grid)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--calls-per-function", type=int, default=1,
                        help="attentions chained in each timed tf.function (TF rows): the call's own cost, 0.4-0.6 ms "
                             "of host time on the lent machines, is then spread over them as over a model's graph; "
                             "times and TFLOP/s are per attention")
    parser.add_argument("--mem-seqlens", type=int, nargs="+", default=None)
    parser.add_argument("--fa1-seqlens", type=int, nargs="+", default=None)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--torch-only", action="store_true", help="only the torch SDPA peer (implies --torch)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds: start no configuration after this (the lent machine allows 10 min a command)")
    parser.add_argument("--deadline", type=float, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--merge", nargs="+", default=None,
                        help="result .json files of earlier runs (e.g. one per --impls subset): one result per dtype")
    parser.add_argument("--skip-extras", action="store_true", help="no block-sparse sweep / dropout overhead")
    parser.add_argument("--extras-shape", default=None, help="batch:seqlen of the extras (default 2:8192)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--group-timeout", type=float, default=3600, help="seconds per implementation worker")
    parser.add_argument("--out-dir", default=None, help="default results/ (results/quick/ with --quick, git-ignored)")
    parser.add_argument("--tag", default=None, help="file stem before _<dtype> (default gpu: results/gpu_bf16.json)")
    parser.add_argument("--device", default="GPU:0", help="TF device (CPU:0 only to smoke-test this script)")
    args = parser.parse_args()
    if args.calls_per_function < 1:
        parser.error(f"--calls-per-function must be >= 1. Received: {args.calls_per_function}")
    args.out_dir = common.output_dir(args.out_dir, args.quick)
    if args.worker:
        worker_main(args)
        return
    if args.merge:
        merge_main(args)
        return
    if args.torch_only:
        args.torch, args.impls = True, []
    if args.time_limit:
        args.deadline = time.time() + args.time_limit
    if args.grid:
        args.grid = [tuple(int(x) for x in item.split(":")) for item in args.grid.split(",")]
    else:
        args.grid = [(2, 512), (1, 2048)] if args.quick else FA2_GRID
    if args.extras_shape:
        args.extras_shape = tuple(int(x) for x in args.extras_shape.split(":"))
    else:
        args.extras_shape = (1, 2048) if args.quick else (2, 8192)
    if args.dtypes is None:
        args.dtypes = ["bf16"] if args.quick else ["bf16", "fp16"]
    if args.fp32 and "fp32" not in args.dtypes:
        args.dtypes.append("fp32")
    if args.dims is None:
        args.dims = [128] if args.quick else [64, 128]
    if args.quick:
        args.repeats = min(args.repeats, 5)
    if args.mem_seqlens is None:
        args.mem_seqlens = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768, 65536]
    if args.fa1_seqlens is None:
        args.fa1_seqlens = [] if args.quick else [512, 1024, 2048, 4096, 8192]
    try:  # the parent only coordinates: keep its TensorFlow off the GPU, the workers need all of it
        import tensorflow as tf
        tf.config.set_visible_devices([], "GPU")
    except (ImportError, RuntimeError):
        pass
    info = common.machine_info(gpu=True)
    command = common.command_line()
    stem = args.tag or "gpu"
    log = common.RunLog(os.path.join(args.out_dir, f"{stem}.log"))
    log(f"tf_flash GPU benchmark {info['date_utc']} on {info.get('gpus')}, TF {info.get('tensorflow')}, "
        f"tf_flash {info.get('tf_flash')} {info.get('tf_flash_build', '')}")
    configs = build_configs(args)
    results = {}

    def write(done):
        entries = [dict(c, result=done[c["id"]]) for c in configs if c["id"] in done]
        return write_results(entries, info, vars(args), command, args.out_dir, stem)

    for impl in list(args.impls) + (TORCH_IMPLS if args.torch else []):
        group = [c for c in configs if c["impl"] == impl]
        log(f"== {impl}: {len(group)} configurations")
        results.update(run_group(group, args, info, log, lambda partial: write({**results, **partial})))
        text = write(results)
    log("")
    log(text)
    log.close()


if __name__ == "__main__":
    main()
