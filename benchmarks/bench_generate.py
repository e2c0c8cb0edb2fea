#!/usr/bin/env python
"""KerasHub generation (issue 44): tokens/s of a ~1B-parameter Llama's `generate`, tf_flash's switch on and off.

The model: keras_hub.models.LlamaBackbone from config, random weights (keras.utils.set_random_seed(--seed)
before it is built, so every worker holds the same weights), dtype bfloat16 (--dtype): vocabulary 32000,
16 layers, hidden 2048, 32 query heads, 8 KV heads (head dim 64), intermediate 8192, untied embeddings:
1,104,218,112 parameters (llama_param_count(), checked against the built model's count_params() in the JSON).
LlamaCausalLM(backbone, preprocessor=None), compile(sampler="greedy", jit_compile=True): KerasHub's generate
is one XLA function, the prefill over the whole padded row and then one step per new token over the cache.

Cases, each (prompt length P, mode) in its own fresh worker process, in this order (the cheap ones first,
and per P the switch off last): 4k on, 4k prefill_only, 4k off, then the same at 32k. Modes:

  off           plain KerasHub (its attention: einsum scores, float32 softmax, einsum; the [1, 32, T, S]
                scores of the prefill are materialized)
  on            tf_flash.keras.enable() before the model is built: KerasHub's fused-attention gate opens and
                its attention runs tf_flash (prefill: causal over the row; each new token: the decode path
                over the cache)
  prefill_only  the switch on for the prefill, and KerasHub's own attention (as off) in the decoding steps:
                the decoding steps switch off where plain off cannot run the prefill (at 32k XLA cannot
                even autotune the scores' product). decode_speedup = on's decode tokens/s over this mode's.
  no_attention  (only when --modes names it) the switch on for the prefill, and in the decoding steps zeros
                for the attention that still read one key row, so that XLA keeps the cache's update, slices
                and restack (plain zeros let it drop the cache, and the prefill's K and V with it): the step
                without attention, which bounds what any attention can gain. attention_share = the part of
                the switch-on decoding step that is attention, 1 - on's decode tokens/s over this mode's.

Batch 1; the prompt is P random tokens (numpy default_rng(--seed), the same in every worker); token_ids and
padding_mask have length P + --new-tokens (256), the mask one for the first P, so greedy decoding with
stop_token_ids=None writes exactly 256 new tokens. Per case: one generate to compile (compile_first_s:
tracing, XLA's compile and the first run), then one timed generate (generate_s; tokens_per_s = 256 /
generate_s, prefill included, as a user sees it). Peak GPU memory: tf.config.experimental.reset_memory_stats
then get_memory_info("GPU:0")["peak"] around the timed generate (peak_bytes; weights_bytes: in use after the
model is built; peak_first_bytes: the peak from the start to the end of the first generate). Then, while
--time-limit has not passed (and without --no-prefill), the prefill alone: CausalLM._build_cache (the
forward over the P + 256 tokens that seeds the cache, as generate runs it) in its own XLA function, compiled
apart, timed once (prefill_s; decode_tokens_per_s = 256 / (generate_s - prefill_s)). Trace-time counts of
tf_flash calls and of decode-path calls tell that the switch reached the model (0 with it off).
The generated tokens are kept; per P the parent records whether on and off gave the same tokens (a greedy
argmax may flip where two logits lie within bfloat16 rounding: the count of equal tokens and the first
difference are recorded). An exception (ResourceExhausted: "OOM"), a worker's death or its timeout is
recorded as the case's status, and the next case runs.

--time-limit (seconds, default 420) starts no case after it, and a running case is stopped at --time-limit
plus --grace (100): the default GPU run fits one ~9-minute call. Output: results/<tag>.json (default
gpu_generate) and .png (tokens/s and peak memory per P, on against off), rewritten as cases finish;
a markdown table on the terminal.

    python benchmarks/bench_generate.py               # GPU: results/gpu_generate.json, .png
    python benchmarks/bench_generate.py --quick       # CPU smoke run: results/quick/cpu_generate.json (git-ignored)
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import plot  # noqa: E402

MODES = ["on", "prefill_only", "no_attention", "off"]
DEFAULT_MODES = "on,prefill_only,off"
COLORS = {"on": "C3", "prefill_only": "C1", "no_attention": "C9", "off": "C7"}
LABELS = {"on": "tf_flash switch on", "prefill_only": "switch on for the prefill only",
          "no_attention": "no attention in the decoding steps", "off": "switch off (KerasHub's attention)"}
MODEL = {"vocabulary_size": 32000, "num_layers": 16, "hidden_dim": 2048, "num_query_heads": 32,
         "num_key_value_heads": 8, "intermediate_dim": 8192}
QUICK = {"vocabulary_size": 1000, "num_layers": 2, "hidden_dim": 64, "num_query_heads": 4,
         "num_key_value_heads": 2, "intermediate_dim": 128}
QUICK_ARGS = {"prompts": "256,512", "new_tokens": 8, "dtype": "float32", "device": "CPU:0"}


# ---------------------------------------------------------------------------------------------------------
# Cases, parameters, comparisons (no TensorFlow)
# ---------------------------------------------------------------------------------------------------------

def parse_prompts(text):
    """"4k,32768" -> [4096, 32768] (k = 1024)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            out.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
    if not out or min(out) < 1:
        raise ValueError(f"prompt lengths {text!r}: need at least one, each >= 1")
    return out


