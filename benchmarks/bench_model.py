#!/usr/bin/env python
"""End-to-end training step of a Keras transformer encoder (method: docs/performance.md).

Model: token + position embedding, N blocks of (attention, residual, LayerNorm, GELU MLP 4x width,
residual, LayerNorm), mean pooling, a dense classification head; width 768, 12 heads of 64; N = 4
(default) or 12 (BERT-base, `--blocks 12`); AdamW; `mixed_bfloat16` on the GPU (`--dtype float32` for
the CPU); batch x tokens = `--tokens-per-batch` (16384), batch 1 where a sequence is longer. With
`--doc-tokens N` each sequence packs documents of N tokens, an attention_mask [1, T, T] (block-diagonal)
in every attention layer.

Modes (`--modes`), which differ only in the attention layer and the `jit_compile` given to compile():
  keras_mha_xla       keras.layers.MultiHeadAttention, jit_compile=True (today's fast Keras baseline)
  keras_mha           keras.layers.MultiHeadAttention, jit_compile=False
  flash_mha_auto      tf_flash.layers.FlashMultiHeadAttention, compile() defaults (jit_compile="auto")
  flash_mha_xla       FlashMultiHeadAttention, jit_compile=True
  flash_mha_noxla     FlashMultiHeadAttention, jit_compile=False
  keras_flash_switch  keras.layers.MultiHeadAttention after tf_flash.keras.enable() and
                      keras.config.enable_flash_attention(), compile() defaults; recorded as
                      "unavailable" when tf_flash.keras does not exist
Each result says whether XLA was used (the model's resolved `jit_compile`: Keras turns a requested
True into False for layers without `supports_jit`) and whether tf_flash's op is in the model's graph.

Timing: per (mode, length), the first train_on_batch (tracing + compilation) is timed apart, then
`--warmup` steps, then `--steps` timed steps, each synchronized by train_on_batch returning the loss as a
Python float; median ms/step, p10-p90, tokens/s. Memory: on the GPU the peak of
tf.config.experimental.get_memory_info after reset_memory_stats (reset after the warm-up: the timed
steps' peak, weights and optimizer state included); on the CPU the peak RSS (VmHWM, reset through
/proc/self/clear_refs before each length).

Kernel families: `--families default,sm80` runs each tf_flash mode also as `MODE@sm80`, its workers
started with TF_FLASH_CUDA_FAMILY=sm80 (the sm_80 kernels on an H100): both families in one run, with
`--repeats` interleaved.

Repeats: `--repeats N` runs the whole mode list N times, modes interleaved (A B A B ...), each run in new
worker processes; the table gives the median run and the detail every run's median. Runs of one
configuration in different processes differ by up to ~10% on the H100 (XLA autotunes the model's GEMMs
per compilation; clocks): compare configurations with repeats, not with one run each.

Processes: each mode runs in its own worker process over the lengths in ascending order (`--isolate run`
starts one process per (mode, length) instead, at one TF start-up each). An OOM is recorded and the
longer lengths of that mode are skipped (memory grows with the length at fixed tokens per batch); a
worker that crashes or exceeds `--timeout` (seconds per length, the first one including the process
start-up) is recorded and a new worker goes on with the remaining lengths. `--time-limit` starts no
run past that many seconds after the start and marks the rest skipped.

Output: results/model.json and results/model.png (plot.py: time per step and peak memory against
tokens, one line per mode), rewritten after every run, so an interrupted run keeps what it measured; the
workers' output in results/model.log. `--out STEM` writes STEM.json, STEM.png and STEM.log instead.

    python benchmarks/bench_model.py --quick             # CPU smoke run, every mode at 64 tokens: results/quick/
    python benchmarks/bench_model.py                     # GPU: 4 blocks, 512..16k, all modes (XLA: ~1 min per run)
    python benchmarks/bench_model.py --blocks 12 --lengths 512,4096,16384,32768 --time-limit 0
    python benchmarks/bench_model.py --merge A.json B.json --out benchmarks/results/model
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import plot  # noqa: E402

# mode -> (attention layer, jit_compile given to compile(); "auto" = compile()'s default, not passed)
MODES = {  # in the order they run by default: what matters most first, should --time-limit cut the run
    "keras_mha_xla": ("keras", True),
    "flash_mha_xla": ("flash", True),
    "flash_mha_auto": ("flash", "auto"),
    "flash_mha_noxla": ("flash", False),
    "keras_flash_switch": ("keras_switch", "auto"),
    "keras_mha": ("keras", False),
}
BASELINE = "keras_mha_xla"
GPU_LENGTHS = [512, 1024, 4096, 8192, 16384]
QUICK = {"width": 64, "heads": 2, "blocks": 1, "vocab": 512, "classes": 4, "tokens_per_batch": 256,
         "lengths": [64], "warmup": 1, "steps": 2, "dtype": "float32", "timeout": 100, "time_limit": 0}
MISSING_SWITCH = "unavailable: tf_flash.keras missing"


# ---------------------------------------------------------------------------------------------------------
# Worker: one process, one mode, a list of lengths
# ---------------------------------------------------------------------------------------------------------

def _error_text(err):
    name = type(err).__name__
    text = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    whole = str(err).lower()
    if "ResourceExhausted" in name or "out of memory" in whole or "resource_exhausted" in whole:
        return "oom", f"{name}: {text}"
    return "error", f"{name}: {text}"


def _reset_cpu_peak():
    """Resets VmHWM to the current RSS (Linux >= 4.0), so the next read is this length's peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_peak_bytes():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB, whole process life


