#!/usr/bin/env python
"""Decoding (issue 44): attention of a few new tokens over a long KV cache, against the memory's speed.

Rows "B x Sq @ S" (default 8 x 1 @ 8k, 8 x 1 @ 32k, 1 x 1 @ 128k, 8 x 8 @ 32k): B cache entries of S keys,
Sq new tokens each; bfloat16, 32 query heads, 8 KV heads, head dim 128, inputs N(0, 1) in [B, S, H, D];
causal="bottom_right" (query i of entry b sees keys j <= kv_lengths[b] - Sq + i). Two fills of the cache:

  full     kv_lengths = S for every entry
  ragged   kv_lengths uniform in [S/2, S] (numpy default_rng(--seed + row index), the same for every impl)

Implementations, each on the same inputs:

  tf_flash          tf_flash.ops._flash_attention(q, k, v, kv_lengths=..., causal="bottom_right"): the decode
                    path where its shape picks it (split_kv=None: GQA heads packed, key tiles split; the JSON
                    records the plan, `splits`, null where the path is not taken and the call is the plain one)
  tf_flash_xla      the same under tf.function(jit_compile=True), as KerasHub's generate runs it: XLA fuses the
                    decode path's packing of the heads around the kernel's custom call
  tf_flash_unsplit  the same with split_kv=False: the kernel call the decode path replaces
  keras_switch_xla  what KerasHub's Llama runs in a decoding step with tf_flash.keras.enable(), under XLA: K and V
                    repeated to every query head (keras.ops.repeat), then keras.ops.dot_product_attention with
                    the cache mask (key j visible to query i of entry b where j <= kv_lengths[b] - Sq + i:
                    [B, 1, 1, S] for one new token): the switch's mask handling, its fill of rows that see no
                    key and the kernels, against tf_flash_xla's kv_lengths alone
  xla_dense         dense attention under XLA (tf.function(jit_compile=True)): einsum scores with the queries
                    reshaped to [B, Sq, Hkv, H / Hkv, D] (GQA without repeating K/V), mask by kv_lengths and
                    bottom-right causal, softmax in float32, einsum
  torch_sdpa        torch.nn.functional.scaled_dot_product_attention(enable_gqa=True; K/V repeated where this
                    torch lacks it), K/V in torch's [B, Hkv, S, D]; no mask for one full-cache token, else a bool
                    mask [B, 1, Sq, S] (bottom-right causal and the lengths)
  flash_attn        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=kv_lengths, causal=True)
                    where `flash_attn` imports (its own split-KV and GQA heuristics)

--dtype fp8: K, V and the query in float8_e4m3fn (an fp8 KV cache; descales of 1, bfloat16 output, each chained
output cast back to fp8), tf_flash's three calls only; K+V bytes count 1 byte per element.

The torch rows run in a separate process with TensorFlow's library and Python paths taken out of its
environment (on the lent machine TF's environment puts an older cuDNN than torch's on the library path), and
are recorded with their reason where torch or flash_attn does not import.

Timing as bench_gpu.py: each timed call is one tf.function of --calls-per-function (10) attentions chained
(each one's output the next one's query; torch: the same chain in eager mode), the first call (tracing,
XLA's compile) apart, --warmup calls, then --repeats samples of k back-to-back calls (k sized so a sample
lasts >= ~25 ms), each sample ending by fetching one element of the last result; the median per attention.
K+V TB/s = bytes of K and V a decode step must read (B * S * Hkv * D * 2 tensors * itemsize; ragged: the
valid keys only, sum(kv_lengths) * Hkv * D * 2 * itemsize) / that time; the same bytes for every impl, so
it reads as an inverse time against the memory's speed (an H100 80GB HBM3 reads about 3.35 TB/s).
Once per row and fill: the largest |tf_flash - X| of one call, X each of tf_flash_unsplit, xla_dense and
keras_switch_xla.

--time-limit (seconds, default 150) starts no case after it: the default GPU run ends within about 3
minutes on an H100. Output: results/<tag>.json (default gpu_decode) and .png (K+V TB/s per row and impl,
full and ragged), rewritten as cases finish; markdown tables on the terminal.

    python benchmarks/bench_decode.py                 # GPU: results/gpu_decode.json, .png
    python benchmarks/bench_decode.py --quick         # CPU smoke run: results/quick/cpu_decode.json (git-ignored)
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

TF_IMPLS = ["tf_flash", "tf_flash_xla", "keras_switch_xla", "tf_flash_unsplit", "xla_dense"]
TORCH_IMPLS = ["torch_sdpa", "flash_attn"]
IMPLS = TF_IMPLS + TORCH_IMPLS
FILLS = ["full", "ragged"]
LABELS = {"tf_flash": "tf_flash (decode path)", "tf_flash_xla": "tf_flash (decode path), XLA",
          "keras_switch_xla": "Keras switch (KerasHub's call), XLA", "tf_flash_unsplit": "tf_flash, split_kv=False",
          "xla_dense": "dense attention, XLA",
          "torch_sdpa": "torch SDPA", "flash_attn": "flash_attn_with_kvcache"}
COLORS = {"tf_flash": "C3", "tf_flash_xla": "C4", "keras_switch_xla": "C5", "tf_flash_unsplit": "C1",
          "xla_dense": "C7", "torch_sdpa": "C0", "flash_attn": "C2"}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "float32": "float32", "fp8": "float8_e4m3fn"}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
# float8_e4m3fn (an fp8 KV cache, descales of 1, bfloat16 output): tf_flash's own calls only; the others have no
# fp8 attention in TF.
FP8_IMPLS = ["tf_flash", "tf_flash_xla", "tf_flash_unsplit"]
DEFAULT_ROWS = "8x1@8k,8x1@32k,1x1@128k,8x8@32k"
HBM_TBPS = {"H100 80GB HBM3": 3.35, "H100 SXM": 3.35, "H200": 4.8}
QUICK = {"rows": "2x1@4k,1x1@8k,2x4@4k", "heads": 8, "kv_heads": 2, "dim": 64, "dtype": "float32",
         "device": "CPU:0", "warmup": 1, "repeats": 3}


# ---------------------------------------------------------------------------------------------------------
# Rows, lengths, bytes (no TensorFlow)
# ---------------------------------------------------------------------------------------------------------

def parse_rows(text):
    """"8x1@32k,1x1@128k" -> [{"batch": 8, "new": 1, "cache": 32768}, ...] (k = 1024)."""
    rows = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        shape, cache = part.split("@")
        batch, new = (int(x) for x in shape.split("x"))
        cache = int(cache[:-1]) * 1024 if cache.endswith("k") else int(cache)
        if batch < 1 or new < 1 or cache < new:
            raise ValueError(f"row {part!r}: need batch >= 1, 1 <= new tokens <= cache")
        rows.append({"batch": batch, "new": new, "cache": cache})
    return rows


def row_label(row):
    return f"{row['batch']} x {row['new']} @ {plot.seqlen_label(row['cache'])}"


def kv_lengths(row, fill, seed):
    """int32 [B]: the cache's fill per entry. full: S; ragged: uniform in [S/2, S] (at least the new tokens)."""
    if fill == "full":
        return np.full(row["batch"], row["cache"], np.int32)
    rng = np.random.default_rng(seed)
    low = max(row["cache"] // 2, row["new"])
    return rng.integers(low, row["cache"] + 1, size=row["batch"]).astype(np.int32)


def kv_bytes(lengths, kv_heads, dim, itemsize):
    """Bytes of K and V a decode step reads: every valid key's K and V row once."""
    return int(np.sum(np.asarray(lengths, np.int64))) * kv_heads * dim * 2 * itemsize


def bottom_right_visible(lengths, new, cache):
    """bool [B, Sq, S]: query i of entry b sees key j <= lengths[b] - Sq + i (and so j < lengths[b])."""
    lengths = np.asarray(lengths, np.int64)
    rows = lengths[:, None, None] - new + np.arange(new)[None, :, None]
    return np.arange(cache)[None, None, :] <= rows


# ---------------------------------------------------------------------------------------------------------
# The TensorFlow side
# ---------------------------------------------------------------------------------------------------------

def visible_keys(lengths, new, cache):
    """bool [B, Sq, S] in TF: bottom_right_visible of a lengths tensor."""
    import tensorflow as tf
    last = tf.cast(lengths, tf.int32)[:, None, None] - new + tf.range(new)[None, :, None]  # [B, Sq, 1]
    return tf.range(cache)[None, None, :] <= last


def dense_attention(q, k, v, lengths):
    """Dense GQA attention, bottom-right causal within kv_lengths: q [B, Sq, H, D], k/v [B, S, Hkv, D], lengths
    int32 [B]. Scores in the inputs' dtype (einsum), softmax in float32; query head h reads KV head h // group."""
    import tensorflow as tf
    batch, new, heads, dim = q.shape
    cache, heads_kv = k.shape[1], k.shape[2]
    group = heads // heads_kv
    qg = tf.reshape(q, [batch, new, heads_kv, group, dim])
    scores = tf.cast(tf.einsum("bqhgd,bkhd->bhgqk", qg, k), tf.float32) * (1.0 / float(dim) ** 0.5)
    visible = visible_keys(lengths, new, cache)
    scores = tf.where(visible[:, None, None], scores, tf.constant(-1e30, tf.float32))
    probs = tf.cast(tf.nn.softmax(scores, axis=-1), q.dtype)
    out = tf.einsum("bhgqk,bkhd->bqhgd", probs, v)
    return tf.reshape(out, [batch, new, heads, v.shape[-1]])


def make_fn(impl, chain):
    """A tf.function(q, k, v, lengths) running `chain` attentions, each one's output the next one's query."""
    import tensorflow as tf
    from tf_flash import ops

    if impl in ("tf_flash", "tf_flash_xla"):  # the XLA one as KerasHub's generate runs it: the glue ops fused
        def attn(q, k, v, lengths):
            return ops._flash_attention(q, k, v, kv_lengths=lengths, causal="bottom_right")
    elif impl == "tf_flash_unsplit":
        def attn(q, k, v, lengths):
            return ops._flash_attention(q, k, v, kv_lengths=lengths, causal="bottom_right", split_kv=False)
    elif impl == "keras_switch_xla":
        import keras
        import tf_flash.keras
        tf_flash.keras.enable()  # read when the function is traced; the other impls call the op or TF directly

        def attn(q, k, v, lengths):
            group = q.shape[2] // k.shape[2]
            visible = visible_keys(lengths, q.shape[1], k.shape[1])
            return keras.ops.dot_product_attention(q, keras.ops.repeat(k, group, axis=2),
                                                   keras.ops.repeat(v, group, axis=2), mask=visible[:, None])
    elif impl == "xla_dense":
        attn = dense_attention
    else:
        raise ValueError(f"unknown impl {impl!r}")

    jit = impl in ("xla_dense", "tf_flash_xla", "keras_switch_xla")
    return tf.function(common.chained(attn, chain), jit_compile=jit)


def decode_plan(row, heads, kv_heads):
    """The key runs (the op's num_splits) tf_flash's decode path picks for the row (None: the plain kernel
    call), as ops.py asks."""
    from tf_flash import _decode
    return _decode.plan(row["batch"], row["new"], row["cache"], heads, kv_heads, plain=True,
                        causal_rows=row["new"] > 1)


def timed(cfg, row, fill, call, fetch):
    """The record of one (row, fill, impl): first call, then common.sample_calls, per attention, with K+V TB/s."""
    lengths = row["lengths"][fill]
    record = {"bytes": kv_bytes(lengths, cfg["kv_heads"], cfg["dim"], ITEMSIZE[cfg["dtype"]])}
    t0 = time.perf_counter()
    fetch(call())
    record["first_call_s"] = time.perf_counter() - t0
    stats = common.sample_calls(call, fetch, cfg["warmup"], cfg["repeats"])
    for key in ("median_s", "min_s", "max_s", "q1_s", "q3_s"):  # per attention
        stats[key] /= cfg["calls_per_function"]
    record.update(stats, median_us=1e6 * stats["median_s"], tbps=record["bytes"] / stats["median_s"] / 1e12,
                  status="ok")
    return record


class TFInputs:
    """q, k, v of one row (one seed per row), and its lengths per fill, on the device."""

    def __init__(self, tf, cfg, index, row):
        dtype = tf.as_dtype(cfg["dtype"])
        b, sq, s, h, hkv, d = row["batch"], row["new"], row["cache"], cfg["heads"], cfg["kv_heads"], cfg["dim"]
        with tf.device(cfg["device"]):
            self.q = tf.cast(tf.random.stateless_normal([b, sq, h, d], seed=[index, 0]), dtype)
            self.k = tf.cast(tf.random.stateless_normal([b, s, hkv, d], seed=[index, 1]), dtype)
            self.v = tf.cast(tf.random.stateless_normal([b, s, hkv, d], seed=[index, 2]), dtype)
            self.lengths = {f: tf.constant(row["lengths"][f], tf.int32) for f in FILLS}
        self.index = index


def run_tf_case(tf, cfg, inputs, row, fill, impl):
    args = (inputs.q, inputs.k, inputs.v, inputs.lengths[fill])
    if impl == "check":  # one call of each, unchained: tf_flash against the unsplit call and dense XLA
        outs = {}
        others = ["tf_flash_unsplit"] if cfg["dtype"] == "float8_e4m3fn" else ["tf_flash_unsplit", "xla_dense",
                                                                                 "keras_switch_xla"]
        with tf.device(cfg["device"]):
            for name in ["tf_flash"] + others:
                outs[name] = tf.cast(make_fn(name, 1)(*args), tf.float32)
            diff = {f"max_abs_diff_vs_{name}": float(tf.reduce_max(tf.abs(outs["tf_flash"] - outs[name])).numpy())
                    for name in others}
        return dict(diff, status="ok", max_abs_out=float(tf.reduce_max(tf.abs(outs["tf_flash"])).numpy()))
    fn = make_fn(impl, cfg["calls_per_function"])
    with tf.device(cfg["device"]):
        record = timed(cfg, row, fill, lambda: fn(*args), lambda r: r[0, 0, 0, 0].numpy())
    if impl in ("tf_flash", "tf_flash_xla"):
        record["splits"] = decode_plan(row, cfg["heads"], cfg["kv_heads"])
    return record


def tf_worker(task, emit):
    cfg = task["cfg"]
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
    for index, fill, impl in task["todo"]:
        key = [index, fill, impl]
        if cfg["deadline"] and time.time() > cfg["deadline"]:
            emit({"key": key, "record": {"status": "skipped: --time-limit"}})
            continue
        emit({"start": key})
        row = cfg["rows"][index]
        try:
            if inputs is None or inputs.index != index:
                inputs = None
                inputs = TFInputs(tf, cfg, index, row)
            record = run_tf_case(tf, cfg, inputs, row, fill, impl)
        except Exception as err:  # noqa: BLE001 - recorded, the next case runs
            record = {"status": common.error_text(err)}
        emit({"key": key, "record": record})


# ---------------------------------------------------------------------------------------------------------
# The torch side (its own process, without TensorFlow's environment)
# ---------------------------------------------------------------------------------------------------------

def torch_worker(task, emit):
    cfg = task["cfg"]
    try:
        import torch
    except Exception as err:  # noqa: BLE001
        for index, fill, impl in task["todo"]:
            emit({"key": [index, fill, impl], "record": {"status": "skipped: no torch"}})
        emit({"torch": f"unavailable: {type(err).__name__}: {str(err)[:160]}", "flash_attn": "unavailable"})
        return
    device = "cuda" if cfg["device"].upper().startswith("GPU") else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        for index, fill, impl in task["todo"]:
            emit({"key": [index, fill, impl], "record": {"status": "skipped: torch sees no GPU"}})
        return
    flash = None
    try:
        from flash_attn import flash_attn_with_kvcache as flash
        import flash_attn
        flash_version = flash_attn.__version__
    except Exception as err:  # noqa: BLE001
        flash_version = f"unavailable: {type(err).__name__}: {str(err)[:160]}"
    emit({"torch": f"{torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}",
          "flash_attn": flash_version})
    F = torch.nn.functional
    dtype = getattr(torch, cfg["dtype"])
    scale = 1.0 / float(cfg["dim"]) ** 0.5
    group = cfg["heads"] // cfg["kv_heads"]
    cache_inputs = {}

    def make_inputs(index, row):
        gen = torch.Generator(device=device).manual_seed(index)
        b, sq, s, h, hkv, d = row["batch"], row["new"], row["cache"], cfg["heads"], cfg["kv_heads"], cfg["dim"]
        return [torch.randn(shape, device=device, dtype=dtype, generator=gen)
                for shape in ((b, sq, h, d), (b, s, hkv, d), (b, s, hkv, d))]  # [B, S, H, D] as TF's

    for index, fill, impl in task["todo"]:
        key = [index, fill, impl]
        if cfg["deadline"] and time.time() > cfg["deadline"]:
            emit({"key": key, "record": {"status": "skipped: --time-limit"}})
            continue
        if impl == "flash_attn" and flash is None:
            emit({"key": key, "record": {"status": "skipped: no flash_attn"}})
            continue
        if impl == "flash_attn" and device != "cuda":
            emit({"key": key, "record": {"status": "skipped: flash_attn needs a GPU"}})
            continue
        emit({"start": key})
        row = cfg["rows"][index]
        try:
            if index not in cache_inputs:
                cache_inputs.clear()
                if device == "cuda":
                    torch.cuda.empty_cache()
                cache_inputs[index] = make_inputs(index, row)
            q, k, v = cache_inputs[index]
            lengths = torch.tensor(row["lengths"][fill], dtype=torch.int32, device=device)
            chain = cfg["calls_per_function"]
            extra = {}
            if impl == "torch_sdpa":
                qt = q.transpose(1, 2).contiguous()  # torch's layout: [B, H, Sq, D], [B, Hkv, S, D]
                kt, vt = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
                mask = None
                if fill == "ragged" or row["new"] > 1:
                    mask = torch.from_numpy(bottom_right_visible(row["lengths"][fill], row["new"],
                                                                 row["cache"]))[:, None].to(device)
                try:
                    F.scaled_dot_product_attention(qt[:1, :, :1], kt[:1, :, :16], vt[:1, :, :16], enable_gqa=True)
                    extra["gqa"] = "enable_gqa"

                    def attn(x):
                        return F.scaled_dot_product_attention(x, kt, vt, attn_mask=mask, scale=scale,
                                                              enable_gqa=True)
                except TypeError:  # a torch before 2.5
                    extra["gqa"] = "repeat_interleave of K/V per call"

                    def attn(x):
                        return F.scaled_dot_product_attention(
                            x, kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1),
                            attn_mask=mask, scale=scale)
                x0 = qt
            else:
                def attn(x):
                    return flash(x, k, v, cache_seqlens=lengths, causal=True, softmax_scale=scale)
                x0 = q

            def call():
                with torch.no_grad():
                    out = x0
                    for _ in range(chain):
                        out = attn(out)
                    return out

            record = timed(cfg, row, fill, call, lambda r: r.reshape(-1)[0].item())
            record.update(extra)
        except Exception as err:  # noqa: BLE001
            record = {"status": common.error_text(err)}
        emit({"key": key, "record": record})


