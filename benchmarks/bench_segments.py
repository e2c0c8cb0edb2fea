#!/usr/bin/env python
"""Packed documents (issue 43): `segment_ids` against the dense block-diagonal mask and plain causal attention.

One row of S tokens (default S = 16k, 64k, 128k; batch 1, 16 heads, 16 KV heads, head dim 128, bfloat16)
holds documents of random lengths: log-normal (sigma 0.5) with the same mean at every S (--mean-doc-len,
default 655 = 16384 / 25: 26 documents at 16k, 103 at 64k, 203 at 128k), drawn with a fixed numpy
seed (2), the last one cut to fill the row (the shorter rows are prefixes of the longer ones). Four cases per S:

  segments_causal   tf_flash.flash_attention(..., causal=True, segment_ids=ids)   [1, S] int32: causal packing
  mask_causal       the same pattern as a dense attention_mask [1, 1, S, S] bool (block-diagonal), causal=True;
                    skipped with its reason when S * S bytes pass --max-mask-gb (default 20). The mask is built
                    on the device before timing: the time is the kernel's, the peak memory includes the mask.
  causal            plain causal attention over the whole row: the no-packing baseline
  segments_bidir    segment_ids without causal: bidirectional documents (an encoder classifier)

Per case, forward and forward+backward (the gradients of q, k, v for a given dO, common.make_fns):
the first call (tracing) apart, --warmup calls, then --repeats samples of k back-to-back calls (k sized so a
sample lasts >= ~25 ms), each sample ending by fetching one element of the last result (as bench_gpu.py
times); the median per call. FLOPs are those the pattern needs: 4 x D per visible (query, key) pair per head
(a document of L tokens has L (L + 1) / 2 pairs causal, L^2 bidirectional; plain causal S (S + 1) / 2), x 3.5
for forward+backward (backward = 2.5 forward, as docs/performance.md counts); TFLOP/s = those over the median.
Peak device memory of one call of each mode (reset_memory_stats, then get_memory_info(...)["peak"], the
inputs and a mask included; call_bytes: the peak over what was allocated before the call); null on the CPU.
The mask case also records the largest difference of its forward output from the segment_ids one (the same
attention, so only rounding).

Every case runs in one worker process, which appends a JSON line per finished case; a worker that dies
(an abort on a huge mask, say) has the case it was running recorded as a crash and a new worker goes on
with the rest. --time-limit (seconds, default 180) starts no case after it, so that the default GPU run
ends within about 4 minutes on an H100.
Output: results/<tag>.json and results/<tag>.png (time against S per case, forward and forward+backward,
log-log, and peak memory), rewritten as cases finish; a table on the terminal.

    python benchmarks/bench_segments.py                         # H100: results/gpu_segments.json, .png
    python benchmarks/bench_segments.py --quick                 # CPU smoke run: results/quick/ (git-ignored)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import plot  # noqa: E402

CASES = ["segments_causal", "mask_causal", "causal", "segments_bidir"]
CASE_LABELS = {"segments_causal": "segment_ids, causal", "mask_causal": "dense block-diagonal mask, causal",
               "causal": "plain causal (no documents)", "segments_bidir": "segment_ids, bidirectional"}
CASE_STYLE = {"segments_causal": ("C3", "o-"), "mask_causal": ("C0", "s--"), "causal": ("C7", "^-"),
              "segments_bidir": ("C2", "d-")}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "float32": "float32"}
DOC_SIGMA = 0.5
QUICK = {"seqlens": [1024, 2048], "heads": 2, "kv_heads": 2, "dim": 64, "dtype": "float32", "device": "CPU:0",
         "mean_doc_len": 128, "warmup": 1, "repeats": 3}


# ---------------------------------------------------------------------------------------------------------
# Documents and FLOPs (no TensorFlow)
# ---------------------------------------------------------------------------------------------------------

def document_lengths(seqlen, mean_len, seed):
    """Lengths (ints >= 1) of documents packed into one row of `seqlen` tokens: log-normal with mean `mean_len`
    (sigma DOC_SIGMA), drawn in order with numpy's default_rng(seed) until the row is full, the last one cut to
    fit. The same seed gives the same documents at every length, so a shorter row is a prefix of a longer one."""
    rng = np.random.default_rng(seed)
    mu = np.log(mean_len) - DOC_SIGMA ** 2 / 2
    lengths, total = [], 0
    while total < seqlen:
        n = min(max(1, int(round(rng.lognormal(mu, DOC_SIGMA)))), seqlen - total)
        lengths.append(n)
        total += n
    return lengths


def segment_ids(lengths):
    """int32 [sum(lengths)]: document i's tokens hold id i."""
    return np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)