def case_order(prompts, modes):
    """The cases in run order: shorter prompts first, and per prompt in MODES' order, "off" last (at the longest
    prompt the switch-off case is the one that may run out of memory or run long)."""
    return [[p, m] for p in sorted(prompts) for m in MODES if m in modes]


def llama_param_count(vocabulary_size, num_layers, hidden_dim, num_query_heads, num_key_value_heads,
                      intermediate_dim, tie_word_embeddings=False):
    """LlamaBackbone's parameters: embedding (and its untied output projection), per layer q/o [H, H], k/v
    [H, Hkv * H / Hq], gate/up/down of the MLP and two RMS norms, and the final norm; no biases."""
    head_dim = hidden_dim // num_query_heads
    attention = 2 * hidden_dim * hidden_dim + 2 * hidden_dim * num_key_value_heads * head_dim
    layer = attention + 3 * hidden_dim * intermediate_dim + 2 * hidden_dim
    embeddings = vocabulary_size * hidden_dim * (1 if tie_word_embeddings else 2)
    return embeddings + num_layers * layer + hidden_dim


def compare_tokens(a, b):
    """Greedy tokens of two runs: {"identical", "equal_tokens", "first_difference"} (None where either is missing)."""
    if a is None or b is None:
        return {"identical": None, "equal_tokens": None, "first_difference": None}
    a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    n = min(a.size, b.size)
    diff = np.nonzero(a[:n] != b[:n])[0]
    return {"identical": bool(a.size == b.size and diff.size == 0), "equal_tokens": int(np.sum(a[:n] == b[:n])),
            "first_difference": int(diff[0]) if diff.size else None}


def error_text(err):
    """common.error_text, also calling "OOM" an error whose text says OOM."""
    return "OOM" if "OOM" in str(err)[:2000] else common.error_text(err)


# ---------------------------------------------------------------------------------------------------------
# The worker: one (prompt, mode) in a fresh process
# ---------------------------------------------------------------------------------------------------------

