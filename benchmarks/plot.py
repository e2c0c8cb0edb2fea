#!/usr/bin/env python
"""Figures and tables of the benchmarks' result files.

Every benchmark writes one result file, results/<name>.json (replaced when rerun), with the machine,
the versions, the git commit and the date inside, and its figure beside it, results/<name>.png, through
save(). This script re-renders the figure of result files and prints their markdown tables (what
docs/performance.md shows):

    python benchmarks/plot.py benchmarks/results/*.json             # re-render each .png beside its .json
    python benchmarks/plot.py --tables benchmarks/results/model.json  # and print its tables

It needs matplotlib (the [examples] extra) for the figures, nothing else: no TensorFlow.
"""
import argparse
import json
import os

GPU_LABELS = {
    "tf_flash": "tf_flash",
    "torch_cudnn": "cuDNN (torch SDPA)",
    "torch_flash": "FlashAttention-2 (torch SDPA)",
    "tf_standard": "TF attention (einsum, softmax, einsum)",
    "tf_standard_xla": "TF attention + XLA",
    "keras_mha": "keras.ops.dot_product_attention",
    "torch_sdpa": "torch SDPA (CPU flash kernel)",
}
MODEL_LABELS = {
    "keras_mha_xla": "Keras MultiHeadAttention + XLA",
    "keras_mha": "Keras MultiHeadAttention, no XLA",
    "flash_mha_xla": "FlashMultiHeadAttention + XLA",
    "flash_mha_auto": "FlashMultiHeadAttention, compile() defaults",
    "flash_mha_noxla": "FlashMultiHeadAttention, no XLA",
    "keras_flash_switch": "Keras MultiHeadAttention through tf_flash.keras",
}
MODEL_BASELINE = "keras_mha_xla"
COLORS = {"tf_flash": "C3", "torch_cudnn": "C0", "torch_flash": "C2", "tf_standard": "C7", "tf_standard_xla": "C1",
          "keras_mha": "C4", "torch_sdpa": "C0", "keras_mha_xla": "C0", "flash_mha_xla": "C3"}
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn"}
MODES = {"fwd": "forward", "fwd_bwd": "forward + backward"}


# ---------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------

def load(path):
    with open(path) as f:
        return json.load(f)


def save(payload, json_path):
    """Writes payload to json_path and its figure beside it (same stem, .png). Returns the figure's path, or
    None where matplotlib is missing or nothing has been measured yet."""
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    return render(payload, os.path.splitext(json_path)[0] + ".png")


def render(payload, png_path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = FIGURES[payload["benchmark"]](plt, payload)
    if fig is None:
        return None
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def tables(payload):
    """The result's markdown tables, headed by one line naming the device, the versions and the date."""
    return machine_line(payload["info"]) + "\n\n" + TABLES[payload["benchmark"]](payload)


# ---------------------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------------------

def device_name(info):
    if info.get("gpus"):
        return info["gpus"][0].split(",")[0].strip()
    return info.get("device_name") or f"{info.get('cpu', 'CPU')}, {info.get('cpu_count', '?')} cores"


def measured_on(info):
    """"NVIDIA H100 80GB HBM3, 2026-11-26": the device and the date of the measurement (the first, when merged)."""
    dates = info.get("dates") or [info.get("date_utc", "")]
    return f"{device_name(info)}, {min(d[:10] for d in dates if d) if any(dates) else 'undated'}"


def machine_line(info):
    parts = [f"Measured on {measured_on(info)}"]
    if info.get("gpus"):
        parts.append("driver " + info["gpus"][0].split(",")[-1].strip())
    build = info.get("tf_flash_build") or {}
    for key, name in (("tensorflow", "TensorFlow"), ("keras", "Keras"), ("tf_flash", "tf_flash")):
        if info.get(key):
            parts.append(f"{name} {info[key]}")
    if build.get("cuda_version"):
        parts.append(f"tf_flash built with CUDA {build['cuda_version']}")
    if info.get("tf_cuda"):
        parts.append(f"TensorFlow's CUDA {info['tf_cuda']}")
    if info.get("torch"):
        parts.append(f"torch {info['torch']}")
    if info.get("git_commit"):
        parts.append(f"commit {info['git_commit']}")
    return "; ".join(parts) + "."


def markdown_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value, digits=1):
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:.{digits}f}"


def ratio(a, b, digits=2):
    return fmt(a / b if a and b else None, digits)


def seqlen_label(s):
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def seqlen_axis(ax, seqlens, label="sequence length (tokens)"):
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqlens)
    ax.set_xticklabels([seqlen_label(s) for s in seqlens])
    ax.minorticks_off()
    ax.set_xlabel(label)
    ax.grid(True, alpha=0.3)


def log_axis(ax):
    """A log y axis labelled in plain numbers: 10, 20, 30, 50, 100, ..."""
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "235" else ""))


def _line(ax, points, **style):
    points = sorted(p for p in points if p[1] is not None)
    if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=4, **style)