def _percentile(sorted_values, q):
    """Linear-interpolated percentile (q in [0, 1]) of a sorted list."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def build_model(cfg, seq_len, attention):
    """The encoder of the module docstring, with `attention` in "keras", "keras_switch" or "flash"."""
    import keras

    width, heads = cfg["width"], cfg["heads"]
    if attention == "flash":
        from tf_flash.layers import FlashMultiHeadAttention as attention_class
    else:
        attention_class = keras.layers.MultiHeadAttention

    class TokenAndPositionEmbedding(keras.layers.Layer):
        def __init__(self, vocab, length, width, **kwargs):
            super().__init__(**kwargs)
            self.tokens = keras.layers.Embedding(vocab, width)
            self.positions = keras.layers.Embedding(length, width)

        def call(self, ids):
            positions = keras.ops.arange(keras.ops.shape(ids)[-1])
            return self.tokens(ids) + self.positions(positions)[None]

    ids = keras.Input((seq_len,), dtype="int32", name="ids")
    x = TokenAndPositionEmbedding(cfg["vocab"], seq_len, width, name="embedding")(ids)
    mask = None
    if cfg.get("doc_tokens"):  # packed documents: each token attends within its own document
        doc = keras.ops.arange(seq_len) // cfg["doc_tokens"]
        mask = keras.ops.equal(doc[:, None], doc[None, :])[None]  # [1, T, T]
    for i in range(cfg["blocks"]):
        attended = attention_class(num_heads=heads, key_dim=width // heads, name=f"attention_{i}")(
            x, x, attention_mask=mask)
        x = keras.layers.LayerNormalization(name=f"norm_attention_{i}")(x + attended)
        hidden = keras.layers.Dense(4 * width, activation="gelu", name=f"mlp_in_{i}")(x)
        projected = keras.layers.Dense(width, name=f"mlp_out_{i}")(hidden)
        x = keras.layers.LayerNormalization(name=f"norm_mlp_{i}")(x + projected)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    logits = keras.layers.Dense(cfg["classes"], dtype="float32", name="head")(pooled)
    return keras.Model(ids, logits, name=f"encoder_{cfg['blocks']}x{width}")


def _flash_op_in_graph(model, batch, seq_len):
    """Whether tf_flash's op is in the traced forward graph (trace only, nothing runs)."""
    import tensorflow as tf
    fn = tf.function(lambda ids: model(ids, training=True))
    graph = fn.get_concrete_function(tf.TensorSpec([batch, seq_len], tf.int32)).graph
    return any("FlashAttention" in op.type for op in graph.get_operations())