def worker(task, emit):
    cfg, prompt, mode = task["cfg"], task["prompt"], task["mode"]
    emit({"phase": "import"})
    import tensorflow as tf

    for gpu in tf.config.list_physical_devices("GPU"):
        tf.config.experimental.set_memory_growth(gpu, True)
    on_gpu = cfg["device"].upper().startswith("GPU")
    if on_gpu and not tf.config.list_physical_devices("GPU"):
        raise SystemExit(f"--device {cfg['device']}: no GPU visible to TensorFlow (--quick runs on the CPU)")
    import keras
    import tf_flash
    from tf_flash import _decode
    if on_gpu and tf_flash.build_info().get("cuda") != "1":  # else TF would quietly run the CPU kernel
        raise SystemExit(f"tf_flash was built without CUDA: {tf_flash.build_info()}")
    counts = {"flash_calls_traced": 0, "decode_path_traced": 0}  # at trace time: the switch reached the model
    flash_op, attend = tf_flash.ops.flash_attention, _decode.attend

    def counting_flash(*args, **kwargs):
        counts["flash_calls_traced"] += 1
        return flash_op(*args, **kwargs)

    def counting_attend(*args, **kwargs):
        counts["decode_path_traced"] += 1
        return attend(*args, **kwargs)

    tf_flash.ops.flash_attention, _decode.attend = counting_flash, counting_attend
    if mode != "off":
        tf_flash.keras.enable()
    import keras_hub
    if mode in DECODING_STEPS:
        replace_decoding_steps_attention(DECODING_STEPS[mode])
    if task.get("want_info"):
        info = common.machine_info(gpu=on_gpu)
        info["keras_hub"] = keras_hub.__version__
        emit({"info": info})

    def memory(key):
        if not on_gpu:
            return None
        return int(tf.config.experimental.get_memory_info(cfg["device"])[key])

    record = {"prompt": prompt, "mode": mode, "new_tokens": cfg["new_tokens"]}
    try:
        emit({"phase": "build"})
        t0 = time.perf_counter()
        with tf.device(cfg["device"]):
            keras.utils.set_random_seed(cfg["seed"])
            backbone = keras_hub.models.LlamaBackbone(**cfg["model"], dtype=cfg["dtype"])
            model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
            model.compile(sampler="greedy", jit_compile=True)
            record["params"] = int(backbone.count_params())
            total = prompt + cfg["new_tokens"]
            rng = np.random.default_rng(cfg["seed"])
            tokens = np.zeros((1, total), np.int32)
            tokens[0, :prompt] = rng.integers(1, cfg["model"]["vocabulary_size"], size=prompt)
            mask = np.zeros((1, total), np.int32)
            mask[0, :prompt] = 1
            inputs = {"token_ids": tf.constant(tokens), "padding_mask": tf.constant(mask)}
        record["build_s"] = time.perf_counter() - t0
        record["weights_bytes"] = memory("current")

        def generate():
            with tf.device(cfg["device"]):
                out = model.generate(dict(inputs), stop_token_ids=None)
            return np.asarray(out["token_ids"])[0, prompt:]

        emit({"phase": "first generate"})
        t0 = time.perf_counter()
        first = generate()
        record["compile_first_s"] = time.perf_counter() - t0
        record["peak_first_bytes"] = memory("peak")
        record.update(counts)
        emit({"phase": "timed generate"})
        if on_gpu:
            tf.config.experimental.reset_memory_stats(cfg["device"])
        t0 = time.perf_counter()
        new = generate()
        record["generate_s"] = time.perf_counter() - t0
        record["peak_bytes"] = memory("peak")
        record["tokens_per_s"] = cfg["new_tokens"] / record["generate_s"]
        record["tokens"] = new.tolist()
        record["generated"] = int(new.size)
        record["same_tokens_both_calls"] = bool(np.array_equal(first, new))
        record["status"] = "ok"
    except Exception as err:  # noqa: BLE001 - recorded as the case's status
        record["status"] = error_text(err)
        record.update(counts)
    record["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    emit({"record": record})  # the main result first: the prefill below may still fail or be cut off
    if record["status"] != "ok" or not cfg["prefill"]:
        return
    if task.get("prefill_deadline") and time.time() > task["prefill_deadline"]:
        record["prefill_status"] = "skipped: --time-limit"
        emit({"record": record})
        return
    try:
        emit({"phase": "prefill"})
        with tf.device(cfg["device"]):
            prefill = tf.function(lambda ids: model._build_cache(ids)[1], jit_compile=True)
            t0 = time.perf_counter()
            prefill(inputs["token_ids"])[0, 0, 0, 0, 0, 0].numpy()
            record["prefill_compile_first_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            prefill(inputs["token_ids"])[0, 0, 0, 0, 0, 0].numpy()
            record["prefill_s"] = time.perf_counter() - t0
        decode_s = record["generate_s"] - record["prefill_s"]
        record["decode_tokens_per_s"] = cfg["new_tokens"] / decode_s if decode_s > 0 else None
    except Exception as err:  # noqa: BLE001
        record["prefill_status"] = error_text(err)
    emit({"record": record})


def replace_decoding_steps_attention(attention):
    """KerasHub's Llama attention runs attention(compute, layer, query, key, value, mask) for one-token queries
    (the decoding steps), compute being its own _compute_attention."""
    from keras_hub.src.models.llama import llama_attention
    compute = llama_attention.LlamaAttention._compute_attention

    def compute_attention(self, query, key, value, attention_mask=None):
        if query.shape[1] != 1:
            return compute(self, query, key, value, attention_mask)
        return attention(compute, self, query, key, value, attention_mask)

    llama_attention.LlamaAttention._compute_attention = compute_attention


def keras_hub_attention(compute, layer, query, key, value, mask):
    """KerasHub's own einsum path, as with the switch off: its fused-attention gate reads False meanwhile."""
    from keras_hub.src.models.llama import llama_attention
    gate = llama_attention.fused_attention_op_available
    llama_attention.fused_attention_op_available = lambda: False
    try:
        return compute(layer, query, key, value, mask)
    finally:
        llama_attention.fused_attention_op_available = gate


def zeros_reading_the_cache(compute, layer, query, key, value, mask):
    """Zeros for the attention's output that read one key row, so that the cache stays live."""
    from keras import ops
    return ops.zeros_like(query) + 0 * ops.cast(ops.sum(key[:, :1]), query.dtype)


DECODING_STEPS = {"prefill_only": keras_hub_attention, "no_attention": zeros_reading_the_cache}


# ---------------------------------------------------------------------------------------------------------
# Parent: workers, results, figure, table
# ---------------------------------------------------------------------------------------------------------

def run_case(cfg, prompt, mode, want_info, timeout_s, prefill_deadline=0):
    """Runs one case in a fresh worker process: (record, info or None). A crash or a timeout is the record's
    status (with the phase the worker was in). The prefill timing starts only before prefill_deadline."""
    record, info, phase = None, None, "start"
    with tempfile.TemporaryDirectory() as tmp:
        task_path = os.path.join(tmp, "task.json")
        with open(task_path, "w") as f:
            json.dump({"cfg": cfg, "prompt": prompt, "mode": mode, "want_info": want_info,
                       "prefill_deadline": prefill_deadline}, f)
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", task_path], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            output, _ = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            timed_out = True
        if os.path.exists(task_path + ".results"):
            with open(task_path + ".results") as f:
                for line in f:
                    if not line.endswith("\n"):
                        continue
                    rec = json.loads(line)
                    if "info" in rec:
                        info = rec["info"]
                    elif "phase" in rec:
                        phase = rec["phase"]
                    elif "record" in rec:
                        record = rec["record"]
    if record is not None and (record.get("status") != "ok" or not (timed_out or proc.returncode)):
        return record, info
    if record is not None:  # the main result came, then the prefill died or ran out of time
        record["prefill_status"] = f"timed out after {timeout_s:.0f} s" if timed_out else \
            f"worker died (exit {proc.returncode})"
        return record, info
    lines = (output or "").strip().splitlines() or [""]
    telling = []
    for words in (("Check failed", "Abort", "Killed", "Segmentation", "out of memory", "OOM", "no GPU",
                   "without CUDA"), ("Error", "error")):
        telling = [line for line in lines if any(w in line for w in words) and "cuInit" not in line]
        if telling:
            break
    if timed_out:
        why = f"timed out after {timeout_s:.0f} s ({phase})"
    else:
        why = f"worker died (exit {proc.returncode}, {phase})" + (f": {telling[-1][:300]}" if telling else "")
        if phase == "start" or phase == "import":
            print(output[-3000:] if output else "", file=sys.stderr)
    return {"prompt": prompt, "mode": mode, "status": why, "crashed": True}, info


def find(payload, prompt, mode):
    for r in payload["records"]:
        if r["prompt"] == prompt and r["mode"] == mode:
            return r
    return None


def compare(payload):
    """Per prompt: on against off, tokens and tokens/s; on against prefill_only, tokens ("prefill_only") and
    decode tokens/s ("decode_speedup"); on against no_attention, the attention's share of a decoding step."""
    out = []
    for prompt in payload["config"]["prompts"]:
        on, off, mixed, bare = (find(payload, prompt, m) for m in ("on", "off", "prefill_only", "no_attention"))
        on, off, mixed, bare = (r if r is not None and r.get("status") == "ok" else None
                                for r in (on, off, mixed, bare))
        entry = {"prompt": prompt}
        entry.update(compare_tokens(on and on["tokens"], off and off["tokens"]))
        entry["speedup"] = on["tokens_per_s"] / off["tokens_per_s"] if on and off else None
        if "prefill_only" in payload["config"]["modes"]:
            entry["prefill_only"] = compare_tokens(on and on["tokens"], mixed and mixed["tokens"])
            decode = [r and r.get("decode_tokens_per_s") for r in (on, mixed)]
            entry["decode_speedup"] = decode[0] / decode[1] if all(decode) else None
        if "no_attention" in payload["config"]["modes"]:
            decode = [r and r.get("decode_tokens_per_s") for r in (on, bare)]
            entry["attention_share"] = 1 - decode[0] / decode[1] if all(decode) else None
        out.append(entry)
    return out


def gib(value):
    return "-" if value is None else f"{value / 2**30:.2f} GiB"


def peak_cell(record):
    """GPU peak over the timed generate; on a CPU the worker's peak RSS (the whole process, compile included)."""
    if record.get("peak_bytes") is not None:
        return gib(record["peak_bytes"])
    if record.get("peak_rss_bytes") is not None:
        return gib(record["peak_rss_bytes"]) + " (process RSS)"
    return "-"


def secs(value):
    return "-" if value is None else f"{value:.2f} s"


def table(payload):
    cfg = payload["config"]
    model = cfg["model"]
    parts = [plot.machine_line(payload.get("info") or {})]
    parts.append(f"KerasHub LlamaBackbone, {cfg['param_count']:,} parameters ({model['num_layers']} layers, hidden "
                 f"{model['hidden_dim']}, {model['num_query_heads']}/{model['num_key_value_heads']} heads, "
                 f"intermediate {model['intermediate_dim']}, vocabulary {model['vocabulary_size']}), "
                 f"{cfg['dtype']}, random weights; LlamaCausalLM.generate, greedy, jit_compile=True, batch 1, "
                 f"{cfg['new_tokens']} new tokens. tokens/s = new tokens / one generate (prefill included); "
                 f"decode tokens/s = new tokens / (generate - prefill); peak memory over the timed generate.")
    comparisons = {c["prompt"]: c for c in payload.get("comparisons") or compare(payload)}
    rows = []
    for prompt, mode in case_order(cfg["prompts"], cfg["modes"]):
        r = find(payload, prompt, mode)
        c = comparisons.get(prompt, {})
        label = [plot.seqlen_label(prompt), mode]
        if r is None:
            rows.append(label + ["not run"] + ["-"] * 8)
            continue
        if r.get("status") != "ok":
            rows.append(label + [r.get("status")] + ["-"] * 8)
            continue
        prefill = r.get("prefill_s")
        if prefill is None and r.get("prefill_status"):
            prefill = r["prefill_status"]
        same = "-"
        tokens = {"off": c, "prefill_only": c.get("prefill_only")}.get(mode)  # against on's tokens
        if tokens and tokens.get("identical") is not None:
            same = "yes" if tokens["identical"] else (f"no: {tokens['equal_tokens']}/{r['generated']} equal, "
                                                      f"first at {tokens['first_difference']}")
        speed = f"{c['speedup']:.2f}x" if mode == "on" and c.get("speedup") else "-"
        decode_speed = f"{c['decode_speedup']:.2f}x" if mode == "on" and c.get("decode_speedup") else "-"
        decode = r.get("decode_tokens_per_s")
        rows.append(label + [f"{r['tokens_per_s']:.1f}", speed, secs(r["generate_s"]),
                             prefill if isinstance(prefill, str) else secs(prefill),
                             "-" if decode is None else f"{decode:.1f}", decode_speed, secs(r["compile_first_s"]),
                             peak_cell(r), same])
    headers = ["prompt", "switch", "tokens/s", "on / off", "generate", "prefill", "decode tokens/s",
               "decode on / prefill_only", "compile + first call", "peak memory", "tokens as on's"]
    parts.append(plot.markdown_table(headers, rows))
    return "\n\n".join(parts)


def figure(payload, png_path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cfg = payload["config"]
    if not any(r.get("status") == "ok" for r in payload["records"]):
        return None
    prompts = cfg["prompts"]
    modes = [m for m in MODES if m in cfg["modes"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(modes)
    memory = ("peak_bytes", "peak GPU memory (GiB), timed generate")
    if not any(r.get("peak_bytes") for r in payload["records"]):  # a CPU run: the worker's peak RSS
        memory = ("peak_rss_bytes", "peak process RSS (GiB)")
    for ax, key, ylabel, scale in ((axes[0], "tokens_per_s", "new tokens / s (generate, prefill included)", 1),
                                   (axes[1], memory[0], memory[1], 2**30)):
        top = max([r[key] / scale for r in payload["records"] if r.get("status") == "ok" and r.get(key)] or [1])
        for i, mode in enumerate(modes):
            for j, prompt in enumerate(prompts):
                x = j + (i - (len(modes) - 1) / 2) * width
                r = find(payload, prompt, mode)
                value = r.get(key) if r is not None and r.get("status") == "ok" else None
                if value is None:
                    why = "not run" if r is None else ("n/a" if r.get("status") == "ok" else r["status"])
                    ax.annotate(why[:14], (x, 0.02 * top), ha="center", va="bottom", fontsize=8, rotation=90,
                                color=COLORS[mode])
                    continue
                labeled = LABELS[mode] in ax.get_legend_handles_labels()[1]
                bar = ax.bar([x], [value / scale], width=width, color=COLORS[mode],
                             label=None if labeled else LABELS[mode])[0]
                ax.annotate(f"{value / scale:.4g}", (bar.get_x() + bar.get_width() / 2, value / scale),
                            ha="center", va="bottom", fontsize=7)
        ax.set_xlim(-0.5, len(prompts) - 0.5)
        ax.set_xticks(range(len(prompts)))
        ax.set_xticklabels([plot.seqlen_label(p) for p in prompts])
        ax.set_xlabel("prompt (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=7)
    model = cfg["model"]
    count = cfg["param_count"]
    count = f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count:,}"
    fig.suptitle(f"KerasHub Llama generate ({count} parameters, {model['num_layers']} layers, "
                 f"{cfg['dtype']}), batch 1, {cfg['new_tokens']} new tokens, greedy, XLA; "
                 f"{plot.measured_on(payload.get('info') or {})}", fontsize=9)
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
    head = f"{plot.seqlen_label(record['prompt']):>6s} {record['mode']:3s}"
    if record.get("status") != "ok":
        return f"{head} {record.get('status')}"
    text = (f"{head} {record['tokens_per_s']:8.1f} tokens/s  generate {record['generate_s']:.2f} s  compile+first "
            f"{record['compile_first_s']:.1f} s  peak {peak_cell(record)}  tf_flash calls traced "
            f"{record.get('flash_calls_traced')}, decode path {record.get('decode_path_traced')}")
    if record.get("prefill_s") is not None:
        text += f"  prefill {record['prefill_s']:.2f} s"
    elif record.get("prefill_status"):
        text += f"  prefill: {record['prefill_status']}"
    return text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke run: 2 layers, hidden 64, 4/2 heads, vocabulary 1000, prompts 256 and 512, "
                        "8 new tokens, float32")
    p.add_argument("--prompts", default="4096,32768", help="prompt lengths, comma-separated (k = 1024)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--layers", type=int, default=None, help=f"default {MODEL['num_layers']}")
    p.add_argument("--hidden", type=int, default=None, help=f"default {MODEL['hidden_dim']}")
    p.add_argument("--heads", type=int, default=None, help=f"query heads, default {MODEL['num_query_heads']}")
    p.add_argument("--kv-heads", type=int, default=None, help=f"default {MODEL['num_key_value_heads']}")
    p.add_argument("--intermediate", type=int, default=None, help=f"default {MODEL['intermediate_dim']}")
    p.add_argument("--vocab", type=int, default=None, help=f"default {MODEL['vocabulary_size']}")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None, help="TF device (default GPU:0; CPU:0 with --quick)")
    p.add_argument("--seed", type=int, default=44, help="the weights' (keras) and the prompt's (numpy) seed")
    p.add_argument("--no-prefill", action="store_true", help="skip the separate prefill timing")
    p.add_argument("--time-limit", type=float, default=420, help="seconds: start no case (and no prefill) after this")
    p.add_argument("--prefill-reserve", type=float, default=60,
                   help="seconds of --time-limit each case still to come keeps from this case's prefill timing")
    p.add_argument("--grace", type=float, default=100,
                   help="seconds past --time-limit after which a running case is stopped")
    p.add_argument("--out-dir", default=None, help="default results/ (results/quick/ with --quick, git-ignored)")
    p.add_argument("--tag", default=None, help="result file stem (default gpu_generate; cpu_generate on a CPU)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    explicit = {a.split("=")[0][2:].replace("-", "_") for a in (argv if argv is not None else sys.argv[1:])
                if a.startswith("--")}
    if args.quick:
        for key, value in QUICK_ARGS.items():
            if key not in explicit:
                setattr(args, key, value)
    base = QUICK if args.quick else MODEL
    model = dict(base)
    for flag, key in (("layers", "num_layers"), ("hidden", "hidden_dim"), ("heads", "num_query_heads"),
                      ("kv_heads", "num_key_value_heads"), ("intermediate", "intermediate_dim"),
                      ("vocab", "vocabulary_size")):
        if getattr(args, flag) is not None:
            model[key] = getattr(args, flag)
    args.model = model
    args.device = args.device or "GPU:0"
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        with open(args.worker) as f:
            task = json.load(f)
        with open(args.worker + ".results", "a") as out:
            def emit(obj):
                out.write(json.dumps(obj, default=str) + "\n")
                out.flush()
            worker(task, emit)
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes {args.modes!r}: of {MODES}")
    if args.model["hidden_dim"] % args.model["num_query_heads"] or \
            args.model["num_query_heads"] % args.model["num_key_value_heads"]:
        raise SystemExit("--heads must divide --hidden, and --kv-heads --heads")
    prompts = parse_prompts(args.prompts)
    gpu = args.device.upper().startswith("GPU")
    start = time.time()
    cfg = {"prompts": prompts, "modes": modes, "new_tokens": args.new_tokens, "model": args.model,
           "param_count": llama_param_count(**args.model), "dtype": args.dtype, "device": args.device,
           "seed": args.seed, "prefill": not args.no_prefill, "batch": 1, "sampler": "greedy",
           "time_limit_s": args.time_limit, "grace_s": args.grace,
           "deadline": start + args.time_limit if args.time_limit else 0}
    stem = args.tag or ("gpu_generate" if gpu else "cpu_generate")
    json_path = os.path.join(common.output_dir(args.out_dir, args.quick), stem + ".json")
    payload = {"benchmark": "generate", "command": common.command_line(),
               "config": {k: v for k, v in cfg.items() if k != "deadline"}, "info": None, "records": []}
    print(f"LlamaBackbone {args.model}: {cfg['param_count']:,} parameters, {args.dtype}; prompts {prompts}, "
          f"{args.new_tokens} new tokens, cases in order {case_order(prompts, modes)}", flush=True)
    have_info = False  # a worker's machine_info (versions, GPU); host_info() stands in until one reports
    order = case_order(prompts, modes)
    for index, (prompt, mode) in enumerate(order):
        now = time.time()
        if cfg["deadline"] and now > cfg["deadline"]:
            record = {"prompt": prompt, "mode": mode, "status": "skipped: --time-limit"}
        else:
            timeout = (cfg["deadline"] + args.grace - now) if cfg["deadline"] else 3600
            print(f"{plot.seqlen_label(prompt):>6s} {mode:3s} starts at {now - start:.0f} s", flush=True)
            # The prefill's own compile and run wait for the cases still to come: each later case keeps
            # --prefill-reserve seconds of the limit for itself.
            prefill_deadline = cfg["deadline"] - args.prefill_reserve * (len(order) - index - 1) \
                if cfg["deadline"] else 0
            record, info = run_case(cfg, prompt, mode, not have_info, timeout, prefill_deadline)
            if info and not have_info:
                payload["info"], have_info = info, True
        payload["records"].append(record)
        payload["comparisons"] = compare(payload)
        print(describe(record), flush=True)
        if not payload.get("info"):
            payload["info"] = common.host_info()
        write_outputs(json_path, payload)
    payload["elapsed_s"] = round(time.time() - start, 1)
    png = write_outputs(json_path, payload)
    print("\n" + table(payload) + "\n")
    print(f"wrote {json_path}" + (f" and {png}" if png else "") + f" in {payload['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