def visible_pairs(lengths, causal):
    """(query, key) pairs that attend inside the documents: L (L + 1) / 2 per document causal, L^2 not."""
    return int(sum(n * (n + 1) // 2 if causal else n * n for n in lengths))


def case_documents(case, lengths):
    """The documents a case attends within: plain causal treats the whole row as one."""
    return [sum(lengths)] if case == "causal" else lengths


def case_causal(case):
    return case != "segments_bidir"


def case_flops(case, rows, heads, dim, mode):
    """FLOPs the case's pattern needs over `rows` (one list of document lengths per batch row): 4 x dim per
    visible pair per head forward, 3.5 x that forward+backward."""
    pairs = sum(visible_pairs(case_documents(case, lengths), case_causal(case)) for lengths in rows)
    return 4.0 * dim * heads * pairs * (3.5 if mode == "fwd_bwd" else 1.0)


def batch_lengths(cfg, seqlen):
    """One list of document lengths per batch row (row b: seed + b)."""
    return [document_lengths(seqlen, cfg["mean_doc_len"], cfg["seed"] + b) for b in range(cfg["batch"])]


def mask_bytes(cfg, seqlen):
    return cfg["batch"] * seqlen * seqlen  # bool [B, 1, S, S]


# ---------------------------------------------------------------------------------------------------------
# Worker
# ---------------------------------------------------------------------------------------------------------

def _first(result, mode):
    return (result if mode == "fwd" else result[0])[0, 0, 0, 0].numpy()


class _Inputs:
    """q, k, v, dO and the segment ids of one length, made once and shared by its cases."""

    def __init__(self, tf, cfg, seqlen):
        dtype = getattr(tf, cfg["dtype"])
        b, h, hkv, d = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["dim"]
        with tf.device(cfg["device"]):
            self.q = tf.cast(tf.random.stateless_normal([b, seqlen, h, d], seed=[seqlen, 0]), dtype)
            self.k = tf.cast(tf.random.stateless_normal([b, seqlen, hkv, d], seed=[seqlen, 1]), dtype)
            self.v = tf.cast(tf.random.stateless_normal([b, seqlen, hkv, d], seed=[seqlen, 2]), dtype)
            self.dout = tf.cast(tf.random.stateless_normal([b, seqlen, h, d], seed=[seqlen, 3]), dtype)
            self.ids = tf.constant(np.stack([segment_ids(lengths) for lengths in batch_lengths(cfg, seqlen)]))
        self.seqlen = seqlen


def run_case(tf, cfg, inputs, case):
    seqlen, gpu = inputs.seqlen, cfg["device"].upper().startswith("GPU")
    record = {"seqlen": seqlen, "case": case, "causal": case_causal(case)}
    extra, mask = {}, None
    if case in ("segments_causal", "segments_bidir"):
        extra["segment_ids"] = inputs.ids
    elif case == "mask_causal":
        need = mask_bytes(cfg, seqlen)
        record["mask_bytes"] = need
        if need > cfg["max_mask_gb"] * 1e9:
            record["status"] = f"skipped: the mask needs {need / 1e9:.1f} GB > --max-mask-gb {cfg['max_mask_gb']:g}"
            return record
        with tf.device(cfg["device"]):
            ids = inputs.ids
            mask = tf.equal(ids[:, None, :, None], ids[:, None, None, :])  # [B, 1, S, S]
            mask[0, 0, 0, 0].numpy()
        extra["attention_mask"] = mask
    record["flops"] = {m: case_flops(case, batch_lengths(cfg, seqlen), cfg["heads"], cfg["dim"], m)
                       for m in ("fwd", "fwd_bwd")}
    counts = None
    if gpu:
        from tf_flash import cuda_kernel_counts as counts
    args = (inputs.q, inputs.k, inputs.v, inputs.dout)
    fwd, fwd_bwd = common.make_fns("tf_flash", case_causal(case), extra, chain=cfg["calls_per_function"])
    failed = False
    for mode, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        try:
            before = counts() if counts else None
            with tf.device(cfg["device"]):
                t0 = time.perf_counter()
                _first(fn(*args), mode)
                first_s = time.perf_counter() - t0
                stats = common.sample_calls(lambda: fn(*args), lambda r: _first(r, mode), cfg["warmup"], cfg["repeats"])
            for key in ("median_s", "min_s", "max_s", "q1_s", "q3_s"):  # per attention
                stats[key] /= cfg["calls_per_function"]
            stats.update(first_call_s=first_s, median_ms=1e3 * stats["median_s"],
                         tflops=record["flops"][mode] / stats["median_s"] / 1e12)
            if before is not None:
                after = counts()
                stats["kernels"] = ",".join(k for k in after if after[k] > before[k])
            record[mode] = stats
        except Exception as err:  # noqa: BLE001 - OOM and friends: recorded, the next case runs
            record[mode] = {"error": common.error_text(err)}
            failed = True
    # Peak memory of one call of each mode (one attention per call).
    memory = {"fwd": None, "fwd_bwd": None}
    if gpu and not failed:
        device = cfg["device"].split("device:")[-1]
        fwd1, fwd_bwd1 = common.make_fns("tf_flash", case_causal(case), extra, chain=1)
        for mode, fn in (("fwd", fwd1), ("fwd_bwd", fwd_bwd1)):
            try:
                with tf.device(cfg["device"]):
                    _first(fn(*args), mode)  # traced before the reset
                    tf.config.experimental.reset_memory_stats(device)
                    base = tf.config.experimental.get_memory_info(device)["current"]
                    result = fn(*args)
                    _first(result, mode)
                    peak = tf.config.experimental.get_memory_info(device)["peak"]
                    del result
                memory[mode] = {"peak_bytes": peak, "before_bytes": base, "call_bytes": peak - base}
            except Exception as err:  # noqa: BLE001
                memory[mode] = {"error": common.error_text(err)}
    record["memory"] = memory
    if case == "mask_causal" and not failed:  # the same attention as segment_ids: only rounding apart
        import tf_flash
        with tf.device(cfg["device"]):
            by_mask = tf_flash.flash_attention(inputs.q, inputs.k, inputs.v, causal=True, attention_mask=mask)
            by_ids = tf_flash.flash_attention(inputs.q, inputs.k, inputs.v, causal=True, segment_ids=inputs.ids)
            diff = tf.reduce_max(tf.abs(tf.cast(by_mask, tf.float32) - tf.cast(by_ids, tf.float32)))
        record["max_abs_diff_vs_segment_ids"] = float(diff.numpy())
        del by_mask, by_ids
    errors = [record[m]["error"] for m in ("fwd", "fwd_bwd") if "error" in record[m]]
    record["status"] = f"error: {errors[0]}" if failed else "ok"
    return record


def worker_main(task_path):
    with open(task_path) as f:
        task = json.load(f)
    cfg = task["cfg"]
    out = open(task_path + ".results", "a")

    def emit(obj):
        out.write(json.dumps(obj, default=str) + "\n")
        out.flush()

    import tensorflow as tf

    for gpu in tf.config.list_physical_devices("GPU"):
        tf.config.experimental.set_memory_growth(gpu, True)
    gpu = cfg["device"].upper().startswith("GPU")
    if gpu and not tf.config.list_physical_devices("GPU"):
        raise SystemExit(f"--device {cfg['device']}: no GPU visible to TensorFlow (--quick runs on the CPU)")
    import tf_flash
    if gpu and tf_flash.build_info().get("cuda") != "1":  # else TF would quietly run the CPU kernel
        raise SystemExit(f"tf_flash was built without CUDA: {tf_flash.build_info()}")
    if task.get("want_info"):
        emit({"info": common.machine_info(gpu=gpu)})
    inputs = None
    for seqlen, case in task["todo"]:
        if cfg["deadline"] and time.time() > cfg["deadline"]:
            emit({"record": {"seqlen": seqlen, "case": case, "causal": case_causal(case),
                             "status": "skipped: --time-limit"}})
            continue
        emit({"start": [seqlen, case]})
        try:
            if inputs is None or inputs.seqlen != seqlen:
                inputs = None
                inputs = _Inputs(tf, cfg, seqlen)
            record = run_case(tf, cfg, inputs, case)
        except Exception as err:  # noqa: BLE001
            record = {"seqlen": seqlen, "case": case, "causal": case_causal(case), "status": common.error_text(err)}
        emit({"record": record})
        import gc
        gc.collect()
    out.close()


# ---------------------------------------------------------------------------------------------------------
# Parent: workers, results, figure, table
# ---------------------------------------------------------------------------------------------------------

def _gib(value):
    return None if value is None else value / 2**30


def _peak(record, mode):
    mem = (record.get("memory") or {}).get(mode) or {}
    return mem.get("peak_bytes")


def _ms(record, mode):
    return (record.get(mode) or {}).get("median_ms") if record.get("status") == "ok" else None


def table(payload):
    records = {(r["seqlen"], r["case"]): r for r in payload["records"]}
    rows = []
    for s in payload["config"]["seqlens"]:
        mask = records.get((s, "mask_causal"))
        for case in payload["config"]["cases"]:
            r = records.get((s, case))
            if r is None:
                continue
            if r.get("status") != "ok":
                rows.append([plot.seqlen_label(s), case, r.get("status")] + [None] * 6)
                continue
            fwd, fb = r["fwd"], r["fwd_bwd"]
            vs_mask = None
            if case == "segments_causal" and mask is not None and _ms(mask, "fwd") and _ms(mask, "fwd_bwd"):
                vs_mask = f"{_ms(mask, 'fwd') / fwd['median_ms']:.2f} / {_ms(mask, 'fwd_bwd') / fb['median_ms']:.2f}"
            peak = [_gib(_peak(r, m)) for m in ("fwd", "fwd_bwd")]
            docs = 1 if case == "causal" else len(payload["documents"][str(s)]["lengths"][0])
            rows.append([plot.seqlen_label(s), case, docs, f"{fwd['median_ms']:.3f}", f"{fwd['tflops']:.3g}",
                         f"{fb['median_ms']:.3f}", f"{fb['tflops']:.3g}",
                         "-" if peak[1] is None else f"{peak[0]:.2f} / {peak[1]:.2f}", vs_mask or ""])
    headers = ["S", "case", "docs", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s",
               "peak GiB fwd / fwd+bwd", "mask time / segment_ids time"]
    return plot.machine_line(payload["info"] or {}) + "\n\n" + plot.markdown_table(headers, rows)


def figure(payload, png_path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in payload["records"] if r.get("status") == "ok"]
    if not ok:
        return None
    has_memory = any(_peak(r, "fwd_bwd") for r in ok)
    fig, axes = plt.subplots(1, 3 if has_memory else 2, figsize=(15 if has_memory else 10.5, 4.2))
    seqlens = sorted({r["seqlen"] for r in ok})
    for case in payload["config"]["cases"]:
        rows = sorted((r for r in ok if r["case"] == case), key=lambda r: r["seqlen"])
        color, style = CASE_STYLE[case]
        for ax, mode in zip(axes, ("fwd", "fwd_bwd")):
            ax.plot([r["seqlen"] for r in rows], [r[mode]["median_ms"] for r in rows], style, color=color,
                    markersize=4, label=CASE_LABELS[case])
        if has_memory:
            points = [(r["seqlen"], _gib(_peak(r, "fwd_bwd"))) for r in rows if _peak(r, "fwd_bwd")]
            axes[2].plot([p[0] for p in points], [p[1] for p in points], style, color=color, markersize=4,
                         label=CASE_LABELS[case])
    titles = [("fwd", "forward: median ms per call"), ("fwd_bwd", "forward + backward: median ms per call")]
    if has_memory:
        titles.append(("mem", "peak device memory of one forward+backward (GiB)"))
    for ax, (_, title) in zip(axes, titles):
        plot.seqlen_axis(ax, seqlens, "tokens per row (S)")
        plot.log_axis(ax)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    cfg = payload["config"]
    fig.suptitle(f"Packed documents (mean {cfg['mean_doc_len']} tokens): segment_ids vs dense mask vs causal; "
                 f"b{cfg['batch']} h{cfg['heads']}/{cfg['kv_heads']} d{cfg['dim']} {cfg['dtype']}; "
                 f"{plot.measured_on(payload['info'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def write_outputs(json_path, payload):
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    return figure(payload, os.path.splitext(json_path)[0] + ".png")


def describe(record):
    head = f"S={record['seqlen']:>6} {record['case']:16s}"
    if record.get("status") != "ok":
        return f"{head} {record.get('status')}"
    parts = []
    for mode in ("fwd", "fwd_bwd"):
        r = record[mode]
        peak = _peak(record, mode)
        parts.append(f"{mode} {r['median_ms']:.3f} ms {r['tflops']:.3g} TF/s"
                     + (f" peak {_gib(peak):.2f} GiB" if peak else ""))
    if "max_abs_diff_vs_segment_ids" in record:
        parts.append(f"|mask - segment_ids| {record['max_abs_diff_vs_segment_ids']:.2e}")
    return head + " " + " | ".join(parts)


def run_workers(cfg, todo, payload, json_path, timeout_s):
    """Runs `todo` [(seqlen, case)] in worker processes, restarting after a crash; fills payload."""
    by_key = {}
    remaining = list(todo)
    want_info = True
    while remaining:
        with tempfile.TemporaryDirectory() as tmp:
            task_path = os.path.join(tmp, "task.json")
            with open(task_path, "w") as f:
                json.dump({"cfg": cfg, "todo": remaining, "want_info": want_info}, f)
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", task_path], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            started, seen, output = None, 0, ""
            deadline = time.perf_counter() + timeout_s
            while True:
                try:
                    output, _ = proc.communicate(timeout=2)
                    finished = True
                except subprocess.TimeoutExpired:
                    finished = False
                lines = []
                if os.path.exists(task_path + ".results"):
                    with open(task_path + ".results") as f:
                        lines = [line for line in f.readlines() if line.endswith("\n")]
                for line in lines[seen:]:
                    rec = json.loads(line)
                    if "info" in rec:
                        payload["info"] = rec["info"]
                        want_info = False
                    elif "start" in rec:
                        started = tuple(rec["start"])
                    else:
                        record = rec["record"]
                        by_key[(record["seqlen"], record["case"])] = record
                        started = None
                        print(describe(record), flush=True)
                seen = len(lines)
                payload["records"] = [by_key[k] for k in todo if k in by_key]
                if payload.get("info") and lines:
                    write_outputs(json_path, payload)
                if finished:
                    break
                if time.perf_counter() > deadline:
                    proc.kill()
                    output, _ = proc.communicate()
                    output = (output or "") + f"\nworker stopped after {timeout_s:.0f} s"
                    break
        remaining = [k for k in remaining if k not in by_key]
        if remaining:
            lines = (output or "").strip().splitlines() or [""]
            for words in (("Check failed", "Abort", "Killed", "Segmentation", "out of memory", "stopped after",
                           "no GPU", "without CUDA"), ("Error", "error")):
                telling = [l for l in lines if any(w in l for w in words) and "cuInit" not in l]
                if telling:
                    break
            code = proc.returncode
            if code is not None and code < 0:
                import signal
                code = f"{code}, {signal.Signals(-code).name}"
            why = f"worker died (exit {code})" + (f": {telling[-1][:300]}" if telling else "")
            if started is None and not by_key:  # it failed before any case: nothing will run
                print(output[-3000:] if output else "", file=sys.stderr)
                raise SystemExit(why)
            victim = started if started is not None else remaining[0]
            by_key[victim] = {"seqlen": victim[0], "case": victim[1], "causal": case_causal(victim[1]),
                              "status": why, "crashed": True}
            print(describe(by_key[victim]), flush=True)
            remaining = [k for k in remaining if k != victim]
            payload["records"] = [by_key[k] for k in todo if k in by_key]
            if payload.get("info"):
                write_outputs(json_path, payload)
    return payload


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke run: S 1k and 2k, 2 heads, d64, float32, mean document 128 tokens, 3 repeats")
    p.add_argument("--seqlens", default="16384,65536,131072", help="tokens per row, comma-separated")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default --heads")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", default=None, help="TF device (default GPU:0; CPU:0 with --quick)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--mean-doc-len", type=int, default=655, help="mean document length (16384 / 25)")
    p.add_argument("--seed", type=int, default=2, help="numpy seed of the document lengths (row b: seed + b)")
    p.add_argument("--max-mask-gb", type=float, default=20.0,
                   help="skip the dense-mask case where its bool [B, 1, S, S] passes this many GB (1e9 bytes)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15, help="timed samples per case and mode")
    p.add_argument("--calls-per-function", type=int, default=1,
                   help="attentions chained in each timed tf.function (bench_gpu.py's flag; times are per attention)")
    p.add_argument("--time-limit", type=float, default=180, help="seconds: start no case after this")
    p.add_argument("--out-dir", default=None, help="default results/ (results/quick/ with --quick, git-ignored)")
    p.add_argument("--tag", default=None, help="result file stem (default gpu_segments; cpu_segments on a CPU)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    explicit = {a.split("=")[0][2:].replace("-", "_") for a in (argv if argv is not None else sys.argv[1:])
                if a.startswith("--")}
    if args.quick:  # the quick defaults, under any flag given explicitly
        for key, value in QUICK.items():
            if key not in explicit:
                setattr(args, key, ",".join(map(str, value)) if key == "seqlens" else value)
    args.device = args.device or "GPU:0"
    args.kv_heads = args.kv_heads or args.heads
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}: choose from {CASES}")
    gpu = args.device.upper().startswith("GPU")
    cfg = {"seqlens": [int(s) for s in args.seqlens.split(",")], "cases": cases, "batch": args.batch,
           "heads": args.heads, "kv_heads": args.kv_heads, "dim": args.dim, "dtype": DTYPES[args.dtype],
           "device": args.device, "mean_doc_len": args.mean_doc_len, "doc_sigma": DOC_SIGMA, "seed": args.seed,
           "max_mask_gb": args.max_mask_gb, "warmup": args.warmup, "repeats": args.repeats,
           "calls_per_function": args.calls_per_function, "time_limit_s": args.time_limit,
           "deadline": time.time() + args.time_limit if args.time_limit else 0}
    stem = args.tag or ("gpu_segments" if gpu else "cpu_segments")
    json_path = os.path.join(common.output_dir(args.out_dir, args.quick), stem + ".json")
    documents = {}
    for s in cfg["seqlens"]:
        rows = batch_lengths(cfg, s)
        documents[str(s)] = {"count": [len(r) for r in rows], "mean": float(np.mean([n for r in rows for n in r])),
                             "min": min(min(r) for r in rows), "max": max(max(r) for r in rows), "lengths": rows}
        print(f"S={s}: {documents[str(s)]['count']} documents per row, lengths {documents[str(s)]['min']}.."
              f"{documents[str(s)]['max']}, mean {documents[str(s)]['mean']:.0f}", flush=True)
    payload = {"benchmark": "segments", "command": common.command_line(),
               "config": {k: v for k, v in cfg.items() if k != "deadline"}, "info": None, "documents": documents,
               "records": []}
    todo = [(s, c) for s in cfg["seqlens"] for c in cases]
    run_workers(cfg, todo, payload, json_path, timeout_s=(args.time_limit or 1800) + 300)
    payload["records"] = payload["records"] or []
    png = write_outputs(json_path, payload)
    print("\n" + table(payload) + "\n")
    print(f"wrote {json_path}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