def _bars(ax, labels, series, ylabel, xlabel=None):
    """Grouped bars: one group per label, one bar per (name, values) of series."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series):
        ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))], values, width=width, label=name)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)


# ---------------------------------------------------------------------------------------------------------
# GPU kernels (bench_gpu.py): TFLOP/s against sequence length
# ---------------------------------------------------------------------------------------------------------

def _gpu_parts(payload):
    entries = payload["entries"]
    speed = [e for e in entries if e["kind"] == "speed" and "extras" not in e]
    order = list(GPU_LABELS)
    impls = sorted({e["impl"] for e in entries if "extras" not in e},
                   key=lambda i: (order.index(i) if i in order else len(order), i))
    return speed, impls


def _gpu_value(entry, mode, key="tflops"):
    return (entry["result"].get(mode) or {}).get(key) if entry else None


def _gpu_cell(entry, mode):
    """TFLOP/s, or why there is none: OOM, crash, skipped (--time-limit), error."""
    if entry is None:
        return "-"
    value = _gpu_value(entry, mode)
    if value is not None:
        return fmt(value, 0)
    result = entry["result"]
    if result.get("crashed"):
        return "crash"
    error = (result.get(mode) or {}).get("error") or result.get("error") or "-"
    return error if error in ("OOM", "-") else error.split(":")[0] if error.startswith("skipped") else "error"


def _gpu_find(speed, impl, dim, causal, seqlen):
    for e in speed:
        if (e["impl"], e["dim"], e["causal"], e["seqlen"]) == (impl, dim, causal, seqlen):
            return e
    return None


def _gpu_title(payload):
    args = payload.get("args", {})
    dtypes = sorted({e["dtype"] for e in payload["entries"]})
    calls = args.get("calls_per_function", 1)
    return (f"Attention TFLOP/s, {', '.join(DTYPE_NAMES.get(d, d) for d in dtypes)}, hidden "
            f"{args.get('hidden', 2048)} (heads = hidden / d), batch x length = 16k tokens - "
            f"{measured_on(payload['info'])}\n"
            + (f"TensorFlow rows: {calls} attentions per tf.function call, per attention; " if calls > 1 else
               "one attention per tf.function call; ")
            + ("torch rows: one call each, in the same run" if any(e.get("impl", "").startswith("torch")
                                                                  for e in payload["entries"]) else "no torch rows"))


def _gpu_figure(plt, payload):
    speed, impls = _gpu_parts(payload)
    memory = [e for e in payload["entries"] if e["kind"] == "memory" and "peak_mb" in e["result"]]
    if not any(_gpu_value(e, m) for e in speed for m in MODES) and not memory:
        return None
    dims = sorted({e["dim"] for e in speed})
    seqlens = sorted({e["seqlen"] for e in speed})
    # The modes measured (an fp8 run has no backward): a column pair each.
    modes = [mode for mode in MODES if any(_gpu_value(e, mode) for e in speed)] or list(MODES)
    cols = [(mode, causal) for mode in modes for causal in (False, True)]
    rows = len(dims) + (1 if memory else 0)
    fig, axes = plt.subplots(rows, len(cols), figsize=(max(4 * len(cols), 12), 3.4 * rows + 1.2), squeeze=False)
    for r, dim in enumerate(dims):
        for c, (mode, causal) in enumerate(cols):
            ax = axes[r][c]
            for impl in impls:
                points = [(s, _gpu_value(_gpu_find(speed, impl, dim, causal, s), mode)) for s in seqlens]
                _line(ax, points, label=GPU_LABELS.get(impl, impl), color=COLORS.get(impl),
                      linewidth=2.4 if impl == "tf_flash" else 1.5)
            ax.set_title(f"head dim {dim}, {MODES[mode]}{', causal' if causal else ''}", fontsize=10)
            seqlen_axis(ax, seqlens, "sequence length (tokens)" if r == len(dims) - 1 else "")
            ax.set_ylim(bottom=0)
            if c == 0:
                ax.set_ylabel("TFLOP/s")
    if memory:
        for ax in axes[-1][1:]:
            ax.axis("off")
        ax = axes[-1][0]
        for mem_set in sorted({e["mem_set"] for e in memory}):
            for impl in impls:
                points = [(e["seqlen"], e["result"]["peak_mb"] / 1024) for e in memory
                          if e["impl"] == impl and e["mem_set"] == mem_set]
                _line(ax, points, label=f"{GPU_LABELS.get(impl, impl)}, {mem_set}", color=COLORS.get(impl),
                      linestyle="-" if mem_set == "b1 h16 d128" else "--")
        seqlen_axis(ax, sorted({e["seqlen"] for e in memory}))
        log_axis(ax)
        ax.set_ylabel("peak memory, forward + backward (GiB)")
        ax.set_title("memory", fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=10, frameon=False)
    fig.suptitle(_gpu_title(payload), fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def _gpu_tables(payload):
    speed, impls = _gpu_parts(payload)
    args = payload.get("args", {})
    seqlens = sorted({e["seqlen"] for e in speed})
    out = []
    if speed:
        calls = args.get("calls_per_function", 1)
        out.append("TFLOP/s forward / forward+backward (fwd = 4 b s^2 h d, halved when causal; fwd+bwd = 3.5 fwd)"
                   + (f"; TensorFlow rows {calls} attentions per tf.function call" if calls > 1 else "") + ".")
        peers = [i for i in ("torch_cudnn", "torch_flash") if i in impls]
        for dtype in sorted({e["dtype"] for e in speed}):
            for dim in sorted({e["dim"] for e in speed}):
                rows = []
                for causal in (False, True):
                    tag = " causal" if causal else ""
                    for impl in impls:
                        cells = [" / ".join(_gpu_cell(_gpu_find(speed, impl, dim, causal, s), m) for m in MODES)
                                 for s in seqlens]
                        rows.append([f"{GPU_LABELS.get(impl, impl)}{tag}"] + cells)
                    for peer in peers:
                        cells = []
                        for s in seqlens:
                            ours, theirs = (_gpu_find(speed, i, dim, causal, s) for i in ("tf_flash", peer))
                            cells.append(" / ".join(ratio(_gpu_value(ours, m), _gpu_value(theirs, m)) for m in MODES))
                        rows.append([f"tf_flash / {GPU_LABELS[peer].split(' (')[0]}{tag}"] + cells)
                out += ["", f"{DTYPE_NAMES.get(dtype, dtype)}, head dim {dim}:", "",
                        markdown_table([""] + [seqlen_label(s) for s in seqlens], rows)]
    memory = [e for e in payload["entries"] if e["kind"] == "memory"]
    if memory:
        rows = []
        for mem_set in sorted({e["mem_set"] for e in memory}):
            for s in sorted({e["seqlen"] for e in memory if e["mem_set"] == mem_set}):
                cells = []
                for impl in impls:
                    r = next((e["result"] for e in memory if (e["impl"], e["mem_set"], e["seqlen"]) ==
                              (impl, mem_set, s)), {})
                    cells.append(fmt(r["peak_mb"], 0) if "peak_mb" in r else r.get("error", "-")[:30])
                rows.append([mem_set, s] + cells)
        out += ["", "Peak memory of one forward + backward, MB (inputs and gradients included):", "",
                markdown_table(["shape", "s"] + [GPU_LABELS.get(i, i) for i in impls], rows)]
    extras = [e for e in payload["entries"] if "extras" in e]
    if extras:
        rows = []
        for group in ("sparse", "dropout"):
            members = [e for e in extras if e["extras"] == group]
            for e in members:
                row = [e["pattern"]]
                for mode in MODES:
                    t, t0 = _gpu_value(e, mode, "median_s"), _gpu_value(members[0], mode, "median_s")
                    row += [fmt(t and t * 1e3, 3), ratio(t0, t)]
                rows.append(row)
        e0 = extras[0]
        out += ["", f"tf_flash with block masks and dropout ({e0['dtype']} b{e0['batch']} s{e0['seqlen']} "
                    f"h{e0['heads']} d{e0['dim']}, block {args.get('block_size', 128)}; speedup against the first "
                    "row of its group):", "",
                markdown_table(["pattern", "fwd ms", "fwd speedup", "fwd+bwd ms", "fwd+bwd speedup"], rows)]
    return "\n".join(out).strip() + "\n"


# ---------------------------------------------------------------------------------------------------------
# Keras training step (bench_model.py): time and peak memory against tokens
# ---------------------------------------------------------------------------------------------------------

def combine_repeats(records):
    """One record per (mode, length): with --repeats, the run whose median is the median of the runs'
    medians (the lower middle for an even count), with every run's median in run_medians_ms; a failed
    run is reported only when no run of that (mode, length) succeeded."""
    groups = {}
    for r in records:
        groups.setdefault((r["mode"], r["seq_len"]), []).append(r)
    combined = []
    for runs in groups.values():
        ok = sorted((r for r in runs if r["status"] == "ok"), key=lambda r: r["median_ms"])
        if not ok:
            combined.append(runs[-1])
        elif len(runs) == 1:
            combined.append(ok[0])
        else:
            combined.append(dict(ok[(len(ok) - 1) // 2], run_medians_ms=[r["median_ms"] for r in ok],
                                 failed_runs=len(runs) - len(ok)))
    return combined


def _model_label(mode):
    base, _, family = mode.partition("@")
    return MODEL_LABELS.get(base, base) + (f" ({family} kernels)" if family else "")


def _model_what(cfg):
    return (f"{cfg['blocks']}-block encoder (width {cfg['width']}, {cfg['heads']} heads of "
            f"{cfg['width'] // cfg['heads']}), {cfg['dtype']}, {cfg['tokens_per_batch']:,} tokens per batch"
            + (f", documents of {cfg['doc_tokens']} tokens" if cfg.get("doc_tokens") else ""))


def _model_figure(plt, payload):
    cfg, records = payload["config"], combine_repeats(payload["results"])
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return None
    lengths = sorted({r["seq_len"] for r in records})
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5))
    by_key = {(r["mode"], r["seq_len"]): r for r in records}
    for mode in payload["modes"]:
        style = dict(label=_model_label(mode), color=COLORS.get(mode), linewidth=2.4 if "flash" in mode else 1.5)
        _line(ax_t, [(r["seq_len"], r["median_ms"]) for r in ok if r["mode"] == mode], **style)
        _line(ax_m, [(r["seq_len"], r["peak_bytes"] / 2**30) for r in ok if r["mode"] == mode], **style)
        for r in records:
            if r["mode"] == mode and r["status"] == "oom":
                for ax in (ax_t, ax_m):  # an x at the top of the axis, named from the empty upper left
                    ax.plot([r["seq_len"]], [0.97], marker="x", markersize=9, color=COLORS.get(mode),
                            transform=ax.get_xaxis_transform(), clip_on=False)
                    ax.annotate(f"{_model_label(mode)}:\nout of memory at {seqlen_label(r['seq_len'])}",
                                (r["seq_len"], 0.97), xycoords=("data", "axes fraction"), xytext=(0.04, 0.9),
                                textcoords="axes fraction", ha="left", va="top", fontsize=8, color=COLORS.get(mode),
                                arrowprops={"arrowstyle": "->", "color": COLORS.get(mode), "lw": 0.8})
        base = [r for r in ok if r["mode"] == MODEL_BASELINE]
        if mode != MODEL_BASELINE and base:
            for r in ok:
                b = by_key.get((MODEL_BASELINE, r["seq_len"]))
                if r["mode"] == mode and b and b["status"] == "ok":
                    ax_t.annotate(f"{b['median_ms'] / r['median_ms']:.2f}x", (r["seq_len"], r["median_ms"]),
                                  textcoords="offset points", xytext=(0, 7), ha="center", fontsize=9,
                                  color=COLORS.get(mode))
    for ax in (ax_t, ax_m):
        seqlen_axis(ax, lengths, f"tokens per sequence (batch = {cfg['tokens_per_batch']:,} / tokens)")
        log_axis(ax)
    ax_t.set_ylabel("ms per training step (median)")
    ax_t.set_title("time per training step (speedup against Keras + XLA)", fontsize=10)
    ax_m.set_ylabel("peak GPU memory (GiB)" if payload["info"].get("device") == "GPU" else "peak RSS (GiB)")
    ax_m.set_title("peak memory of the training steps", fontsize=10)
    ax_t.legend(fontsize=9, loc="center left")
    fig.suptitle(f"Keras training step: {_model_what(cfg)} - {measured_on(payload['info'])}", fontsize=11)
    fig.tight_layout()
    return fig


def _model_cell(rec, base):
    if rec is None:
        return "-"
    if rec["status"] != "ok":
        return "out of memory" if rec["status"] == "oom" else rec["status"]
    text = f"{rec['median_ms']:.1f} ms"
    if base is not None and base is not rec and base.get("status") == "ok":
        text += f" ({base['median_ms'] / rec['median_ms']:.2f}x)"
    if not rec.get("xla_used") and rec["jit_compile"] in (True, "auto"):  # asked for, or Keras' default, not had
        text += " [no XLA]"
    return text


def _model_tables(payload):
    cfg, records, modes = payload["config"], combine_repeats(payload["results"]), payload["modes"]
    by_key = {(r["mode"], r["seq_len"]): r for r in records}
    lengths = sorted({r["seq_len"] for r in records})
    gib = lambda r: fmt(r["peak_bytes"] / 2**30, 2) if r and r.get("peak_bytes") else "-"  # noqa: E731
    rows = []
    for s in lengths:
        batch = max(1, cfg["tokens_per_batch"] // s)
        base = by_key.get((MODEL_BASELINE, s))
        rows.append([f"{s} x {batch}"] + [_model_cell(by_key.get((m, s)), base) for m in modes]
                    + [" / ".join(gib(by_key.get((m, s))) for m in modes)])
    out = [f"{_model_what(cfg)}; median ms per training step (speedup against {MODEL_BASELINE}), peak memory:", "",
           markdown_table(["tokens x batch"] + [_model_label(m) for m in modes]
                          + ["peak memory " + " / ".join(m for m in modes) + " (GiB)"], rows)]
    rows = []
    for m in modes:
        for s in lengths:
            r = by_key.get((m, s))
            if r is None:
                continue
            ok = r["status"] == "ok"
            row = [m, f"{s} x {r.get('batch') or '-'}", "ok" if ok else r.get("detail", r["status"])[:120],
                   fmt(r.get("median_ms"), 2), f"{r['p10_ms']:.2f}-{r['p90_ms']:.2f}" if ok else "-",
                   f"{r['tokens_per_s']:.0f}" if ok else "-", ("yes" if r["xla_used"] else "no") if ok else "-",
                   ("yes" if r["flash_op_in_graph"] else "no") if ok else "-", fmt(r.get("first_step_s"), 1)]
            if "run_medians_ms" in r:
                row.append(" ".join(f"{ms:.2f}" for ms in r["run_medians_ms"])
                           + (f" ({r['failed_runs']} failed)" if r.get("failed_runs") else ""))
            rows.append(row)
    headers = ["mode", "tokens x batch", "status", "ms/step", "p10-p90 ms", "tokens/s", "XLA", "flash op",
               "first step s"] + (["ms/step of each run"] if any("run_medians_ms" in r for r in records) else [])
    out += ["", "Detail:", "", markdown_table(headers, [r + [""] * (len(headers) - len(r)) for r in rows])]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------------------
# CPU (bench_cpu.py): GFLOP/s against sequence length beside TF's attention and matmul rate
# ---------------------------------------------------------------------------------------------------------

def _cpu_get(entry, mode, key):
    r = entry["result"] if entry else {}
    return r[mode][key] if r.get("ok") and mode in r else None


def _cpu_main(payload):
    return [e for e in payload["entries"] if e["section"] == "main"]


def _cpu_find(main, impl, causal, s):
    return next((e for e in main if (e["impl"], e["causal"], e["seqlen"]) == (impl, causal, s)), None)


def _cpu_matmul(payload):
    rates = [e["result"]["gflops"] for e in payload["entries"] if e["section"] == "matmul" and e["result"].get("ok")]
    return max(rates) if rates else None


def _cpu_shape(payload):
    shape = payload.get("shape", {"batch": 1, "heads": 8, "dim": 64})
    return f"float32, b{shape['batch']} h{shape['heads']} d{shape['dim']}"


def _cpu_figure(plt, payload):
    main = _cpu_main(payload)
    if not any(_cpu_get(e, "fwd", "gflops") for e in main):
        return None
    impls = list(dict.fromkeys(e["impl"] for e in main))
    seqlens = sorted({e["seqlen"] for e in main})
    matmul = _cpu_matmul(payload)
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    for r, mode in enumerate(MODES):
        for c, causal in enumerate((False, True)):
            ax = axes[r][c]
            for impl in impls:
                points = [(s, _cpu_get(_cpu_find(main, impl, causal, s), mode, "gflops")) for s in seqlens]
                _line(ax, points, label=GPU_LABELS.get(impl, impl), color=COLORS.get(impl),
                      linewidth=2.4 if impl == "tf_flash" else 1.5)
            if matmul:
                ax.axhline(matmul, color="k", linestyle=":", linewidth=1, label="TF float32 matmul, 2048^3")
            ax.set_title(f"{MODES[mode]}{', causal' if causal else ''}", fontsize=10)
            seqlen_axis(ax, seqlens)
            ax.set_ylim(bottom=0)
            ax.set_ylabel("GFLOP/s")
    ax = axes[0][2]
    for impl in impls:
        points = [(s, _cpu_get(_cpu_find(main, impl, False, s), "fwd_bwd", "peak_rss_mb")) for s in seqlens]
        _line(ax, [(s, v / 1024 if v else None) for s, v in points], label=GPU_LABELS.get(impl, impl),
              color=COLORS.get(impl))
    seqlen_axis(ax, seqlens)
    log_axis(ax)
    ax.set_ylabel("peak RSS, framework included (GiB)")
    ax.set_title("memory, forward + backward", fontsize=10)
    ax = axes[1][2]
    sparse = [e for e in payload["entries"] if e["section"] == "sparse"]
    base = next((e for e in sparse if e["pattern"] == "dense mask"), None)
    if sparse and base:
        patterns = [e for e in sparse if e["pattern"] != "none"]
        series = []
        for mode in MODES:
            t0 = _cpu_get(base, mode, "median_s")
            series.append((MODES[mode], [t0 / t if t0 and t else 0
                                         for t in (_cpu_get(e, mode, "median_s") for e in patterns)]))
        _bars(ax, [e["pattern"] for e in patterns], series, "speedup against an all-True block mask")
        ax.tick_params(axis="x", labelrotation=30)
        ax.set_title(f"block-sparse, s={base['seqlen']}, block {payload.get('args', {}).get('block_size', 128)}",
                     fontsize=10)
    else:
        ax.axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=10, frameon=False)
    fig.suptitle(f"CPU attention, {_cpu_shape(payload)} - {measured_on(payload['info'])}", fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def _cpu_tables(payload):
    main = _cpu_main(payload)
    matmul = _cpu_matmul(payload)
    impls = list(dict.fromkeys(e["impl"] for e in main))
    seqlens = sorted({e["seqlen"] for e in main})
    rates = [e["result"]["gflops"] for e in payload["entries"] if e["section"] == "matmul" and e["result"].get("ok")]
    out = [f"{_cpu_shape(payload)}; GFLOP/s forward / forward+backward (fwd = 4 b s^2 h d, halved when causal; "
           "fwd+bwd = 3.5 fwd). TF's float32 matmul (2048^3) in the same run: "
           + (", ".join(f"{r:.0f}" for r in rates) or "-") + " GFLOP/s.", ""]
    torch_mm = [e["result"] for e in payload["entries"] if e["section"] == "torch_matmul" and e["result"].get("ok")]
    if torch_mm:
        out[-2] += f" torch's: {torch_mm[0]['gflops']:.0f}."
    rows = []
    for causal in (False, True):
        for impl in impls:
            cells = [" / ".join(fmt(_cpu_get(_cpu_find(main, impl, causal, s), m, "gflops"), 0) for m in MODES)
                     for s in seqlens]
            if any(c != "- / -" for c in cells):
                rows.append([GPU_LABELS.get(impl, impl) + (" causal" if causal else "")] + cells)
    out.append(markdown_table([""] + [seqlen_label(s) for s in seqlens], rows))
    rows = []
    for s in seqlens:
        flash = {c: _cpu_find(main, "tf_flash", c, s) for c in (False, True)}
        std = {c: _cpu_find(main, "tf_standard", c, s) for c in (False, True)}
        peer = {c: _cpu_find(main, "torch_sdpa", c, s) for c in (False, True)}
        rows.append([seqlen_label(s), ratio(_cpu_get(flash[False], "fwd", "gflops"), matmul),
                     ratio(_cpu_get(std[False], "fwd_bwd", "median_s"), _cpu_get(flash[False], "fwd_bwd", "median_s")),
                     ratio(_cpu_get(std[True], "fwd_bwd", "median_s"), _cpu_get(flash[True], "fwd_bwd", "median_s")),
                     ratio(_cpu_get(flash[False], "fwd_bwd", "median_s"), _cpu_get(flash[True], "fwd_bwd", "median_s")),
                     " / ".join(ratio(_cpu_get(peer[False], m, "median_s"), _cpu_get(flash[False], m, "median_s"))
                                for m in MODES),
                     fmt(_cpu_get(flash[False], "fwd_bwd", "peak_rss_mb"), 0),
                     fmt(_cpu_get(std[False], "fwd_bwd", "peak_rss_mb"), 0)])
    out += ["", "Ratios (time ratios: > 1 means tf_flash is faster) and peak RSS of forward + backward:", "",
            markdown_table(["s", "tf_flash fwd / matmul rate", "fwd+bwd vs TF attention",
                            "same, causal", "causal speedup (fwd+bwd)", "vs torch SDPA fwd / fwd+bwd",
                            "tf_flash peak MB", "TF attention peak MB"], rows)]
    sparse = [e for e in payload["entries"] if e["section"] == "sparse"]
    if sparse:
        base = next((e for e in sparse if e["pattern"] == "dense mask"), sparse[0])
        rows = [[e["pattern"]] + [x for m in MODES for x in (fmt(_cpu_get(e, m, "median_s") and
                                                                 _cpu_get(e, m, "median_s") * 1e3, 0),
                                                             ratio(_cpu_get(base, m, "median_s"),
                                                                   _cpu_get(e, m, "median_s")))] for e in sparse]
        out += ["", f"Block-sparse, s={sparse[0]['seqlen']}, non-causal (speedup against '{base['pattern']}'):", "",
                markdown_table(["block mask", "fwd ms", "fwd speedup", "fwd+bwd ms", "fwd+bwd speedup"], rows)]
    drop = [e for e in payload["entries"] if e["section"] == "dropout"]
    if drop:
        rows = []
        for s in sorted({e["seqlen"] for e in drop}):
            pair = {e["rate"]: e for e in drop if e["seqlen"] == s}
            row = [s]
            for m in MODES:
                t0, t1 = (_cpu_get(pair.get(p), m, "median_s") for p in (0.0, 0.1))
                row += [fmt(t0 and t0 * 1e3, 0), fmt(t1 and t1 * 1e3, 0), fmt(t0 and t1 and 100 * (t1 / t0 - 1), 0)]
            rows.append(row)
        out += ["", "Dropout p=0.1 against p=0, non-causal:", "",
                markdown_table(["s", "fwd ms p=0", "p=0.1", "overhead %", "fwd+bwd ms p=0", "p=0.1", "overhead %"],
                               rows)]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------------------
# Small shapes (bench_overhead.py) and the deterministic backward (bench_determinism.py)
# ---------------------------------------------------------------------------------------------------------

def _overhead_form(form, calls):
    names = {"floor": "empty tf.function", "fn_1": "one attention per tf.function",
             f"fn_{calls}": f"{calls} chained in one tf.function", f"xla_{calls}": f"{calls} chained, XLA",
             "eager": "eager call"}
    return names.get(form, form)


def _overhead_groups(payload):
    rows = payload["rows"]
    forms = list(dict.fromkeys(r["form"] for r in rows))
    keys = list(dict.fromkeys((r["batch"], r["seqlen"], r["causal"], r["backward"]) for r in rows))
    return rows, forms, keys


def _overhead_figure(plt, payload):
    rows, forms, keys = _overhead_groups(payload)
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(13, 5))
    series = [(_overhead_form(form, payload["calls"]),
               [next((r["ms"] for r in rows if r["form"] == form and (r["batch"], r["seqlen"], r["causal"],
                                                                      r["backward"]) == k), 0) for k in keys])
              for form in forms]
    _bars(ax, [f"{b} x {seqlen_label(s)}{' causal' if c else ''}\n{'fwd+bwd' if bw else 'fwd'}"
               for b, s, c, bw in keys], series, "ms per attention (median)", "batch x sequence length, pass")
    ax.set_title(f"One attention call and what surrounds it: {rows[0]['dtype']}, {payload['heads']} heads of "
                 f"{payload['dim']} - {measured_on(payload['info'])}", fontsize=11)
    fig.tight_layout()
    return fig


def _overhead_tables(payload):
    rows, forms, keys = _overhead_groups(payload)
    table = []
    for b, s, c, bw in keys:
        cells = []
        for form in forms:
            r = next((r for r in rows if r["form"] == form and (r["batch"], r["seqlen"], r["causal"], r["backward"])
                      == (b, s, c, bw)), None)
            if r is None:
                cells.append("")
            else:
                cells.append(f"{r['ms']:.3f}" + ("" if form == "floor" else f" ({r['tflops']:.0f})"))
        table.append([f"{b} x {s}{' causal' if c else ''}", "fwd+bwd" if bw else "fwd"] + cells)
    return ("ms per attention (TFLOP/s):\n\n"
            + markdown_table(["b x s", "pass"] + [_overhead_form(f, payload["calls"]) for f in forms], table) + "\n")


def _determinism_figure(plt, payload):
    rows = payload["rows"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(11, 4.5))
    _bars(ax, [f"b{r['batch']} s{seqlen_label(r['seqlen'])}{' causal' if r['causal'] else ''}" for r in rows],
          [("deterministic=False (dQ by atomics)", [r["atomics_ms"] for r in rows]),
           ("deterministic=True", [r["deterministic_ms"] for r in rows])], "ms per forward + backward (median)")
    for j, r in enumerate(rows):
        ax.annotate(f"{100 * (r['deterministic_ms'] / r['atomics_ms'] - 1):+.0f}%", (j + 0.2, r["deterministic_ms"]),
                    textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    r0 = rows[0]
    ax.set_title(f"Deterministic backward: bfloat16, {r0['heads']} heads of {r0['dim']}, dropout {r0['dropout']} - "
                 f"{measured_on(payload['info'])}", fontsize=11)
    fig.tight_layout()
    return fig


def _determinism_tables(payload):
    rows = [[f"b{r['batch']} s{r['seqlen']} h{r['heads']} d{r['dim']}{' causal' if r['causal'] else ''}",
             fmt(r["atomics_ms"], 2), fmt(r["deterministic_ms"], 2),
             f"{100 * (r['deterministic_ms'] / r['atomics_ms'] - 1):+.1f}%", "yes" if r["bit_identical"] else "NO",
             r["family"]] for r in payload["rows"]]
    return markdown_table(["shape", "atomics ms", "deterministic ms", "overhead", "bit-identical",
                           "backward family"], rows) + "\n"


# ---------------------------------------------------------------------------------------------------------
# The CPU kernel's instruction-set paths (bench_cpu.py --isa-compare): AVX-512 against AVX2 and TF's attention,
# and bfloat16 inputs on the AVX512_BF16 path (vdpbf16ps) against float32 on the AVX-512 path
# ---------------------------------------------------------------------------------------------------------

# (path forced by TF_FLASH_CPU_ISA, input dtype) of each tf_flash run; results without a dtype are float32.
ISA_RUNS = (("avx512", "float32"), ("avx2", "float32"), ("avx512_bf16", "bfloat16"), ("avx512", "bfloat16"),
            ("avx512_amx", "bfloat16"))


def _run_name(isa, dtype):
    return isa if dtype == "float32" else f"{isa} {dtype}"


def _isa_shapes(payload):
    keys = ("batch", "seqlen", "heads", "dim")
    return list(dict.fromkeys(tuple(e[k] for k in keys) for e in payload["entries"] if e["section"] == "isa"))


def _isa_find(payload, shape, impl, isa=None, dtype="float32"):
    for e in payload["entries"]:
        if (e["section"] == "isa" and e["impl"] == impl and e.get("isa") == isa
                and e.get("dtype", "float32") == dtype and e["result"].get("ok")
                and (e["batch"], e["seqlen"], e["heads"], e["dim"]) == shape):
            return e
    return None


def _isa_peaks(payload):
    """GFLOP/s peaks by path: avx2 / avx512 of float32 FMAs, avx512_bf16 of vdpbf16ps."""
    return {e["isa"]: e["result"]["gflops"] for e in payload["entries"]
            if e["section"] == "peak" and e["result"].get("ok")}


def _isa_label(shape):
    return "b{} s{} h{} d{}".format(*shape)


def _isa_runs_present(payload):
    return [(isa, dtype) for isa, dtype in ISA_RUNS
            if any(_isa_find(payload, shape, "tf_flash", isa, dtype) for shape in _isa_shapes(payload))]


def _cpu_isa_figure(plt, payload):
    shapes = _isa_shapes(payload)
    if not shapes:
        return None
    peaks = _isa_peaks(payload)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, mode in zip(axes, MODES):
        series = [(f"tf_flash {_run_name(isa, dtype)}" + (f" (peak {peaks[isa]:.0f})" if isa in peaks else ""),
                   [_cpu_get(_isa_find(payload, shape, "tf_flash", isa, dtype), mode, "gflops") or 0
                    for shape in shapes])
                  for isa, dtype in _isa_runs_present(payload)]
        for impl in ("tf_standard", "torch_sdpa"):
            if any(_isa_find(payload, shape, impl) for shape in shapes):
                series.append((GPU_LABELS[impl], [_cpu_get(_isa_find(payload, shape, impl), mode, "gflops") or 0
                                                  for shape in shapes]))
        _bars(ax, [_isa_label(shape) for shape in shapes], series, "GFLOP/s")
        ax.set_title(MODES[mode], fontsize=10)
    fig.suptitle(f"CPU kernel paths, all cores - {measured_on(payload['info'])}", fontsize=11)
    fig.tight_layout()
    return fig


def _cpu_isa_tables(payload):
    peaks = _isa_peaks(payload)
    rates = [e["result"]["gflops"] for e in payload["entries"] if e["section"] == "matmul" and e["result"].get("ok")]
    out = ["Peaks of all cores, measured: " + (", ".join(f"{k} {v:.0f}" for k, v in peaks.items()) or "-")
           + " GFLOP/s (avx2, avx512: float32 FMAs; avx512_bf16: vdpbf16ps); TF's float32 matmul (2048^3): "
           + (", ".join(f"{r:.0f}" for r in rates) or "-")
           + " GFLOP/s. ms (GFLOP/s, share of the path's peak); [ran X]: the process ran another path. "
           "bf16 / f32 (amx bf16 / f32): the float32 AVX-512 time over the bfloat16 AVX512_BF16 (AMX) time.", ""]
    runs = _isa_runs_present(payload)
    has_peer = any(_isa_find(payload, shape, "torch_sdpa") for shape in _isa_shapes(payload))
    rows = []
    for shape in _isa_shapes(payload):
        results = {(isa, dtype): _isa_find(payload, shape, "tf_flash", isa, dtype) for isa, dtype in runs}
        results = {key: e and e["result"] for key, e in results.items()}
        dense, peer = (_isa_find(payload, shape, impl) for impl in ("tf_standard", "torch_sdpa"))
        dense, peer = dense and dense["result"], peer and peer["result"]
        for mode in MODES:
            cells, ms = [], {}
            for (isa, dtype), r in results.items():
                if r and mode in r:
                    ms[(isa, dtype)] = r[mode]["median_s"] * 1e3
                    share = f", {100 * r[mode]['gflops'] / peaks[isa]:.0f}%" if peaks.get(isa) else ""
                    ran = "" if r.get("cpu_isa") == isa else f" [ran {r.get('cpu_isa')}]"
                    cells.append(f"{ms[(isa, dtype)]:.1f} ({r[mode]['gflops']:.0f}{share}){ran}")
                else:
                    cells.append("-")
            dense_ms = dense[mode]["median_s"] * 1e3 if dense and mode in dense else None
            f32, f32_avx2 = ms.get(("avx512", "float32")), ms.get(("avx2", "float32"))
            extra = [ratio(f32_avx2, f32)]
            if ("avx512_bf16", "bfloat16") in results:
                extra.append(ratio(f32, ms.get(("avx512_bf16", "bfloat16"))))
            if ("avx512_amx", "bfloat16") in results:
                extra.append(ratio(f32, ms.get(("avx512_amx", "bfloat16"))))
            row = [_isa_label(shape), mode, *cells, *extra, fmt(dense_ms), ratio(dense_ms, f32)]
            if has_peer:
                peer_ms = peer[mode]["median_s"] * 1e3 if peer and mode in peer else None
                row += [fmt(peer_ms), ratio(peer_ms, f32)]
            rows.append(row)
    headers = ["shape", "mode", *[f"{_run_name(isa, dtype)} ms" for isa, dtype in runs], "avx512 / avx2"]
    if ("avx512_bf16", "bfloat16") in runs:
        headers.append("bf16 / f32")
    if ("avx512_amx", "bfloat16") in runs:
        headers.append("amx bf16 / f32")
    headers += ["TF attention ms", "TF / avx512"] + (["torch SDPA ms", "torch / avx512"] if has_peer else [])
    return "\n".join(out) + markdown_table(headers, rows) + "\n"


FIGURES = {"gpu": _gpu_figure, "model": _model_figure, "cpu": _cpu_figure, "cpu_isa": _cpu_isa_figure,
           "overhead": _overhead_figure, "determinism": _determinism_figure}
TABLES = {"gpu": _gpu_tables, "model": _model_tables, "cpu": _cpu_tables, "cpu_isa": _cpu_isa_tables,
          "overhead": _overhead_tables, "determinism": _determinism_tables}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", metavar="JSON", help="result files (results/<benchmark>.json)")
    parser.add_argument("--tables", action="store_true", help="also print each result's markdown tables")
    args = parser.parse_args(argv)
    for path in args.results:
        payload = load(path)
        png = render(payload, os.path.splitext(path)[0] + ".png")
        print(f"{path}: " + (f"figure {png}" if png else "no figure (matplotlib missing, or nothing measured)"))
        if args.tables:
            print("\n" + tables(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