# ---------------------------------------------------------------------------------------------------------
# Parent: workers, results, figure, tables
# ---------------------------------------------------------------------------------------------------------

def run_worker(kind, cfg, todo, payload, on_record, timeout_s, python=None):
    """Runs `todo` [[row index, fill, impl]] in `kind` ("tf" or "torch") worker processes, restarting after a
    crash (the case it was running recorded as the crash); on_record(key, record) per finished case."""
    remaining = [list(t) for t in todo]
    want_info = kind == "tf" and not payload.get("info")
    while remaining:
        done = set()
        with tempfile.TemporaryDirectory() as tmp:
            task_path = os.path.join(tmp, "task.json")
            with open(task_path, "w") as f:
                json.dump({"cfg": cfg, "todo": remaining, "want_info": want_info}, f)
            if kind == "torch":
                env = common.torch_env()
            else:
                env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
            proc = subprocess.Popen([python or sys.executable, os.path.abspath(__file__), "--worker", kind,
                                     task_path], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
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
                    elif "torch" in rec:
                        payload.setdefault("peer", {}).update(torch=rec["torch"], flash_attn=rec["flash_attn"])
                    elif "start" in rec:
                        started = rec["start"]
                    else:
                        done.add(tuple(rec["key"]))
                        started = None
                        on_record(rec["key"], rec["record"])
                seen = len(lines)
                if finished:
                    break
                if time.perf_counter() > deadline:
                    proc.kill()
                    output, _ = proc.communicate()
                    output = (output or "") + f"\nworker stopped after {timeout_s:.0f} s"
                    break
        remaining = [t for t in remaining if tuple(t) not in done]
        if not remaining:
            break
        lines = (output or "").strip().splitlines() or [""]
        telling = []
        for words in (("Check failed", "Abort", "Killed", "Segmentation", "out of memory", "stopped after",
                       "no GPU", "without CUDA"), ("Error", "error")):
            telling = [line for line in lines if any(w in line for w in words) and "cuInit" not in line]
            if telling:
                break
        why = f"worker died (exit {proc.returncode})" + (f": {telling[-1][:300]}" if telling else "")
        if started is None and not done:  # it failed before any case: nothing will run
            print(output[-3000:] if output else "", file=sys.stderr)
            for t in remaining:
                on_record(t, {"status": why, "crashed": True})
            break
        victim = started if started is not None else remaining[0]
        on_record(victim, {"status": why, "crashed": True})
        remaining = [t for t in remaining if t != list(victim)]


def _find(payload, index, fill, impl):
    for r in payload["records"]:
        if r["row"] == index and r["fill"] == fill and r["impl"] == impl:
            return r
    return None


def cell(record):
    if record is None:
        return "-"
    if record.get("status") != "ok":
        return record.get("status", "?")
    return f"{record['median_us']:,.0f} us, {record['tbps']:.3g} TB/s"


def plan_text(record):
    """The decode path's plan recorded with a tf_flash case: its runs, "not taken" (the plain call), or "-"."""
    if not record or record.get("status") != "ok" or "splits" not in record:
        return "-"
    splits = record["splits"]
    return "not taken" if splits is None else f"{splits} run{'s' if splits != 1 else ''}"


def table(payload):
    cfg = payload["config"]
    impls = [i for i in IMPLS if any(r["impl"] == i for r in payload["records"])]
    parts = [plot.machine_line(payload.get("info") or {})]
    peer = payload.get("peer") or {}
    if peer:
        parts[0] += f" flash_attn {peer.get('flash_attn')}."
    parts.append(f"{cfg['dtype']}, {cfg['heads']} query heads, {cfg['kv_heads']} KV heads, head dim {cfg['dim']}, "
                 f"causal bottom-right, {cfg['calls_per_function']} attentions per call; time per attention and "
                 f"K+V read at (bytes of the valid keys' K and V / time).")
    for fill in cfg["fills"]:
        rows = []
        for index, row in enumerate(cfg["rows"]):
            cells = [cell(_find(payload, index, fill, impl)) for impl in impls]
            check = _find(payload, index, fill, "check") or {}
            plans = [plan_text(_find(payload, index, fill, impl)) for impl in ("tf_flash", "tf_flash_xla")]
            diffs = [check.get(f"max_abs_diff_vs_{name}") for name in ("tf_flash_unsplit", "xla_dense",
                                                                         "keras_switch_xla")]
            rows.append([row_label(row)] + cells + [" / ".join(plans)]
                        + ["-" if d is None else f"{d:.1e}" for d in diffs])
        headers = (["batch x new tokens @ cache"] + [LABELS[i] for i in impls]
                   + ["decode path (tf.function / XLA)", "max abs diff vs split_kv=False", "vs dense",
                      "vs Keras switch"])
        what = ("full cache (kv_lengths = S)" if fill == "full"
                else "ragged cache (kv_lengths uniform in [S/2, S]; bytes of the valid keys)")
        parts.append(f"{what}:\n\n" + plot.markdown_table(headers, rows))
    return "\n\n".join(parts)


def peak_tbps(info):
    name = plot.device_name(info or {})
    for key, value in HBM_TBPS.items():
        if key in name:
            return name, value
    return name, None


def figure(payload, png_path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cfg = payload["config"]
    ok = [r for r in payload["records"] if r.get("status") == "ok" and "tbps" in r]
    if not ok:
        return None
    impls = [i for i in IMPLS if any(r["impl"] == i for r in ok)]
    fills = cfg["fills"]
    fig, axes = plt.subplots(1, len(fills), figsize=(6.5 * len(fills), 4.4), squeeze=False)
    labels = [row_label(r) for r in cfg["rows"]]
    name, peak = peak_tbps(payload.get("info"))
    width = 0.8 / len(impls)
    for ax, fill in zip(axes[0], fills):
        for i, impl in enumerate(impls):
            xs, ys = [], []
            for index in range(len(cfg["rows"])):
                r = _find(payload, index, fill, impl)
                if r is not None and r.get("status") == "ok":
                    xs.append(index + (i - (len(impls) - 1) / 2) * width)
                    ys.append(r["tbps"])
            bars = ax.bar(xs, ys, width=width, color=COLORS[impl], label=LABELS[impl])
            for bar, y in zip(bars, ys):
                ax.annotate(f"{y:.2g}", (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom",
                            fontsize=6)
        if peak:
            ax.axhline(peak, color="k", linestyle="--", linewidth=0.8, label=f"{name} memory, {peak} TB/s")
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_xlabel("batch x new tokens @ cache")
        ax.set_ylabel("K+V read at (TB/s)")
        ax.set_title("full cache" if fill == "full" else "ragged cache (kv_lengths in [S/2, S], valid keys' bytes)",
                     fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Decoding over a KV cache: K+V bytes / time per attention; {cfg['dtype']} h{cfg['heads']}/"
                 f"{cfg['kv_heads']} d{cfg['dim']}, bottom-right causal; {plot.measured_on(payload.get('info') or {})}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def write_outputs(json_path, payload):
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    return figure(payload, os.path.splitext(json_path)[0] + ".png")


def describe(cfg, key, record):
    index, fill, impl = key
    head = f"{row_label(cfg['rows'][index]):16s} {fill:6s} {impl:16s}"
    if record.get("status") != "ok":
        return f"{head} {record.get('status')}"
    if impl == "check":
        return (f"{head} |split - unsplit| {record['max_abs_diff_vs_tf_flash_unsplit']:.2e}, "
                f"|split - dense| {record['max_abs_diff_vs_xla_dense']:.2e}, "
                f"|split - Keras switch| {record['max_abs_diff_vs_keras_switch_xla']:.2e}")
    extra = f" splits {record['splits']}" if "splits" in record else ""
    return f"{head} {record['median_us']:10.1f} us {record['tbps']:6.3f} TB/s{extra}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"CPU smoke run: rows {QUICK['rows']}, 8/2 heads, d64, float32, 3 repeats")
    p.add_argument("--rows", default=DEFAULT_ROWS, help="BxSq@S, comma-separated (k = 1024)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", default=None, help="TF device (default GPU:0; CPU:0 with --quick)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {', '.join(IMPLS)}")
    p.add_argument("--fills", default=",".join(FILLS), help="full, ragged or both")
    p.add_argument("--seed", type=int, default=44, help="numpy seed of the ragged lengths (row i: seed + i)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15, help="timed samples per case")
    p.add_argument("--calls-per-function", type=int, default=10, help="attentions chained in each timed call")
    p.add_argument("--time-limit", type=float, default=150, help="seconds: start no case after this")
    p.add_argument("--torch-reserve", type=float, default=35,
                   help="seconds of --time-limit kept for the torch peer's cases (TF's start no case after)")
    p.add_argument("--torch-python", default=None,
                   help="the Python of the torch peer (default this one, with TensorFlow's paths taken out)")
    p.add_argument("--no-check", action="store_true", help="skip the agreement check of tf_flash's two calls")
    p.add_argument("--out-dir", default=None, help="default results/ (results/quick/ with --quick, git-ignored)")
    p.add_argument("--tag", default=None, help="result file stem (default gpu_decode; cpu_decode on a CPU)")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    explicit = {a.split("=")[0][2:].replace("-", "_") for a in (argv if argv is not None else sys.argv[1:])
                if a.startswith("--")}
    if args.quick:  # the quick defaults, under any flag given explicitly
        for key, value in QUICK.items():
            if key not in explicit:
                setattr(args, key, value)
    args.device = args.device or "GPU:0"
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        kind, task_path = args.worker
        with open(task_path) as f:
            task = json.load(f)
        with open(task_path + ".results", "a") as out:
            def emit(obj):
                out.write(json.dumps(obj, default=str) + "\n")
                out.flush()
            (tf_worker if kind == "tf" else torch_worker)(task, emit)
        return
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    fills = [f.strip() for f in args.fills.split(",") if f.strip()]
    bad = [i for i in impls if i not in IMPLS] + [f for f in fills if f not in FILLS]
    if bad:
        raise SystemExit(f"unknown impl(s) or fill(s) {bad}: impls {IMPLS}, fills {FILLS}")
    if args.heads % args.kv_heads:
        raise SystemExit("--kv-heads must divide --heads")
    if DTYPES[args.dtype] == "float8_e4m3fn" and set(impls) - set(FP8_IMPLS):
        raise SystemExit(f"--dtype fp8 runs {FP8_IMPLS} only (the others have no fp8 attention); received --impls "
                         f"{args.impls}")
    rows = parse_rows(args.rows)
    for index, row in enumerate(rows):
        row["lengths"] = {f: kv_lengths(row, f, args.seed + index).tolist() for f in FILLS}
    gpu = args.device.upper().startswith("GPU")
    start = time.time()
    cfg = {"rows": rows, "fills": fills, "impls": impls, "heads": args.heads, "kv_heads": args.kv_heads,
           "dim": args.dim, "dtype": DTYPES[args.dtype], "device": args.device, "seed": args.seed,
           "warmup": args.warmup, "repeats": args.repeats, "calls_per_function": args.calls_per_function,
           "time_limit_s": args.time_limit, "deadline": start + args.time_limit if args.time_limit else 0}
    stem = args.tag or ("gpu_decode" if gpu else "cpu_decode")
    json_path = os.path.join(common.output_dir(args.out_dir, args.quick), stem + ".json")
    payload = {"benchmark": "decode", "command": common.command_line(),
               "config": {k: v for k, v in cfg.items() if k != "deadline"}, "info": None, "records": []}
    for index, row in enumerate(rows):
        full = kv_bytes(row["lengths"]["full"], args.kv_heads, args.dim, ITEMSIZE[cfg["dtype"]])
        print(f"{row_label(row)}: K+V {full / 1e9:.3f} GB full; ragged kv_lengths {row['lengths']['ragged']}",
              flush=True)

    def on_record(key, record):
        index, fill, impl = key
        payload["records"] = [r for r in payload["records"] if (r["row"], r["fill"], r["impl"]) != tuple(key)]
        payload["records"].append(dict(record, row=index, fill=fill, impl=impl, label=row_label(rows[index])))
        print(describe(cfg, key, record), flush=True)
        if payload.get("info"):
            write_outputs(json_path, payload)

    tf_todo = [[i, f, impl] for i in range(len(rows)) for f in fills
               for impl in [x for x in TF_IMPLS if x in impls]
               + (["check"] if not args.no_check and "tf_flash" in impls else [])]
    torch_todo = [[i, f, impl] for i in range(len(rows)) for f in fills for impl in TORCH_IMPLS if impl in impls]
    timeout = (args.time_limit or 1800) + 300
    if tf_todo:  # the torch peer's cases keep the last --torch-reserve seconds of the limit
        reserve = args.torch_reserve if torch_todo and cfg["deadline"] else 0
        run_worker("tf", dict(cfg, deadline=cfg["deadline"] - reserve if cfg["deadline"] else 0), tf_todo,
                   payload, on_record, timeout)
    if torch_todo:
        if not payload.get("info"):
            payload["info"] = common.host_info()
        run_worker("torch", cfg, torch_todo, payload, on_record, timeout, python=args.torch_python)
    if (payload.get("peer") or {}).get("torch", "unavailable").split(":")[0] != "unavailable":
        payload["info"]["torch"] = payload["peer"]["torch"]
    payload["elapsed_s"] = round(time.time() - start, 1)
    png = write_outputs(json_path, payload)
    print("\n" + table(payload) + "\n")
    print(f"wrote {json_path}" + (f" and {png}" if png else "") + f" in {payload['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