def run_length(cfg, mode, seq_len, gpu):
    import warnings

    import keras
    import tensorflow as tf

    attention, jit = MODES[base_mode(mode)]
    batch = max(1, cfg["tokens_per_batch"] // seq_len)
    record = {"mode": mode, "seq_len": seq_len, "batch": batch, "tokens": batch * seq_len, "jit_compile": jit}
    keras.backend.clear_session()
    keras.config.set_dtype_policy(cfg["dtype"])
    if gpu:  # what earlier lengths of this process left allocated (it counts in the peak)
        record["gpu_in_use_before_build_bytes"] = tf.config.experimental.get_memory_info("GPU:0")["current"]
    t0 = time.perf_counter()
    model = build_model(cfg, seq_len, attention)
    compile_kwargs = {} if jit == "auto" else {"jit_compile": jit}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-4),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **compile_kwargs)
    record["jit_compile_resolved"] = bool(model.jit_compile)
    record["compile_warnings"] = sorted({str(w.message)[:200] for w in caught if "jit" in str(w.message)})
    record["params"] = int(model.count_params())
    ids = tf.random.stateless_uniform([batch, seq_len], seed=[1, seq_len], maxval=cfg["vocab"], dtype=tf.int32)
    labels = tf.random.stateless_uniform([batch], seed=[2, seq_len], maxval=cfg["classes"], dtype=tf.int32)
    record["build_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    model.train_on_batch(ids, labels)  # tracing + compilation
    record["first_step_s"] = time.perf_counter() - t0
    # The train function was built with model.jit_compile: this is what ran.
    record["xla_used"] = bool(model.jit_compile)
    for _ in range(cfg["warmup"]):
        model.train_on_batch(ids, labels)
    if gpu:
        tf.config.experimental.reset_memory_stats("GPU:0")
        record["memory_kind"] = "gpu_peak"
    else:
        record["memory_kind"] = "cpu_peak_rss" if _reset_cpu_peak() else "cpu_peak_rss_process_lifetime"
    times, loss = [], None
    for _ in range(cfg["steps"]):
        t = time.perf_counter()
        loss = model.train_on_batch(ids, labels)  # returns a Python float: waits for the step
        times.append(time.perf_counter() - t)
    record["peak_bytes"] = (tf.config.experimental.get_memory_info("GPU:0")["peak"] if gpu else _cpu_peak_bytes())
    times.sort()
    record.update({
        "status": "ok", "steps": len(times), "median_ms": 1e3 * statistics.median(times),
        "p10_ms": 1e3 * _percentile(times, 0.1), "p90_ms": 1e3 * _percentile(times, 0.9),
        "min_ms": 1e3 * times[0], "max_ms": 1e3 * times[-1],
        "loss": float(loss if isinstance(loss, float) else loss[0]),
    })
    record["tokens_per_s"] = batch * seq_len / (record["median_ms"] / 1e3)
    record["flash_op_in_graph"] = _flash_op_in_graph(model, batch, seq_len)
    return record


def _device_details(tf):
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return {"device": "CPU", "device_name": common._cpu_model()}
    details = tf.config.experimental.get_device_details(gpus[0])
    return {"device": "GPU", "device_name": details.get("device_name", "GPU"),
            "compute_capability": details.get("compute_capability")}


def worker_main(task_path):
    spawned = float(os.environ.get("BENCH_MODEL_SPAWNED", time.time()))
    with open(task_path) as f:
        task = json.load(f)
    cfg, mode, out_path = task["cfg"], task["mode"], task["results"]

    def emit(rec):
        with open(out_path, "a") as out:
            out.write(json.dumps(rec) + "\n")

    import tensorflow as tf
    import keras  # noqa: F401
    for gpu_device in tf.config.list_physical_devices("GPU"):
        tf.config.experimental.set_memory_growth(gpu_device, True)
    gpu = bool(tf.config.list_physical_devices("GPU"))
    if MODES[base_mode(mode)][0] == "flash":
        import tf_flash  # noqa: F401
    if MODES[base_mode(mode)][0] == "keras_switch":
        try:
            import tf_flash.keras as tf_flash_keras
        except ImportError as err:
            for seq_len in task["lengths"]:
                emit({"mode": mode, "seq_len": seq_len, "status": "unavailable", "detail": f"{MISSING_SWITCH} ({err})"})
            return
        tf_flash_keras.enable()
        keras.config.enable_flash_attention()
    env = dict(common.machine_info(gpu=gpu), **_device_details(tf))
    env["startup_s"] = time.time() - spawned
    emit({"env": env})
    skip_reason = None
    for seq_len in task["lengths"]:
        if skip_reason is None and task["deadline"] and time.time() > task["deadline"]:
            skip_reason = "skipped: --time-limit"
        if skip_reason:
            emit({"mode": mode, "seq_len": seq_len, "status": "skipped", "detail": skip_reason})
            continue
        emit({"start": seq_len, "time": time.time()})
        t0 = time.perf_counter()
        try:
            record = run_length(cfg, mode, seq_len, gpu)
        except Exception as err:  # noqa: BLE001 - recorded, the run goes on
            status, detail = _error_text(err)
            record = {"mode": mode, "seq_len": seq_len, "status": status, "detail": detail}
            if status == "oom" and cfg["skip_after_oom"]:
                skip_reason = f"skipped: OOM at {seq_len}"
        record["wall_s"] = time.perf_counter() - t0
        emit(record)
        import gc
        gc.collect()


# ---------------------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------------------

def _switch_module_present():
    """Whether tf_flash/keras(.py) exists, found without importing tf_flash (which imports TF)."""
    from importlib.machinery import PathFinder
    return PathFinder.find_spec("keras", [os.path.join(common.REPO, "tf_flash")]) is not None


def _gpu_present():
    """Whether nvidia-smi lists a GPU (asked without importing TensorFlow in this process)."""
    try:
        return bool(subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=30).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return False


def base_mode(mode):
    """`flash_mha_auto@sm80` -> `flash_mha_auto` (the mode with its kernel family held, --families)."""
    return mode.partition("@")[0]


def mode_family(mode):
    return mode.partition("@")[2] or None


def expand_families(modes, families):
    """Each mode that runs tf_flash's kernels once per family: "default" (the library's choice, the Hopper
    family on an H100) as the mode itself, "sm80" as `mode@sm80`; Keras' own attention once."""
    expanded = []
    for mode in modes:
        uses_tf_flash = MODES[mode][0] in ("flash", "keras_switch")
        expanded += [mode if f == "default" else f"{mode}@{f}" for f in families] if uses_tf_flash else [mode]
    return expanded


class Worker:
    """One worker process over some lengths of one mode; its records arrive through a JSON-lines file."""

    def __init__(self, cfg, mode, lengths, deadline, log_path):
        fd, self.task_path = tempfile.mkstemp(suffix=".json", prefix="bench_model_")
        self.results_path = self.task_path + ".results"
        open(self.results_path, "w").close()
        with os.fdopen(fd, "w") as f:
            json.dump({"cfg": cfg, "mode": mode, "lengths": lengths, "deadline": deadline,
                       "results": self.results_path}, f)
        env = dict(os.environ, BENCH_MODEL_SPAWNED=repr(time.time()))
        if mode_family(mode):  # read by the op library at its first GPU call
            env["TF_FLASH_CUDA_FAMILY"] = mode_family(mode)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        if cfg.get("xla_autotune_cache"):  # XLA reads its flags once, at start-up: per worker
            os.makedirs(cfg["xla_autotune_cache"], exist_ok=True)
            flag = f"--xla_gpu_per_fusion_autotune_cache_dir={cfg['xla_autotune_cache']}"
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
        self.log = open(log_path, "a")
        self.log.write(f"\n==== {mode} {lengths} ====\n")
        self.log.flush()
        self.spawned = time.time()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", self.task_path],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.seen = 0

    def new_records(self):
        with open(self.results_path) as f:
            lines = f.readlines()
        fresh = [json.loads(line) for line in lines[self.seen:] if line.endswith("\n")]
        self.seen += len(fresh)
        return fresh

    def kill(self):
        try:
            os.killpg(self.proc.pid, 9)
        except OSError:
            pass
        self.proc.wait()

    def close(self):
        self.log.close()
        for path in (self.task_path, self.results_path):
            try:
                os.unlink(path)
            except OSError:
                pass


def _log_tail(path, lines=3):
    """The telling lines of the last worker's output (its section of the log)."""
    try:
        with open(path) as f:
            text = f.read().rsplit("\n==== ", 1)[-1].strip().splitlines()[1:]
    except OSError:
        return ""
    signs = ("Check failed", "Abort", "Segmentation", "Killed", "out of memory", "Traceback", "Error:")
    strong = [line for line in text if any(sign in line for sign in signs)]
    return " | ".join((strong or text)[-lines:])[:300]


def _exit_text(returncode):
    return f"killed by signal {-returncode}" if returncode < 0 else f"exit {returncode}"


def run_mode(cfg, mode, lengths, args, state, on_record):
    """Runs one mode over `lengths` in worker processes (one per length with --isolate run), restarting
    after a crash or a timeout. on_record(record) is called for every finished or failed length."""
    remaining = list(lengths)
    log_path = state["log_path"]
    while remaining:
        if state["deadline"] and time.time() > state["deadline"]:
            for seq_len in remaining:
                on_record({"mode": mode, "seq_len": seq_len, "status": "skipped", "detail": "skipped: --time-limit"})
            return
        batch = remaining[:1] if args.isolate == "run" else remaining
        worker = Worker(cfg, mode, batch, state["deadline"], log_path)
        current, current_since, stopped, started_up = None, worker.spawned, None, False
        done = set()

        def take(records):
            nonlocal current, current_since, started_up
            for rec in records:
                if "env" in rec:
                    state["envs"].append(rec["env"])
                    started_up = True
                elif "start" in rec:
                    current, current_since = rec["start"], rec["time"]
                else:
                    current = None
                    done.add(rec["seq_len"])
                    on_record(rec)

        try:
            while worker.proc.poll() is None:
                take(worker.new_records())
                if time.time() - current_since > args.timeout:
                    stopped = f"timeout: no result after {args.timeout:.0f} s"
                    break
                time.sleep(0.5)
        finally:  # also when this process is told to stop: no worker outlives it
            if worker.proc.poll() is None:
                worker.kill()
        take(worker.new_records())  # what came in while it ended
        worker.close()
        unfinished = [s for s in batch if s not in done]
        if unfinished:  # the worker died or was stopped before it finished its lengths
            victim = current if current in unfinished else unfinished[0]
            detail = stopped or f"worker {_exit_text(worker.proc.returncode)}: {_log_tail(log_path)}"
            status = "timeout" if stopped else "crashed"
            wall = time.time() - (current_since if current == victim else worker.spawned)
            on_record({"mode": mode, "seq_len": victim, "status": status, "detail": detail, "wall_s": wall})
            done.add(victim)
            if stopped or not started_up:  # longer lengths would time out too; a start-up crash repeats
                why = f"skipped: timeout at {victim}" if stopped else f"skipped: worker start-up failed ({detail})"
                for seq_len in [s for s in remaining if s not in done and (s > victim or not started_up)]:
                    on_record({"mode": mode, "seq_len": seq_len, "status": "skipped", "detail": why})
                    done.add(seq_len)
        remaining = [s for s in remaining if s not in done]


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------

def _gib(value):
    return None if value is None else value / 2**30


def write_outputs(records, state, args, cfg):
    """STEM.json and STEM.png (plot.py); returns the payload."""
    payload = {"benchmark": "model", "info": state["envs"][0] if state["envs"] else common.host_info(),
               "command": state["command"], "config": cfg, "modes": args.modes,
               "worker_environments": state["envs"][1:], "elapsed_s": time.time() - state["t0"], "results": records}
    if state.get("interrupted"):
        payload["interrupted"] = state["interrupted"]
    plot.save(payload, args.out + ".json")
    return payload


def _progress_line(rec, t0):
    head = f"[{time.time() - t0:5.0f}s] {rec['mode']:18s} s={rec['seq_len']:<6d}"
    if rec["status"] == "ok":
        return (f"{head} b={rec['batch']:<4d} {rec['median_ms']:8.2f} ms/step (p10-p90 {rec['p10_ms']:.2f}-"
                f"{rec['p90_ms']:.2f})  {rec['tokens_per_s'] / 1e3:8.1f}k tok/s"
                f"  peak {_gib(rec['peak_bytes']):6.2f} GiB"
                f"  xla={'yes' if rec['xla_used'] else 'no'} flash_op={'yes' if rec['flash_op_in_graph'] else 'no'}"
                f"  first step {rec['first_step_s']:.1f} s, run {rec.get('wall_s', 0):.1f} s")
    return f"{head} {rec['status'].upper()}: {rec.get('detail', '')[:160]}" + (
        f" (run {rec['wall_s']:.1f} s)" if rec.get("wall_s") else "")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, 2 lengths, 2 timed steps")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    p.add_argument("--lengths", default=None, help="comma-separated tokens per sequence (default "
                   + ",".join(map(str, GPU_LENGTHS)) + "; the full sweep adds 2048 and 32768)")
    p.add_argument("--blocks", type=int, default=None, help="encoder blocks (4 default; 12 = BERT-base)")
    p.add_argument("--width", type=int, default=None, help="model width (768)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (12; head dim = width / heads)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (30522, BERT's)")
    p.add_argument("--classes", type=int, default=None, help="classes of the head (8)")
    p.add_argument("--tokens-per-batch", type=int, default=None, help="batch x tokens (16384)")
    p.add_argument("--doc-tokens", type=int, default=None,
                   help="packed documents of this many tokens: a block-diagonal attention_mask [1, T, T] "
                        "(each token sees its own document; default none)")
    p.add_argument("--dtype", default=None, help="Keras dtype policy (mixed_bfloat16 on the GPU, float32 on the CPU)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps after the first (default 3)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per (mode, length) run (300)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="start no run past this many seconds (420 on the GPU, for the 10-minute lent command; 0: none)")
    p.add_argument("--isolate", choices=["mode", "run"], default="mode",
                   help="one worker process per mode (default) or per (mode, length)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the mode list this many times, modes interleaved, in new processes (median run)")
    p.add_argument("--families", default="default",
                   help="tf_flash's CUDA kernel families to compare, from: default, sm80 (e.g. default,sm80: "
                   "each tf_flash mode also runs as MODE@sm80, with TF_FLASH_CUDA_FAMILY=sm80)")
    p.add_argument("--xla-autotune-cache", metavar="DIR", default=None,
                   help="share XLA's GPU autotuning results between the workers through DIR "
                   "(--xla_gpu_per_fusion_autotune_cache_dir): later workers skip re-autotuning (XLA's first step "
                   "takes 50-90 s per length) and every mode gets the same GEMM algorithms; off by default")
    p.add_argument("--no-skip-after-oom", action="store_true", help="try the longer lengths after an OOM")
    p.add_argument("--out", default=None, help="output stem (default OUT_DIR/model)")
    p.add_argument("--out-dir", default=None, help="folder of the default stem (benchmarks/results; with --quick "
                   "benchmarks/results/quick, git-ignored)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="write one report from the json files of runs of the "
                   "same configuration (e.g. modes split over two GPU commands); later files win per (mode, length)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return args


def make_config(args):
    gpu = _gpu_present()
    base = {"width": 768, "heads": 12, "blocks": 4, "vocab": 30522, "classes": 8, "tokens_per_batch": 16384,
            "lengths": GPU_LENGTHS, "warmup": 3, "steps": 20, "dtype": "mixed_bfloat16" if gpu else "float32",
            "timeout": 300, "time_limit": 420 if gpu else 0}
    if args.quick:
        base.update(QUICK)
    overrides = {"width": args.width, "heads": args.heads, "blocks": args.blocks, "vocab": args.vocab,
                 "classes": args.classes, "tokens_per_batch": args.tokens_per_batch, "dtype": args.dtype,
                 "doc_tokens": args.doc_tokens,
                 "warmup": args.warmup, "steps": args.steps, "timeout": args.timeout, "time_limit": args.time_limit,
                 "lengths": [int(s) for s in args.lengths.split(",")] if args.lengths else None}
    base.update({k: v for k, v in overrides.items() if v is not None})
    if base["width"] % base["heads"]:
        raise SystemExit(f"--width must be a multiple of --heads. "
                         f"Received: width={base['width']}, heads={base['heads']}")
    if base["warmup"] < 0 or base["steps"] < 1:
        raise SystemExit(f"--steps must be >= 1 and --warmup >= 0. Received: steps={base['steps']}, "
                         f"warmup={base['warmup']}")
    base["lengths"] = sorted(set(base["lengths"]))
    base["skip_after_oom"] = not args.no_skip_after_oom
    base["xla_autotune_cache"] = os.path.abspath(args.xla_autotune_cache) if args.xla_autotune_cache else None
    return base, gpu


def merge_main(args):
    payloads = [plot.load(path) for path in args.merge]
    cfg = payloads[0]["config"]
    for path, payload in zip(args.merge[1:], payloads[1:]):
        differing = sorted(k for k in set(cfg) | set(payload["config"])
                           if k not in ("lengths", "time_limit", "timeout", "xla_autotune_cache")
                           and cfg.get(k) != payload["config"].get(k))
        if differing:
            received = ", ".join(f"{k}={payload['config'].get(k)!r}" for k in differing)
            raise SystemExit(f"--merge: {path} was run with another configuration than {args.merge[0]}. "
                             f"Received: {received}")
    merged, modes = {}, []
    for payload in payloads:
        for rec in payload["results"]:
            merged[(rec["mode"], rec["seq_len"], rec.get("repeat"))] = rec
        modes += [m for m in payload["modes"] if m not in modes]
    cfg = dict(cfg, lengths=sorted({s for p in payloads for s in p["config"]["lengths"]}))
    args.modes = sorted(modes, key=lambda m: (list(MODES).index(base_mode(m)), m))
    envs = [e for p in payloads for e in [p.get("info")] + p.get("worker_environments", []) if e]
    state = {"t0": time.time() - sum(p["elapsed_s"] for p in payloads), "envs": envs,
             "command": " + ".join(p["command"] for p in payloads) + " (merged)"}
    args.out = args.out or os.path.join(common.RESULTS_DIR, "model")
    payload = write_outputs(list(merged.values()), state, args, cfg)
    print(f"bench_model: merged {len(args.merge)} runs into {args.out}.json\n\n{plot.tables(payload)}")
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    if args.merge:
        return merge_main(args)
    cfg, gpu = make_config(args)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes must be among {', '.join(MODES)}. Received: modes={','.join(unknown)}")
    args.timeout = cfg["timeout"]
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1. Received: repeats={args.repeats}")
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    if not families or any(f not in ("default", "sm80") for f in families):
        raise SystemExit(f"--families must be a comma-separated list from: default, sm80. "
                         f"Received: families={args.families}")
    args.modes = expand_families(args.modes, families)
    args.out = args.out or os.path.join(common.output_dir(args.out_dir, args.quick), "model")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    t0 = time.time()
    state = {"t0": t0, "deadline": t0 + cfg["time_limit"] if cfg["time_limit"] else 0, "envs": [],
             "log_path": args.out + ".log",
             "command": "python benchmarks/bench_model.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    open(state["log_path"], "w").close()
    print(f"bench_model: {cfg['blocks']} blocks x {cfg['width']}, {cfg['heads']} heads, {cfg['dtype']}, "
          f"{cfg['tokens_per_batch']} tokens/batch, lengths {cfg['lengths']}, modes {args.modes}; "
          f"workers' output in {state['log_path']}", flush=True)
    records = []
    lock = threading.Lock()

    def on_record(rec):
        with lock:
            records.append(rec)
            print(_progress_line(rec, t0), flush=True)
            write_outputs(records, state, args, cfg)

    def stop(signum, _frame):
        state["interrupted"] = f"Interrupted by signal {signum}: the runs not listed did not run."
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)  # `timeout` ends the run: keep what was measured, stop the worker
    try:
        for repeat in range(args.repeats):
            def on_run_record(rec, repeat=repeat):
                on_record(dict(rec, repeat=repeat) if args.repeats > 1 else rec)

            for mode in args.modes:
                if MODES[base_mode(mode)][0] == "keras_switch" and not _switch_module_present():
                    if repeat == 0:
                        for seq_len in cfg["lengths"]:
                            on_record({"mode": mode, "seq_len": seq_len, "status": "unavailable",
                                       "detail": MISSING_SWITCH})
                    continue
                run_mode(cfg, mode, cfg["lengths"], args, state, on_run_record)
    finally:
        payload = write_outputs(records, state, args, cfg)
    print(f"bench_model: done in {time.time() - t0:.0f} s: {args.out}.json, .png\n\n{plot.tables(payload)}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
